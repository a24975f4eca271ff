"""The RL loop (stapo-jax train): prompts -> rollouts -> rewards -> advantages -> mini-batch updates ->
weight sync -> metrics and checkpoints (the diagram in DESIGN.md); every piece lives in its own module
(build, experience, train_step, checkpoint, metrics).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from stapo_jax import build
from stapo_jax.checkpoint import Checkpointer, export_hf
from stapo_jax.config import Config, ConfigError, load_config
from stapo_jax.data import load_prompt_dataset, make_iterator
from stapo_jax.experience import collect_experience, heldout_accuracy
from stapo_jax.metrics import MetricsLogger
from stapo_jax.rewards import make_scorer
from stapo_jax.rollout import build_rollout
from stapo_jax.rollout.multihost import allgather_max, coordination_seconds
from stapo_jax.distributed import check_same_config
from stapo_jax.tokenizer import pad_token_id
from stapo_jax.s2t import make_update_steps
from stapo_jax.train_step import COUNT_METRICS, Batch, TrainState, batch_sharding, make_log_prob_fn

log = logging.getLogger(__name__)


class _Preemption:
    """SIGTERM (TPU preemption) sets a flag; the loop saves a checkpoint after the current step and exits."""

    def __init__(self):
        self.requested = False
        self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._old)


def _num_micro_batches(cfg: Config, rows: int, mesh) -> int:
    """K micro-batches per mini-batch of ``rows`` sequences (global over processes)."""
    dp = int(np.prod([mesh.shape[a] for a in ("data", "fsdp") if a in mesh.axis_names]))
    per_device = rows // dp
    k = max(per_device // cfg.actor.ppo_micro_batch_size, 1)
    if rows % dp or per_device % k:
        raise ConfigError(f"mini-batch of {rows} sequences (actor.ppo_mini_batch_size x rollout.n) does not split "
                          f"into {dp} data-parallel shards ({jax.process_count()} processes x "
                          f"{jax.local_device_count()} devices, mesh.data x mesh.fsdp) of micro-batches of "
                          f"actor.ppo_micro_batch_size={cfg.actor.ppo_micro_batch_size}: change "
                          f"actor.ppo_mini_batch_size, trainer.train_batch_size, actor.ppo_micro_batch_size or "
                          f"mesh.*")
    return k


def update_policy(state: TrainState, exp, step_fns, log_prob_fn, *, mini_rows: int, ppo_epochs: int = 1,
                  mesh=None):
    """Old log-probs over the whole rollout batch (trainer forward, θ_old), then one optimizer step per
    mini-batch of ``mini_rows`` sequences. ``step_fns = (first, rest)``: with ``s2t.minibatch_method=prepass``
    the first mini-batch uses a step that takes its token statistics from the old-log-prob pass (θ = θ_old
    there, stapo_spec §3), saving the pre-pass; with ``correction`` both are the same step (``old_entropy``
    gives it the provisional tau_h, exact on the first mini-batch).
    Returns (state, metrics averaged over mini-batches; ``COUNT_METRICS`` summed)."""
    a = exp.arrays
    R = a["response_mask"].shape[1]
    # every process holds the same global experience (multi-controller): mini-batch k is the global row slice
    # [k*M, (k+1)*M), each device receives its rows of it; the old log-probs come back with an all-gather
    sharding = batch_sharding(mesh) if mesh is not None else None
    put = (lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])) if sharding is not None \
        else jnp.asarray
    get = (lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))) if sharding is not None \
        else np.asarray
    old_lp, old_ent = [], []
    for s in range(0, exp.num_rows, mini_rows):
        lp, ent = log_prob_fn(state.params, state.graphdef, put(a["input_ids"][s:s + mini_rows]),
                              put(a["attention_mask"][s:s + mini_rows]), R)
        old_lp.append(get(lp))
        old_ent.append(get(ent))
    old_lp, old_ent = np.concatenate(old_lp), np.concatenate(old_ent)
    metrics: list[dict] = []
    rollout_lp = a.get("rollout_log_probs")
    for epoch in range(ppo_epochs):  # verl: ppo_epochs passes, mini-batches in order (shuffle false)
        for s in range(0, exp.num_rows, mini_rows):
            sl = slice(s, s + mini_rows)
            batch = Batch(input_ids=put(a["input_ids"][sl]), attention_mask=put(a["attention_mask"][sl]),
                          response_mask=put(a["response_mask"][sl]), advantages=put(a["advantages"][sl]),
                          old_log_probs=put(old_lp[sl]), old_entropy=put(old_ent[sl]),
                          rollout_log_probs=None if rollout_lp is None else put(rollout_lp[sl]))
            state, m = step_fns[0 if (epoch == 0 and s == 0) else 1](state, batch)
            metrics.append(jax.device_get(m))
    out = {k: float((np.sum if k in COUNT_METRICS else np.mean)([m[k] for m in metrics])) for k in metrics[0]}
    if "rollout_log_probs" in a:  # sampler vs trainer log-prob gap on valid tokens (conventions.md §5)
        mask = a["response_mask"]
        gap = np.abs(old_lp - a["rollout_log_probs"])[mask]
        out["sampler_trainer/logp_diff_mean"] = float(gap.mean()) if gap.size else 0.0
        out["sampler_trainer/logp_diff_max"] = float(gap.max()) if gap.size else 0.0
    return state, out


def train(cfg: Config) -> dict[str, Any]:
    """Run ``cfg`` (SFT warm-up if ``sft.steps`` > 0, then RL for ``trainer.total_steps``); returns a summary
    with held-out accuracy before/after RL (when a validation split exists), final step and run directory.

    Raises:
      ConfigError: missing ``trainer.total_steps`` or an inconsistent batch configuration.
    """
    if not cfg.trainer.total_steps:
        raise ConfigError("trainer.total_steps must be set for an RL run (stapo_spec §10 item 15)")
    cfg.check_rl_ready()
    t = cfg.trainer
    run_dir = os.path.abspath(t.run_dir)
    main_process = jax.process_index() == 0  # process 0 writes metrics, plots, summary and the HF export
    check_same_config(cfg)  # all processes started with the same settings (names the differing keys)
    mesh = build.build_mesh(cfg)
    G = cfg.rollout.n
    mini_rows = cfg.actor.ppo_mini_batch_size * G  # global rows per mini-batch (the same on every process)
    # every check that can reject the config runs before anything is written into run_dir
    k = _num_micro_batches(cfg, mini_rows, mesh)
    recipe = build.build_recipe(cfg)
    tok = build.build_tokenizer(cfg)
    pad_id = pad_token_id(tok)
    model = build.build_model(cfg, mesh, tok, seed=t.seed)
    train_ds = load_prompt_dataset(cfg, tok, "train")
    val_examples = _val_examples(cfg, tok)
    scorer = make_scorer(cfg)
    os.makedirs(run_dir, exist_ok=True)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), save_every=t.save_every or t.total_steps,
                        keep=t.keep_checkpoints)
    resuming = t.resume and ckpt.latest_step() is not None
    if resuming:
        _check_same_model(cfg, run_dir)
    if main_process:
        cfg.save(run_dir)
    logger = MetricsLogger.from_config(  # trainer.logger: console / tensorboard / wandb, on process 0
        run_dir if main_process else os.path.join(run_dir, f"process_{jax.process_index()}"), cfg,
        main_process=main_process)
    summary: dict[str, Any] = {"run_dir": run_dir}
    preempt = _Preemption()  # from here on SIGTERM means: finish the current phase, save, exit 0
    try:
        if cfg.sft.steps and not resuming:
            _sft_warmup(cfg, model, train_ds.examples, tok, logger)
        rollout = build_rollout(cfg, model, mesh, tok)
        if val_examples and not resuming:
            acc = heldout_accuracy(rollout, val_examples, tok, scorer, max_new_tokens=cfg.rollout.max_new_tokens)
            summary["heldout_acc_before"] = acc
            logger.write(f"held-out accuracy before RL: {acc:.4f} ({len(val_examples)} problems, greedy)")
        optimizer = build.build_optimizer(cfg)
        state = TrainState.create(model, optimizer, mesh)
        common = dict(temperature=cfg.rollout.temperature, seq_chunk=cfg.actor.logprob_seq_chunk or 512,
                      vocab_chunk=cfg.actor.logprob_vocab_chunk)
        shardings = jax.tree.map(lambda x: x.sharding, state)
        step_kw = dict(num_micro_batches=k, vocab_size=model.config.vocab_size, mesh=mesh,
                       state_shardings=shardings, **common)
        first_fn, step_fn = make_update_steps(recipe, optimizer, **step_kw)
        log_prob_fn = jax.jit(make_log_prob_fn(num_micro_batches=k, **common), static_argnums=(1, 4))
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
        stop = allgather_max(float(preempt.requested)) > 0  # SIGTERM to any process stops all at the same step
        for step in range(start, t.total_steps if not stop else start):
            t0 = time.perf_counter()
            coordination_seconds(reset=True)
            rng, sub = (np.asarray(x) for x in jax.random.split(rng))
            seed = int(jax.random.randint(jax.random.wrap_key_data(sub), (), 0, 2**31 - 1))
            exp = collect_experience(rollout, data_it, scorer, tok, recipe, group_size=G,
                                     max_new_tokens=cfg.rollout.max_new_tokens, seed=seed, pad_id=pad_id)
            t1 = time.perf_counter()
            if main_process and os.environ.get(DUMP_ENV):  # opt-in debug dump (layout-equivalence tests)
                _dump_experience(os.environ[DUMP_ENV], step + 1, exp)
            state, m = update_policy(state, exp, (first_fn, step_fn), log_prob_fn, mini_rows=mini_rows,
                                    ppo_epochs=cfg.actor.ppo_epochs, mesh=mesh)
            t2 = time.perf_counter()
            if not bool(_all_finite(state.params)):
                raise FloatingPointError(f"parameters became non-finite in RL step {step + 1} (loss "
                                         f"{m.get('loss')}, grad_norm {m.get('grad_norm')}); stopping without "
                                         f"checkpointing or exporting them")
            sync_s = rollout.sync_weights(state.params) if cfg.rollout.mode == "inprocess" else 0.0
            stop = allgather_max(float(preempt.requested)) > 0
            m["rollout/stale_policy"] = float(cfg.rollout.mode != "inprocess")
            m.update(exp.metrics)
            n_tokens = float(exp.arrays["attention_mask"].sum())
            m.update({"time/update": t2 - t1, "time/sync": sync_s, "time/step": time.perf_counter() - t0,
                      "time/coordination": coordination_seconds(),
                      "perf/tokens_per_s": n_tokens / (time.perf_counter() - t0)})
            if t.eval_every and val_examples and (step + 1) % t.eval_every == 0:
                m["val/acc"] = heldout_accuracy(rollout, val_examples, tok, scorer,
                                                max_new_tokens=cfg.rollout.max_new_tokens)
            if step % t.log_every == 0 or step + 1 == t.total_steps:
                logger.log(step + 1, m)
            else:
                logger.advance(step + 1)
            ckpt.save(step + 1, {"train": state, "rng": rng}, data_state={"iterator": data_it.get_state()},
                      meta={"step": step + 1, "dataset_fingerprint": train_ds.fingerprint},
                      force=stop or step + 1 == t.total_steps)
            summary["final_step"] = step + 1
            if stop:
                break
        ckpt.wait()
        logger.close_progress()
        summary["optimizer_steps"] = int(state.step)
        if stop:
            logger.write(f"SIGTERM: stopping after RL step {summary['final_step']} (checkpointed steps are kept)")
            summary["preempted"] = True
        nnx.update(model, state.params)
        if val_examples and not summary.get("preempted"):
            acc = heldout_accuracy(rollout, val_examples, tok, scorer, max_new_tokens=cfg.rollout.max_new_tokens)
            summary["heldout_acc_after"] = acc
            logger.write(f"held-out accuracy after RL:  {acc:.4f} ({len(val_examples)} problems, greedy)")
        if t.export_hf and not summary.get("preempted"):
            summary["hf_export"] = export_hf(model, tok, os.path.join(run_dir, "hf"))
    finally:
        preempt.restore()
        logger.close()
        ckpt.close()
        scorer.close()
    if main_process:
        _write_plots(run_dir, summary)
        _write_summary(run_dir, summary)
    return summary


DUMP_ENV = "STAPO_DUMP_EXPERIENCE_DIR"


def _dump_experience(directory: str, step: int, exp) -> None:
    """``<directory>/step_<step>.npz``: the packed rollout (``input_ids``, ``response_mask``, ...), ``rewards``
    and ``advantages`` of an RL step, written by process 0 when ``$STAPO_DUMP_EXPERIENCE_DIR`` is set."""
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, f"step_{step}.npz"), rewards=exp.rewards, **exp.arrays)


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def _check_same_model(cfg: Config, run_dir: str) -> None:
    """A resumed run must build the model its checkpoints hold (else Orbax fails deep inside restore)."""
    import yaml

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = (yaml.safe_load(f) or {}).get("model", {})
    now = cfg.to_dict()["model"]
    diff = [f"model.{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
    if diff:
        raise ConfigError(f"trainer.run_dir={run_dir} holds checkpoints of a different model ({'; '.join(diff)}); "
                          f"use a new trainer.run_dir or trainer.resume=false")


def _val_examples(cfg: Config, tok) -> list[dict]:
    has_val = cfg.data.gym.val_size if cfg.data.source == "gym" else bool(cfg.data.val_files)
    return load_prompt_dataset(cfg, tok, "val").examples if has_val else []


def _sft_warmup(cfg: Config, model, examples: Sequence[dict], tok, logger: MetricsLogger) -> None:
    from stapo_jax.sft import sft_from_config

    hist = sft_from_config(cfg, model, examples, tok)
    logger.write(f"SFT warm-up: {cfg.sft.steps} steps, loss {hist[0]['sft/loss']:.3f} -> {hist[-1]['sft/loss']:.3f}")


def _write_plots(run_dir: str, summary: dict) -> None:
    from stapo_jax.plots import plot_run
    try:
        summary["plots"] = plot_run(run_dir, summary=summary)   # held-out accuracy from the before-RL point
    except ValueError as e:  # no metrics rows (e.g. preempted before the first step)
        log.warning("no plots: %s", e)


def _write_summary(run_dir: str, summary: dict) -> None:
    """``summary.json``; a resumed run keeps what earlier runs recorded (e.g. the accuracy before RL)."""
    import json
    path = os.path.join(run_dir, "summary.json")
    previous = {}
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
    with open(path, "w") as f:
        json.dump({**previous, **summary}, f, indent=2, default=str)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stapo-jax train --config FILE [key.sub=value ...]``."""
    p = argparse.ArgumentParser(prog="stapo-jax train", description=__doc__)
    p.add_argument("--config", required=False, default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.clip_ratio_high=0.28")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)  # absl (via orbax) installs a WARNING root handler first
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save INFO chatter
    from stapo_jax.distributed import initialize

    initialize()  # multi-controller (TPU pod / SLURM) before any device is touched; no-op on one process
    cfg = load_config(a.config, a.overrides)
    summary = train(cfg)
    for key in ("heldout_acc_before", "heldout_acc_after", "final_step", "preempted", "run_dir", "hf_export"):
        if key in summary:
            print(f"{key}: {summary[key]}")
    return 0
