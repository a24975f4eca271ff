"""One RL step of the loop (DESIGN.md's diagram): experience (rollouts, rewards, advantages) -> policy update ->
weight sync -> optional held-out eval -> metrics (compile time reported apart) -> log and checkpoint.

The loop's state between steps is a :class:`Loop`; the run's fixed objects are a ``run_setup.Run``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from stapo_jax.config.schema import ActorConfig, RolloutConfig, TrainerConfig
from stapo_jax.runtime.collectives import coordination_seconds, stop_requested
from stapo_jax.runtime.compile_stats import CompileStats
from stapo_jax.runtime.watchdog import progress
from stapo_jax.train.experience import Experience, collect_experience, fill_mini_batches, heldout_accuracy
from stapo_jax.train.run_files import DUMP_ENV, dump_experience
from stapo_jax.train.run_setup import Run
from stapo_jax.train.optim import all_finite
from stapo_jax.train.policy_update import PolicyUpdate
from stapo_jax.train.steady_state import update_work
from stapo_jax.train.train_step import TrainState


@dataclass
class Loop:
    """What changes from one RL step to the next (besides the metrics files and checkpoints)."""

    rollout: Any                # the rollout engine (re-synced after every update)
    update: PolicyUpdate        # the policy update (programs per micro-batch count, mini-batch loop)
    data_it: Any                # the global prompt-batch iterator (its state is checkpointed)
    state: TrainState
    rng: np.ndarray             # the RL seed stream: uint32 key data on the host, identical on every process
    start: int                  # the first RL step of this process (the restored step when resuming)
    rows: list = field(default_factory=list)  # every RL step's metrics (the steady-state summary)
    ref_params: Any = None      # the reference policy (actor.use_kl_loss): the parameters RL started from

    def checkpoint_items(self) -> dict:
        """What a checkpoint of this loop holds: the train state, the RL seed stream and, with a KL term, the
        reference policy (a resumed run's KL keeps the first start's reference)."""
        items = {"train": self.state, "rng": self.rng}
        if self.ref_params is not None:
            items["ref"] = self.ref_params
        return items


def rl_step(run: Run, loop: Loop, step: int, rollout_cfg: RolloutConfig, actor: ActorConfig,
            trainer: TrainerConfig) -> tuple[dict, bool]:
    """RL step ``step + 1``: experience, update (``loop.state`` and ``loop.rng`` move on), weight sync, the
    ``trainer.eval_every`` held-out pass, metrics (logged every ``trainer.log_every`` steps and kept in
    ``loop.rows``) and the checkpoint (forced at the last step or when a SIGTERM was agreed on). Returns the
    step's metrics (name -> float scalar) and whether the run must stop (SIGTERM on any process; a collective).
    Raises: FloatingPointError when the parameters became non-finite (before checkpointing them), and what
    rollout, reward and update raise. Source: verl ``RayPPOTrainer.fit`` (one iteration of its loop)."""
    t0 = time.perf_counter()
    progress("rollout", step=step + 1)
    run.stats.take_step(count=False)  # compiles between steps (checkpoint saves): in the table only
    coordination_seconds(reset=True)
    exp = step_experience(run, loop, rollout_cfg)
    t1 = time.perf_counter()
    if run.main_process and os.environ.get(DUMP_ENV):  # opt-in debug dump (layout-equivalence tests)
        dump_experience(os.environ[DUMP_ENV], step + 1, exp)
    m, kk = step_update(run, loop, exp, step)
    t2 = time.perf_counter()
    if not bool(all_finite(loop.state.params)):
        raise FloatingPointError(f"parameters became non-finite in RL step {step + 1} (loss {m.get('loss')}, "
                                 f"grad_norm {m.get('grad_norm')}); stopping without checkpointing or exporting them")
    progress("sync")
    with run.stats.phase("sync"):
        sync_s = loop.rollout.sync_weights(loop.state.params) if rollout_cfg.mode == "inprocess" else 0.0
    stop = stop_requested(run.preempt)
    m["rollout/stale_policy"] = float(rollout_cfg.mode != "inprocess")
    m.update(exp.metrics)
    step_end, coord_s = time.perf_counter(), coordination_seconds()  # both before the optional eval
    if trainer.eval_every and run.val_examples and (step + 1) % trainer.eval_every == 0:
        progress("eval")
        with run.stats.phase("eval"):
            m["val/acc"] = heldout_accuracy(loop.rollout, run.val_examples, run.tok, run.scorer,
                                            max_new_tokens=rollout_cfg.max_new_tokens)
    step_metrics(m, run.stats, exp, step_s=step_end - t0, update_s=t2 - t1, sync_s=sync_s, coord_s=coord_s,
                 micro_batches=kk, qcfg=run.model.config, ppo_epochs=actor.ppo_epochs)
    loop.rows.append({"step": step + 1, **m})
    if step % trainer.log_every == 0 or step + 1 == trainer.total_steps:
        run.logger.log(step + 1, m)
    else:
        run.logger.advance(step + 1)
    progress("checkpoint")
    run.ckpt.save(step + 1, loop.checkpoint_items(), data_state={"iterator": loop.data_it.get_state()},
                  meta={"step": step + 1, "dataset_fingerprint": run.train_ds.fingerprint,
                        "kl_reference": loop.ref_params is not None},
                  force=stop or step + 1 == trainer.total_steps)
    return m, stop


def step_experience(run: Run, loop: Loop, rollout_cfg: RolloutConfig) -> Experience:
    """Draw the step's sampling seed from ``loop.rng`` (which moves on) and collect one batch of experience:
    ``rollout.n`` responses per prompt, rewards, advantages, packed int32 / bool / float32 arrays ``[N, P + R]``
    (``experience.Experience``); compiles charged to phase ``experience`` (the sampling inside: ``rollout``).
    Raises: what rollout and reward scoring raise. Source: verl ``RayPPOTrainer.fit`` (generate, reward,
    advantage); a batch short of whole mini-batches (dynamic sampling) is completed by
    ``experience.fill_mini_batches``."""
    loop.rng, sub = (np.asarray(x) for x in jax.random.split(loop.rng))
    seed = int(jax.random.randint(jax.random.wrap_key_data(sub), (), 0, 2**31 - 1))
    with run.stats.phase("experience"):  # rewards, advantages; the sampling inside is phase "rollout"
        exp = collect_experience(loop.rollout, loop.data_it, run.scorer, run.tok, run.recipe,
                                  group_size=rollout_cfg.n, max_new_tokens=rollout_cfg.max_new_tokens, seed=seed,
                                  pad_id=run.pad_id, max_prompt_length=run.max_prompt_length,
                                  fixed_response_length=run.bounded, compile_phase=run.stats.phase)
    # dynamic sampling may stop with fewer groups than whole mini-batches: filler rows complete them
    return fill_mini_batches(exp, run.mini_rows)


def step_update(run: Run, loop: Loop, exp: Experience, step: int) -> tuple[dict, int]:
    """The policy update of one step on ``exp`` by ``loop.update`` (``loop.state`` becomes the updated,
    donated-into state); with ``trainer.precompile`` every update program is compiled first, in the run's first
    step. Returns the update's metrics (float scalars) and the micro-batch count K used (int). Raises: what
    ``PolicyUpdate`` raises. Source: verl ``update_actor``."""
    progress("update")
    loop.state, m = loop.update(loop.state, exp, ref_params=loop.ref_params,
                                precompile=run.bounded and step == loop.start, stats=run.stats,
                                progress=run.logger.progress)
    return m, loop.update.last_micro_batches


def step_metrics(m: dict, stats: CompileStats, exp: Experience, *, step_s: float, update_s: float, sync_s: float,
                 coord_s: float, micro_batches: int, qcfg, ppo_epochs: int) -> dict:
    """Add the step's compile and timing metrics to ``m`` (in place; also returned): what ``stats`` counted since
    the step began (``perf/compiles``, ``perf/compile_s``, ``time/compile/<phase>``), the wall times in seconds
    without compile time (``time/step``, ``time/update``, ``time/sync``, and ``time/rollout`` /
    ``time/experience`` when present), ``time/coordination``, ``perf/micro_batches``, ``perf/tokens_per_s`` and
    ``steady_state.update_work`` (tokens and model FLOPs). ``step_s``: wall seconds from the step's start to
    the end of its sync (before any eval); ``exp``: the step's experience (``attention_mask`` [N, P + R] bool).
    Floats out. Raises: ValueError from ``update_work`` for a mask that is not 2-D. Source: issue 33 (compile
    time reported apart from step time)."""
    real = exp.arrays["attention_mask"][:exp.num_rows - exp.filler_rows]  # filler rows are no work done
    n_tokens = float(real.sum())
    c = stats.take_step()  # compile time is reported apart (time/compile/*) and left out of time/*
    compile_of = lambda *ph: sum(c.get(f"time/compile/{p}", 0.0) for p in ph)  # noqa: E731
    step_s = step_s - (c["perf/compile_s"] - compile_of("eval"))
    for key, phases in (("time/rollout", ("rollout",)), ("time/experience", ("rollout", "experience"))):
        if key in m:
            m[key] = max(m[key] - compile_of(*phases), 0.0)
    m.update(c)
    m.update(update_work(qcfg, real, exp.arrays["response_mask"].shape[1], ppo_epochs))
    m.update({"time/update": max(update_s - compile_of("update", "precompile"), 0.0),
              "time/sync": max(sync_s - compile_of("sync"), 0.0), "time/step": step_s,
              "perf/micro_batches": float(micro_batches),
              "time/coordination": coord_s,
              "perf/tokens_per_s": n_tokens / max(step_s, 1e-9)})
    return m
