"""The RL loop (stapo-jax train): prompts -> rollouts -> rewards -> advantages -> mini-batch updates ->
weight sync -> metrics and checkpoints (the diagram in DESIGN.md). :func:`train` reads as the run's outline:
setup (``run_setup``), the warm-up before RL (:func:`before_rl`, :func:`start_rl`), the RL steps (``rl_step``)
and the end of the run (:func:`finish_run`); every piece lives in its own module (build, experience, update,
train_step, checkpoint, metrics, run_files).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stapo_jax.config.schema import Config, load_config
from stapo_jax.core.errors import ConfigError
from stapo_jax.data.prompts import make_iterator
from stapo_jax.rollout import build_rollout
from stapo_jax.runtime.checkpoint import export_hf
from stapo_jax.runtime.watchdog import StallWatchdog, progress, resolve_timeout
from stapo_jax.train.experience import heldout_accuracy
from stapo_jax.train.optim import build_optimizer
from stapo_jax.train.precompile import precompile_sampler
from stapo_jax.train.policy_update import PolicyUpdate
from stapo_jax.train.rl_step import Loop, rl_step
from stapo_jax.train.run_files import earlier_summary, sft_warmup, write_plots, write_summary
from stapo_jax.train.run_setup import Run, setup_run
from stapo_jax.train.steady_state import run_report
from stapo_jax.train.train_step import TrainState
from stapo_jax.runtime.collectives import stop_requested

log = logging.getLogger(__name__)


def train(cfg: Config) -> dict[str, Any]:
    """Run ``cfg`` (SFT warm-up if ``sft.steps`` > 0, then RL for ``trainer.total_steps``); returns a summary
    with held-out accuracy before/after RL (when a validation split exists), final step and run directory.

    A stall watchdog (``trainer.stall_timeout_s``, :mod:`stapo_jax.runtime.watchdog`) runs throughout: no progress
    for that long dumps all thread stacks and exits the process with code 75. SIGTERM or SIGINT stops every process
    after the same step (SFT: nothing is saved and no summary is written; RL: the step is checkpointed) and
    returns; a second one exits at once (130, ``runtime.stopping``).
    Everything the setup opened (compile listener, SIGTERM handler, logger, checkpointer, reward pool) is closed
    on the way out, also when the setup itself raises.

    Raises:
      ConfigError: missing ``trainer.total_steps`` or an inconsistent batch configuration.
      FloatingPointError: the parameters became non-finite.
    Takes a ``Config``; the summary holds Python floats / ints / str. Source: stapo_spec.md §2 (the RL
    loop), verl ``RayPPOTrainer.fit``.
    """
    with StallWatchdog(resolve_timeout(cfg.trainer.stall_timeout_s, jax.default_backend()),
                       process_index=jax.process_index()):
        with contextlib.ExitStack() as stack:  # closes what setup_run opened, in reverse (listener first)
            run = setup_run(cfg, stack)
            summary: dict[str, Any] = {"run_dir": run.run_dir}
            if (done := finished_before(run, cfg.trainer.total_steps)) is not None:
                summary["final_step"] = done  # a resume with total_steps at or below the last checkpoint
                return summary
            rollout = before_rl(cfg, run, summary)
            if rollout is None:  # SIGTERM during the SFT warm-up: no RL, no summary file
                return summary
            loop = start_rl(cfg, run, rollout)
            summary["final_step"] = loop.start
            stop = stop_requested(run.preempt)  # SIGTERM to any process stops all at the same step
            for step in range(loop.start, cfg.trainer.total_steps if not stop else loop.start):
                _, stop = rl_step(run, loop, step, cfg.rollout, cfg.actor, cfg.trainer)
                summary["final_step"] = step + 1
                if stop:
                    break
            finish_run(run, loop, stop, summary, max_new_tokens=cfg.rollout.max_new_tokens,
                       export=cfg.trainer.export_hf, dtype=cfg.model.dtype)
        if run.main_process:
            write_plots(run.run_dir, summary)
            write_summary(run.run_dir, summary)
        return summary


def finished_before(run: Run, total_steps: int) -> Optional[int]:
    """The last checkpointed step when a resumed run already reached ``trainer.total_steps`` (it then ends at once
    after one note; a larger ``total_steps`` extends the run instead), else None. Int in, an int or None out.
    Raises: what reading the checkpoint folder raises. Source: issue 43 (a smaller total_steps ends the run)."""
    latest = run.ckpt.latest_step() if run.resuming else None
    if latest is None or latest < total_steps:
        return None
    run.logger.write(f"trainer.total_steps={total_steps}: the run in {run.run_dir} already reached step {latest}; "
                     f"nothing to do (a larger trainer.total_steps extends it; trainer.resume=false starts over, "
                     f"moving its outputs aside)")
    return int(latest)


def before_rl(cfg: Config, run: Run, summary: dict) -> Optional[Any]:
    """The warm-up before RL: the SFT warm-up (``sft.steps``, not when resuming), the rollout engine, its
    programs compiled up front (``trainer.precompile``, in-process sampler) and the held-out accuracy before RL
    (measured once; a resumed run reads it from the first start's summary), added to ``summary``. Returns the
    rollout engine, or None when SIGTERM arrived during the SFT warm-up (``summary`` then says ``preempted``).
    Takes the whole ``Config``: ``sft_warmup`` and ``build_rollout`` build from it. Its inputs are objects and floats.
    Raises: what SFT, the rollout builder and the held-out pass raise. Source: verl ``fit``'s ``val_before_train``."""
    logger = run.logger
    if cfg.sft.steps and not run.resuming and not sft_warmup(cfg, run.model, run.train_ds.examples, run.tok, logger,
                                                             should_stop=lambda: progress("sft") or
                                                             stop_requested(run.preempt)):
        logger.write(f"{run.preempt.signal_name or 'SIGTERM'} during the SFT warm-up: stopping before RL; "
                     "nothing is saved, a restart runs the warm-up again")
        summary.update(final_step=0, preempted=True)
        return None  # the caller's ExitStack closes the logger, checkpointer and reward pool
    rollout = build_rollout(cfg, run.model, run.mesh, run.tok)
    progress("setup")
    if run.bounded and cfg.rollout.mode == "inprocess":  # every rollout program, before the first rollout
        precompile_sampler(rollout, greedy=bool(run.val_examples), stats=run.stats, progress=logger.progress)
    summary.update(heldout_before(run, rollout, cfg.rollout.max_new_tokens))
    return rollout


def heldout_before(run: Run, rollout, max_new_tokens: int) -> dict[str, float]:
    """``{"heldout_acc_before": float}``: greedy held-out accuracy before RL, measured by a fresh run (and kept in
    ``summary.json`` at once, for a resumed run) or read back by a resumed one; ``{}`` without a validation
    split or without an earlier figure. Raises: what the held-out pass raises. Source: verl
    ``val_before_train``."""
    val, logger = run.val_examples, run.logger
    if val and not run.resuming:
        progress("eval")
        acc = heldout_accuracy(rollout, val, run.tok, run.scorer, max_new_tokens=max_new_tokens,
                               progress=logger.progress, desc="held-out (before RL)")
        logger.write(f"held-out accuracy before RL: {acc:.4f} ({len(val)} problems, greedy)")
        if run.main_process:  # kept for a resumed run, which does not measure it again
            write_summary(run.run_dir, {"heldout_acc_before": acc})
        return {"heldout_acc_before": acc}
    if val and (acc := earlier_summary(run.run_dir).get("heldout_acc_before")) is not None:
        logger.write(f"held-out accuracy before RL: {acc:.4f} (measured by the run's first start)")
        return {"heldout_acc_before": acc}
    return {}


def start_rl(cfg: Config, run: Run, rollout) -> Loop:
    """The loop's starting state: optimizer and sharded ``TrainState``, the update programs, the global
    prompt-batch iterator (every process iterates the same batches; rollouts and rewards split them), the host
    RL seed stream (uint32 key data of ``trainer.seed``), all restored from the latest checkpoint when resuming
    (the rollout engine re-synced, the metrics files cut back to the restored step). With ``actor.use_kl_loss``
    the reference policy is a copy of the parameters RL starts from (after the SFT warm-up; verl's ``ref``
    worker holds the initial actor), checkpointed with the state. Takes the whole ``Config``:
    ``build_optimizer`` reads ``actor.optim`` and the trainer's step counts. Raises: what checkpoint restore raises
    (a checkpoint of another shape); ConfigError from :func:`check_kl_reference`. Source: verl ``fit``'s
    ``_load_checkpoint``."""
    optimizer = build_optimizer(cfg)
    state = TrainState.create(run.model, optimizer, run.mesh)
    progress("setup")
    a = cfg.actor
    update = PolicyUpdate(run.recipe, optimizer, run.mesh, temperature=cfg.rollout.temperature,
                          seq_chunk=a.logprob_seq_chunk, vocab_chunk=a.logprob_vocab_chunk,
                          vocab_size=run.model.config.vocab_size,
                          state_shardings=jax.tree.map(lambda x: x.sharding, state), mini_rows=run.mini_rows,
                          num_micro_batches=run.num_micro_batches, ppo_epochs=a.ppo_epochs, packed=run.packed,
                          long_rows=run.long_rows, bounded=run.bounded, sequences_cap=a.sequences_cap())
    data_it = make_iterator(run.train_ds.examples, cfg.trainer.train_batch_size, seed=cfg.data.seed,
                            shuffle=cfg.data.shuffle, shard_index=0, shard_count=1)
    # the RL seed stream lives on the host (numpy): identical on every process, checkpointed by process 0
    rng = np.asarray(jax.random.key_data(jax.random.PRNGKey(cfg.trainer.seed)))
    ref_params = jax.tree.map(jnp.copy, state.params) if cfg.actor.use_kl_loss else None  # the update donates
    loop = Loop(rollout=rollout, update=update, data_it=data_it, state=state, rng=rng, start=0,
                ref_params=ref_params)
    if run.resuming:
        check_kl_reference(run.ckpt, cfg.actor.use_kl_loss)
        start, restored, data_state, meta = run.ckpt.restore(loop.checkpoint_items())
        state, rng = restored["train"], np.asarray(restored["rng"])
        loop.state, loop.rng, loop.start, loop.ref_params = state, rng, start, restored.get("ref")
        if meta.get("dataset_fingerprint") not in (None, run.train_ds.fingerprint):
            log.warning("the training prompts differ from those of the checkpointed run: the resumed run "
                        "will not see the same samples as an uninterrupted one")
        data_it.set_state(data_state["iterator"])
        run.logger.write(f"resumed from step {start} ({run.ckpt.directory})")
        rollout.sync_weights(state.params)
        run.logger.skip_to(start)
    if cfg.rollout.mode != "inprocess":
        log.warning("rollout.mode=%s: JetStream 0.2.2 cannot receive weights, so rollouts keep coming from the "
                    "server's policy while the trainer's moves on (off-policy; ratios are still computed "
                    "against the trainer's θ_old). Restart the server from a new export to refresh it.",
                    cfg.rollout.mode)
    return loop


def check_kl_reference(ckpt, use_kl_loss: bool) -> None:
    """A resumed run's ``actor.use_kl_loss`` must match its latest checkpoint, which holds the KL term's reference
    policy exactly when the run that wrote it had one (its ``kl_reference`` meta; checkpoints of earlier versions
    have none). Raises: ConfigError naming the key, the step and the two ways on; CheckpointError from reading
    the metadata. Source: verl keeps its ``ref`` worker for the whole run."""
    meta = ckpt.read_meta()
    saved = bool(meta.get("kl_reference", False))
    if saved != use_kl_loss:
        raise ConfigError(f"actor.use_kl_loss={str(use_kl_loss).lower()}, but the checkpoint of step "
                          f"{meta.get('step', ckpt.latest_step())} in {ckpt.directory} was written "
                          f"{'with' if saved else 'without'} a KL reference policy: resume with "
                          f"actor.use_kl_loss={str(saved).lower()}, or start fresh with trainer.resume=false")


def finish_run(run: Run, loop: Loop, stop: bool, summary: dict, *, max_new_tokens: int, export: bool,
               dtype: str) -> None:
    """The end of the RL loop, into ``summary``: wait for checkpoint saves, ``optimizer_steps``, ``preempted``
    after a SIGTERM, the held-out accuracy after RL and the HF export (``trainer.export_hf``; both skipped when
    preempted), then the run report (compile table, steady state at compute ``dtype``). Only process 0 prints the
    report; the others log it at DEBUG. Writes floats / ints / str into ``summary``. Raises: what the
    held-out pass and the export raise. Source: verl ``fit``'s final validation; issue 33's end-of-run report."""
    progress("checkpoint")
    run.ckpt.wait()
    run.logger.close_progress()
    summary["optimizer_steps"] = int(loop.state.step)
    if stop:
        why = run.preempt.signal_name or "SIGTERM"  # the signal here, else the one another process received
        run.logger.write(f"{why}: stopping after RL step {summary['final_step']} (checkpointed steps are kept)")
        summary["preempted"] = True
    nnx.update(run.model, loop.state.params)
    if run.val_examples and not summary.get("preempted"):
        progress("eval")
        acc = heldout_accuracy(loop.rollout, run.val_examples, run.tok, run.scorer, max_new_tokens=max_new_tokens,
                               progress=run.logger.progress, desc="held-out (after RL)")
        summary["heldout_acc_after"] = acc
        run.logger.write(f"held-out accuracy after RL:  {acc:.4f} ({len(run.val_examples)} problems, greedy)")
    if export and not summary.get("preempted"):
        progress("export")
        summary["hf_export"] = export_hf(run.model, run.tok, os.path.join(run.run_dir, "hf"))
    write = run.logger.write if run.main_process else log.debug  # one console report per job, from process 0
    summary.update(run_report(run.stats, loop.rows, loop.start + 1, dtype, write))


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
    from stapo_jax.runtime.watchdog import heartbeat_floor

    cfg = load_config(a.config, a.overrides)  # touches no device
    # multi-controller (TPU pod / SLURM) before any device is touched; no-op on one process. JAX's heartbeat stays
    # above the stall watchdog's limit, so a stopped peer ends the job with the watchdog's stacks (exit 75)
    initialize(min_heartbeat_s=heartbeat_floor(cfg.trainer.stall_timeout_s, os.environ.get("JAX_PLATFORMS") or None))
    summary = train(cfg)
    for key in ("heldout_acc_before", "heldout_acc_after", "final_step", "preempted", "run_dir", "hf_export"):
        if key in summary:
            print(f"{key}: {summary[key]}")
    return 0
