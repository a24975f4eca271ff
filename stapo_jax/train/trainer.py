"""The RL loop (stapo-jax train): prompts -> rollouts -> rewards -> advantages -> mini-batch updates ->
weight sync -> metrics and checkpoints (the diagram in DESIGN.md); every piece lives in its own module
(build, experience, update, train_step, checkpoint, metrics, run_files).
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np
from flax import nnx

from stapo_jax.runtime import build
from stapo_jax.runtime.checkpoint import Checkpointer, export_hf
from stapo_jax.runtime.allocator import ENV_ALLOCATOR, allocator_mode, loaded_allocator
from stapo_jax.config.schema import Config, ConfigError, load_config
from stapo_jax.data.prompts import examples_fingerprint, load_prompt_dataset, make_iterator
from stapo_jax.runtime.distributed import check_same_config
from stapo_jax.runtime.watchdog import StallWatchdog, progress, resolve_timeout
from stapo_jax.runtime.compile_stats import CompileStats, enable_compilation_cache, resolve_cache_dir
from stapo_jax.train.precompile import (precompile_enabled, precompile_sampler, precompile_update,
                                        update_geometries)
from stapo_jax.train.steady_state import run_report, update_work
from stapo_jax.train.experience import collect_experience, heldout_accuracy
from stapo_jax.train.metrics import MetricsLogger
from stapo_jax.rewards import make_scorer
from stapo_jax.rollout import build_rollout
from stapo_jax.rollout.multihost import coordination_seconds
from stapo_jax.train.run_files import (DUMP_ENV, check_run_dir, check_same_model, dump_experience,
                                       earlier_summary, load_val_examples, set_aside_earlier_run, sft_warmup,
                                       write_plots, write_summary)
from stapo_jax.train.train_step import make_update_steps
from stapo_jax.train.optim import build_optimizer
from stapo_jax.data.tokenizer import pad_token_id
from models.attention import resolve_implementation
from stapo_jax.train.packing import packing_long_rows
from stapo_jax.train.sft import check_batch_size as check_sft_batch_size
from stapo_jax.train.train_step import TrainState, make_log_prob_fn
from stapo_jax.train.update import (Preemption, all_finite, balance_allowed, data_parallel_size, num_micro_batches,
                                   stop_requested, token_budget_micro_batches, update_policy)

log = logging.getLogger(__name__)


def train(cfg: Config) -> dict[str, Any]:
    """Run ``cfg`` (SFT warm-up if ``sft.steps`` > 0, then RL for ``trainer.total_steps``); returns a summary
    with held-out accuracy before/after RL (when a validation split exists), final step and run directory.

    A stall watchdog (``trainer.stall_timeout_s``, :mod:`stapo_jax.runtime.watchdog`) runs throughout: no progress
    for that long dumps all thread stacks and exits the process with code 75.

    Raises:
      ConfigError: missing ``trainer.total_steps`` or an inconsistent batch configuration.
    Takes no arrays (a ``Config``); the summary holds Python floats / ints / str. Source: stapo_spec.md §2 (the RL
    loop), verl ``RayPPOTrainer.fit``.
    """
    with StallWatchdog(resolve_timeout(cfg.trainer.stall_timeout_s, jax.default_backend()),
                       process_index=jax.process_index()):
        return _train(cfg)


def _train(cfg: Config) -> dict[str, Any]:
    if not cfg.trainer.total_steps:
        raise ConfigError("trainer.total_steps must be set for an RL run (stapo_spec §10 item 15)")
    cfg.check_rl_ready()
    t = cfg.trainer
    run_dir = os.path.abspath(t.run_dir)
    cache_dir = enable_compilation_cache(resolve_cache_dir(t.compilation_cache_dir))  # before the first compile
    stats = CompileStats().start()  # every compile of the run, through JAX's monitoring events
    bounded = precompile_enabled(t.precompile)  # fixed update shapes, compiled in RL step 1 before its update
    main_process = jax.process_index() == 0  # process 0 writes metrics, plots, summary and the HF export
    check_same_config(cfg)  # all processes started with the same settings (names the differing keys)
    check_run_dir(run_dir)  # a folder this user cannot write: one line naming trainer.run_dir, before any work
    mesh = build.build_mesh(cfg)
    G = cfg.rollout.n
    mini_rows = cfg.actor.ppo_mini_batch_size * G  # global rows per mini-batch (the same on every process)
    # every check that can reject the config runs before anything is written into run_dir
    k = num_micro_batches(cfg, mini_rows, mesh)
    if cfg.sft.steps:
        check_sft_batch_size(cfg.sft.batch_size, mesh)
    attention = resolve_implementation(cfg.model.attention, cfg.model.dtype)
    long_rows = packing_long_rows(attention)
    log.info("host allocator: %s (%s=%s; docs/runtime.md, Host allocator)", loaded_allocator(), ENV_ALLOCATOR,
             allocator_mode(os.environ))
    log.info("model.attention=%s: %s kernel (update, old-log-prob pass and prefill)", cfg.model.attention, attention)
    if cfg.model.use_remove_padding:
        log.info("model.use_remove_padding: the old-log-prob pass and the update run on packed rows (%s)",
                 "one row per micro-batch" if long_rows else "rows of at most P + R tokens")
    recipe = build.build_recipe(cfg)
    tok = build.build_tokenizer(cfg)
    pad_id = pad_token_id(tok)
    model = build.build_model(cfg, mesh, tok, seed=t.seed)
    progress("setup")  # each setup boundary counts as progress (compiles in between cannot mark)
    train_ds = load_prompt_dataset(cfg, tok, "train")
    val_examples = load_val_examples(cfg, tok)
    check_same_config({"train_prompts_sha256": train_ds.fingerprint,  # each host may read its own copy of the files
                       "val_prompts_sha256": examples_fingerprint(val_examples)},
                      what="training data", fix="every process must read the same data files (the same contents "
                      "on every host) with the same tokenizer")
    scorer = make_scorer(cfg, on_progress=progress)
    progress("setup")
    check_run_dir(run_dir, create=True)
    if not t.resume:
        set_aside_earlier_run(run_dir, main_process)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), save_every=t.save_every or t.total_steps,
                        keep=t.keep_checkpoints)
    resuming = t.resume and ckpt.latest_step() is not None
    if resuming:
        check_same_model(cfg, run_dir)
    if main_process:
        cfg.save(run_dir)
    logger = MetricsLogger.from_config(  # trainer.logger: console / tensorboard / wandb, on process 0
        run_dir if main_process else os.path.join(run_dir, f"process_{jax.process_index()}"), cfg,
        main_process=main_process)
    summary: dict[str, Any] = {"run_dir": run_dir}
    log.info("compilation cache: %s; trainer.precompile=%s (%s)", cache_dir or "off", t.precompile,
             "fixed update shapes" if bounded else "tightest shapes per batch")
    rows: list[dict] = []  # every RL step's metrics (the steady-state summary)
    preempt = Preemption()  # from here on SIGTERM: stop at the next agreed point (10 SFT steps, an RL step), exit 0
    try:
        if cfg.sft.steps and not resuming and not sft_warmup(cfg, model, train_ds.examples, tok, logger,
                                                             should_stop=lambda: progress("sft") or
                                                             stop_requested(preempt)):
            logger.write("SIGTERM during the SFT warm-up: stopping before RL; nothing is saved, a restart runs the "
                         "warm-up again")
            summary.update(final_step=0, preempted=True)
            return summary  # the finally below closes the logger, checkpointer and reward pool
        rollout = build_rollout(cfg, model, mesh, tok)
        progress("setup")
        if bounded and cfg.rollout.mode == "inprocess":  # every rollout program, before the first rollout
            precompile_sampler(rollout, greedy=bool(val_examples), stats=stats, progress=logger.progress)
        if val_examples and not resuming:
            progress("eval")
            acc = heldout_accuracy(rollout, val_examples, tok, scorer, max_new_tokens=cfg.rollout.max_new_tokens,
                                   progress=logger.progress, desc="held-out (before RL)")
            summary["heldout_acc_before"] = acc
            logger.write(f"held-out accuracy before RL: {acc:.4f} ({len(val_examples)} problems, greedy)")
            if main_process:  # kept for a resumed run, which does not measure it again
                write_summary(run_dir, {"heldout_acc_before": acc})
        elif val_examples and (acc := earlier_summary(run_dir).get("heldout_acc_before")) is not None:
            summary["heldout_acc_before"] = acc
            logger.write(f"held-out accuracy before RL: {acc:.4f} (measured by the run's first start)")
        optimizer = build_optimizer(cfg)
        state = TrainState.create(model, optimizer, mesh)
        progress("setup")
        common = dict(temperature=cfg.rollout.temperature, seq_chunk=cfg.actor.logprob_seq_chunk or 512,
                      vocab_chunk=cfg.actor.logprob_vocab_chunk)
        shardings = jax.tree.map(lambda x: x.sharding, state)
        # donate: the optimizer update writes the new parameters and moments into the old state's buffers (no
        # second copy of the model and optimizer state per mini-batch); the rollout engine is re-synced from the
        # returned state after every update (sync_weights below), never reading a donated buffer
        step_kw = dict(num_micro_batches=k, vocab_size=model.config.vocab_size, mesh=mesh,
                       state_shardings=shardings, donate=True, **common)
        steps: dict = {}  # K -> (first step, step, old-log-prob fn), compiled on first use

        def steps_for(kk: int):
            if kk not in steps:
                steps[kk] = (*make_update_steps(recipe, optimizer, **{**step_kw, "num_micro_batches": kk}),
                             jax.jit(make_log_prob_fn(num_micro_batches=kk, **common), static_argnums=(1, 4)))
            return steps[kk]
        # every process iterates the same global prompt batches (rollouts and rewards split them, multihost.py)
        data_it = make_iterator(train_ds.examples, t.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                shard_index=0, shard_count=1)
        # the RL seed stream lives on the host (numpy): identical on every process, checkpointed by process 0
        rng = np.asarray(jax.random.key_data(jax.random.PRNGKey(t.seed)))
        start = 0
        if resuming:
            start, restored, data_state, meta = ckpt.restore({"train": state, "rng": rng})
            state, rng = restored["train"], np.asarray(restored["rng"])
            if meta.get("dataset_fingerprint") not in (None, train_ds.fingerprint):
                log.warning("the training prompts differ from those of the checkpointed run: the resumed run "
                            "will not see the same samples as an uninterrupted one")
            data_it.set_state(data_state["iterator"])
            logger.write(f"resumed from step {start} ({ckpt.directory})")
            rollout.sync_weights(state.params)
            logger.skip_to(start)
        if cfg.rollout.mode != "inprocess":
            log.warning("rollout.mode=%s: JetStream 0.2.2 cannot receive weights, so rollouts keep coming from the "
                        "server's policy while the trainer's moves on (off-policy; ratios are still computed "
                        "against the trainer's θ_old). Restart the server from a new export to refresh it.",
                        cfg.rollout.mode)
        summary["final_step"] = start
        stop = stop_requested(preempt)  # SIGTERM to any process stops all at the same step
        for step in range(start, t.total_steps if not stop else start):
            t0 = time.perf_counter()
            progress("rollout", step=step + 1)
            stats.take_step(count=False)  # compiles between steps (checkpoint saves): in the table only
            coordination_seconds(reset=True)
            rng, sub = (np.asarray(x) for x in jax.random.split(rng))
            seed = int(jax.random.randint(jax.random.wrap_key_data(sub), (), 0, 2**31 - 1))
            with stats.phase("experience"):  # rewards, advantages; the sampling inside is phase "rollout"
                exp = collect_experience(rollout, data_it, scorer, tok, recipe, group_size=G,
                                         max_new_tokens=cfg.rollout.max_new_tokens, seed=seed, pad_id=pad_id,
                                         max_prompt_length=cfg.data.max_prompt_length if bounded else None,
                                         fixed_response_length=bounded, compile_phase=stats.phase)
            t1 = time.perf_counter()
            if main_process and os.environ.get(DUMP_ENV):  # opt-in debug dump (layout-equivalence tests)
                dump_experience(os.environ[DUMP_ENV], step + 1, exp)
            # packed, where the micro-batch does not matter: fewer, fuller micro-batches of variable sequence
            # counts within one padded micro-batch's tokens (dummy slots fill the fixed shapes)
            kk, slots = k, None
            if cfg.model.use_remove_padding and balance_allowed(recipe) and not bounded:
                kk, slots = token_budget_micro_batches(exp.arrays["attention_mask"], mini_rows=mini_rows,
                                                       num_micro_batches=k, num_shards=data_parallel_size(mesh),
                                                       long_rows=long_rows,
                                                       max_sequences=cfg.actor.sequences_cap())
            progress("update")
            first_fn, step_fn, log_prob_fn = steps_for(kk)
            update_kw = dict(mini_rows=mini_rows, ppo_epochs=cfg.actor.ppo_epochs, mesh=mesh, num_micro_batches=kk,
                             use_remove_padding=cfg.model.use_remove_padding, long_rows=long_rows)
            geometries = update_geometries(mini_rows, kk, data_parallel_size(mesh), exp.arrays["input_ids"].shape[1],
                                           long_rows) if bounded and cfg.model.use_remove_padding else None
            if bounded and step == start:  # every update program of the run, before the first update runs
                precompile_update(state, exp, (first_fn, step_fn), log_prob_fn, geometries or [None],
                                  stats=stats, progress=logger.progress, **update_kw)
            with stats.phase("update"):
                state, m = update_policy(state, exp, (first_fn, step_fn), log_prob_fn, slots=slots,
                                         geometries=geometries, **update_kw)
            t2 = time.perf_counter()
            if not bool(all_finite(state.params)):
                raise FloatingPointError(f"parameters became non-finite in RL step {step + 1} (loss "
                                         f"{m.get('loss')}, grad_norm {m.get('grad_norm')}); stopping without "
                                         f"checkpointing or exporting them")
            progress("sync")
            with stats.phase("sync"):
                sync_s = rollout.sync_weights(state.params) if cfg.rollout.mode == "inprocess" else 0.0
            stop = stop_requested(preempt)
            m["rollout/stale_policy"] = float(cfg.rollout.mode != "inprocess")
            m.update(exp.metrics)
            step_end, coord_s = time.perf_counter(), coordination_seconds()  # both before the optional eval
            if t.eval_every and val_examples and (step + 1) % t.eval_every == 0:
                progress("eval")
                with stats.phase("eval"):
                    m["val/acc"] = heldout_accuracy(rollout, val_examples, tok, scorer,
                                                    max_new_tokens=cfg.rollout.max_new_tokens)
            n_tokens = float(exp.arrays["attention_mask"].sum())
            c = stats.take_step()  # compile time is reported apart (time/compile/*) and left out of time/*
            compile_of = lambda *ph: sum(c.get(f"time/compile/{p}", 0.0) for p in ph)  # noqa: E731
            step_s = step_end - t0 - (c["perf/compile_s"] - compile_of("eval"))
            for key, phases in (("time/rollout", ("rollout",)), ("time/experience", ("rollout", "experience"))):
                if key in m:
                    m[key] = max(m[key] - compile_of(*phases), 0.0)
            m.update(c)
            m.update(update_work(model.config, exp.arrays["attention_mask"], exp.arrays["response_mask"].shape[1],
                                 cfg.actor.ppo_epochs))
            m.update({"time/update": max(t2 - t1 - compile_of("update", "precompile"), 0.0),
                      "time/sync": max(sync_s - compile_of("sync"), 0.0), "time/step": step_s,
                      "perf/micro_batches": float(kk),
                      "time/coordination": coord_s,
                      "perf/tokens_per_s": n_tokens / max(step_s, 1e-9)})
            rows.append({"step": step + 1, **m})
            if step % t.log_every == 0 or step + 1 == t.total_steps:
                logger.log(step + 1, m)
            else:
                logger.advance(step + 1)
            progress("checkpoint")
            ckpt.save(step + 1, {"train": state, "rng": rng}, data_state={"iterator": data_it.get_state()},
                      meta={"step": step + 1, "dataset_fingerprint": train_ds.fingerprint},
                      force=stop or step + 1 == t.total_steps)
            summary["final_step"] = step + 1
            if stop:
                break
        progress("checkpoint")
        ckpt.wait()
        logger.close_progress()
        summary["optimizer_steps"] = int(state.step)
        if stop:
            logger.write(f"SIGTERM: stopping after RL step {summary['final_step']} (checkpointed steps are kept)")
            summary["preempted"] = True
        nnx.update(model, state.params)
        if val_examples and not summary.get("preempted"):
            progress("eval")
            acc = heldout_accuracy(rollout, val_examples, tok, scorer, max_new_tokens=cfg.rollout.max_new_tokens,
                                   progress=logger.progress, desc="held-out (after RL)")
            summary["heldout_acc_after"] = acc
            logger.write(f"held-out accuracy after RL:  {acc:.4f} ({len(val_examples)} problems, greedy)")
        if t.export_hf and not summary.get("preempted"):
            progress("export")
            summary["hf_export"] = export_hf(model, tok, os.path.join(run_dir, "hf"))
        summary.update(run_report(stats, rows, start + 1, cfg.model.dtype, logger.write))
    finally:
        stats.close()
        preempt.restore()
        logger.close()
        ckpt.close()
        scorer.close()
    if main_process:
        write_plots(run_dir, summary)
        write_summary(run_dir, summary)
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stapo-jax train --config FILE [key.sub=value ...]``.
    Raises: ConfigError / FileNotFoundError for a bad config (the CLI prints it and exits 2).
    argv: str arguments; returns the int exit status. Source: verl ``main_ppo`` (the CLI entry)."""
    p = argparse.ArgumentParser(prog="stapo-jax train", description=__doc__)
    p.add_argument("--config", required=False, default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.clip_ratio_high=0.28")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)  # absl (via orbax) installs a WARNING root handler first
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save INFO chatter
    from stapo_jax.runtime.distributed import initialize

    initialize()  # multi-controller (TPU pod / SLURM) before any device is touched; no-op on one process
    cfg = load_config(a.config, a.overrides)
    summary = train(cfg)
    for key in ("heldout_acc_before", "heldout_acc_after", "final_step", "preempted", "run_dir", "hf_export"):
        if key in summary:
            print(f"{key}: {summary[key]}")
    return 0
