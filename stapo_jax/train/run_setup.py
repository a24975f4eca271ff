"""What an RL run builds before its first step (:class:`Run`, made by :func:`setup_run`): the compile listener,
mesh, recipe, tokenizer, model, prompts, reward scorer, run folder, checkpointer, metrics logger and the SIGTERM
handler. Every resource that needs closing is handed to the caller's ``contextlib.ExitStack`` as soon as it
exists, so a run that fails half-way through its setup releases what it had already opened.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import grain  # noqa: F401  (see below)
import jax

# Importing Grain runs etils' ``lazy_imports``, which swaps ``builtins.__import__`` process-wide for a moment: an
# import in another thread then gets a lazy stand-in (the reward pool's manager thread failed with "'LazyModule'
# object is not callable" when the prompt iterator imported Grain after the pool had started). Imported here,
# before ``setup_run`` starts any thread (tests/train/test_thread_safe_imports.py).

from models.attention import resolve_implementation
from stapo_jax.config.schema import Config, ModelConfig
from stapo_jax.core.errors import ConfigError
from stapo_jax.data.prompts import examples_fingerprint, load_prompt_dataset
from stapo_jax.data.tokenizer import pad_token_id
from stapo_jax.rewards import make_scorer
from stapo_jax.runtime import build
from stapo_jax.runtime.allocator import ENV_ALLOCATOR, allocator_mode, loaded_allocator
from stapo_jax.runtime.checkpoint import Checkpointer
from stapo_jax.runtime.compile_stats import CompileStats, enable_compilation_cache, resolve_cache_dir
from stapo_jax.runtime.distributed import check_same_config
from stapo_jax.runtime.stopping import Preemption
from stapo_jax.runtime.watchdog import progress
from stapo_jax.train.metrics import MetricsLogger
from stapo_jax.train.packing import packing_long_rows
from stapo_jax.train.precompile import precompile_enabled
from stapo_jax.train.run_dir import check_resume_settings, claim_run_dir, has_checkpoints, record_start
from stapo_jax.train.run_files import check_run_dir, load_val_examples, set_aside_earlier_run
from stapo_jax.train.batch_shapes import check_batch_shapes

log = logging.getLogger(__name__)


@dataclass
class Run:
    """The objects and derived settings of one RL run (built once by :func:`setup_run`)."""

    run_dir: str               # trainer.run_dir, absolute
    main_process: bool         # JAX process 0: writes config, summary, plots, the HF export; prints the report
    bounded: bool              # trainer.precompile resolved: fixed update shapes, compiled in RL step 1
    stats: CompileStats        # every compile of the run (listening until the run's ExitStack closes)
    mesh: Any
    recipe: Any
    tok: Any
    pad_id: int
    model: Any
    train_ds: Any              # data.prompts.PromptDataset of the train split
    val_examples: list         # held-out prompts ([] without a validation split)
    scorer: Any
    ckpt: Checkpointer
    logger: MetricsLogger
    preempt: Preemption        # SIGTERM / SIGINT: stop at the next agreed point (10 SFT steps, an RL step), exit 0
    resuming: bool             # trainer.resume and a checkpoint exists
    mini_rows: int             # global rows per mini-batch (ppo_mini_batch_size x rollout.n)
    num_micro_batches: int     # K from the mesh (batch_shapes.check_batch_shapes)
    long_rows: bool            # packed update: one long row per micro-batch (packing_long_rows)
    max_prompt_length: Optional[int]  # data.max_prompt_length with fixed shapes, else None (tightest)
    packed: bool               # model.use_remove_padding


def setup_run(cfg: Config, stack: contextlib.ExitStack) -> Run:
    """Check ``cfg`` and build everything the RL loop needs; each resource that must be closed (compile listener,
    reward scorer, checkpointer, metrics logger, SIGTERM handler) is registered on ``stack`` when it is opened,
    so it is released when ``stack`` closes, also when a later setup step raises; the run directory is made,
    locked and checked (:func:`claim_run_dir_for`) before any data is loaded. At the end of a run they close
    in the order listener, SIGTERM handler, logger, checkpointer, scorer. Every check that can reject the config
    runs before anything is written into ``trainer.run_dir``. Takes objects and int / bool fields.
    Raises: ConfigError (missing ``trainer.total_steps``, inconsistent batch or mesh), AttentionError, OSError
    (unwritable run folder or cache directory), and what the builders raise. Source: verl
    ``RayPPOTrainer.__init__`` / ``init_workers`` (everything built before ``fit``)."""
    t = cfg.trainer
    if not t.total_steps:
        raise ConfigError("trainer.total_steps must be set for an RL run (stapo_spec §10 item 15)")
    cfg.check_rl_ready()
    run_dir = os.path.abspath(t.run_dir)
    cache_dir = enable_compilation_cache(resolve_cache_dir(t.compilation_cache_dir))  # before the first compile
    stats = stack.enter_context(CompileStats())  # every compile of the run, through JAX's monitoring events
    bounded = precompile_enabled(t.precompile)  # fixed update shapes, compiled in RL step 1 before its update
    main_process = jax.process_index() == 0  # process 0 writes metrics, plots, summary and the HF export
    check_same_config(cfg)  # all processes started with the same settings (names the differing keys)
    check_run_dir(run_dir)  # a folder this user cannot write: one line naming trainer.run_dir, before any work
    mesh = build.build_mesh(cfg)
    mini_rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n  # global rows per mini-batch (same on every process)
    k = check_batch_shapes(cfg, mesh)  # every batch-shape error at once, with the nearest values that work
    long_rows = log_kernels(cfg.model)
    claim_run_dir_for(cfg, run_dir, main_process, stack)  # before any data is loaded or model built
    recipe, tok = build.build_recipe(cfg), build.build_tokenizer(cfg)
    model = build.build_model(cfg, mesh, tok, seed=t.seed)
    progress("setup")  # each setup boundary counts as progress (compiles in between cannot mark)
    train_ds, val_examples = load_run_data(cfg, tok)
    scorer = make_scorer(cfg.reward, gym_task=cfg.data.gym.task, extensions=cfg.extensions, on_progress=progress)
    stack.callback(scorer.close)
    progress("setup")
    if not t.resume:
        set_aside_earlier_run(run_dir, main_process)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), save_every=t.save_every or t.total_steps,
                        keep=t.keep_checkpoints)
    stack.callback(ckpt.close)
    resuming = t.resume and ckpt.latest_step() is not None
    if main_process:  # config_history/ gets this start's settings; config.yaml stays the run's (run_dir.py)
        record_start(cfg, run_dir, resuming)
    logger = MetricsLogger.from_config(  # trainer.logger: console / tensorboard / wandb, on process 0
        run_dir if main_process else os.path.join(run_dir, f"process_{jax.process_index()}"), cfg,
        main_process=main_process)
    stack.callback(logger.close)
    log.info("compilation cache: %s; trainer.precompile=%s (%s)", cache_dir or "off", t.precompile,
             "fixed update shapes" if bounded else "tightest shapes per batch")
    preempt = Preemption()  # from here on SIGTERM / SIGINT: stop at the next agreed point, exit 0
    stack.callback(preempt.restore)
    stack.callback(stats.close)  # idempotent: first to close at the end of the run (the ExitStack is LIFO)
    return Run(run_dir=run_dir, main_process=main_process, bounded=bounded, stats=stats, mesh=mesh, recipe=recipe,
               tok=tok, pad_id=pad_token_id(tok), model=model, train_ds=train_ds, val_examples=val_examples,
               scorer=scorer, ckpt=ckpt, logger=logger, preempt=preempt, resuming=resuming, mini_rows=mini_rows,
               num_micro_batches=k, long_rows=long_rows, packed=cfg.model.use_remove_padding,
               max_prompt_length=cfg.data.max_prompt_length if bounded else None)


def claim_run_dir_for(cfg: Config, run_dir: str, main_process: bool, stack: contextlib.ExitStack) -> None:
    """Make ``run_dir`` (a path that cannot be made is one line naming ``trainer.run_dir``), lock it for this run
    (released when ``stack`` closes) and, when this start will resume its checkpoints, check that the settings
    that cannot change mid-run are the run's (``run_dir.check_resume_settings``). A collective (the lock's
    agreement). Raises: ConfigError naming ``trainer.run_dir``, the lock's holder or the differing keys. Source:
    issue 43 (one run per run directory)."""
    check_run_dir(run_dir, create=True)
    claim_run_dir(run_dir, main_process, stack)
    if cfg.trainer.resume and has_checkpoints(run_dir):
        changed = check_resume_settings(cfg, run_dir)
        if changed:
            log.info("resuming %s with changed settings %s (config_history/ records this start)", run_dir,
                     ", ".join(changed))


def log_kernels(model_cfg: ModelConfig) -> bool:
    """Resolve ``model.attention`` and log the host allocator, the attention kernel and the packing mode;
    returns ``packing_long_rows`` of the kernel (bool: a packed micro-batch is one long row).
    Raises: AttentionError for a kernel this backend cannot run (names ``model.attention``). Source: the
    trainer's setup lines (docs/runtime.md, Host allocator; models/attention.py)."""
    attention = resolve_implementation(model_cfg.attention, model_cfg.dtype)
    long_rows = packing_long_rows(attention)
    log.info("host allocator: %s (%s=%s; docs/runtime.md, Host allocator)", loaded_allocator(), ENV_ALLOCATOR,
             allocator_mode(os.environ))
    log.info("model.attention=%s: %s kernel (update, old-log-prob pass and prefill)", model_cfg.attention, attention)
    if model_cfg.use_remove_padding:
        log.info("model.use_remove_padding: the old-log-prob pass and the update run on packed rows (%s)",
                 "one row per micro-batch" if long_rows else "rows of at most P + R tokens")
    return long_rows


def load_run_data(cfg: Config, tok) -> tuple[Any, list[dict]]:
    """The train split (a ``PromptDataset``) and the held-out examples (list of dicts with int token ids), checked
    to be the same on every process (each host may read its own copy of the files; compared by sha256).
    Raises: what ``load_prompt_dataset`` raises for missing / bad data files, and DistributedError from
    ``check_same_config`` naming the differing fingerprints. Source: verl's train / val dataloaders."""
    train_ds = load_prompt_dataset(cfg, tok, "train")
    val_examples = load_val_examples(cfg, tok)
    check_same_config({"train_prompts_sha256": train_ds.fingerprint,
                       "val_prompts_sha256": examples_fingerprint(val_examples)},
                      what="training data", fix="every process must read the same data files (the same contents "
                      "on every host) with the same tokenizer")
    return train_ds, val_examples
