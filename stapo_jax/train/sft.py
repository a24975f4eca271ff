"""Supervised warm-up (``stapo-jax sft``): the RL machinery with a cross-entropy objective on gold responses,
so that a small model starts RL with non-zero reward.

The loss is the token-mean negative log-likelihood of the response tokens, computed through the same chunked
LM-head path as the RL losses (``stapo_jax.train.policy``); the update uses the same optimizer builder. The
batch is data-parallel like the RL update: every process builds the same global batch, each device receives
its rows (``mesh.data`` x ``mesh.fsdp`` shards), and the gradient is all-reduced over the data axes.
"""
from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stapo_jax.train.batching import pack_prompt_response
from stapo_jax.train.optim import make_optimizer, update_with_norm
from stapo_jax.train.policy import response_log_probs_and_entropy
from stapo_jax.train.train_step import init_optimizer_state, place_rows
from stapo_jax.runtime.collectives import stop_requested
from stapo_jax.train.micro_batches import data_parallel_size


@partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(4, 5))
def sft_step(graphdef, optimizer, response_length: int, seq_chunk: int, params, opt_state, input_ids,
             attention_mask, response_mask):
    """One cross-entropy update on a packed batch.

    Args:
      graphdef: ``nnx.split(model)[0]`` (static); optimizer: an ``optax.GradientTransformation`` (static).
      response_length: R (static); seq_chunk: LM-head chunk in tokens (static).
      params, opt_state: model state and optimizer state (donated).
      input_ids [B, P+R] int32, attention_mask [B, P+R] bool, response_mask [B, R] bool: one device's arrays
        or global arrays with rows over the mesh's data axes (``train_step.place_rows``); the loss is the same.
    Returns:
      (params, opt_state, metrics) with ``sft/loss`` (nats per response token), ``sft/tokens``,
      ``sft/grad_norm`` (float32 scalars). An all-masked batch gives loss 0 and a zero gradient.
    Raises:
      what ``jax.jit`` raises for inconsistent shapes (e.g. ``response_mask`` not ``[B, R]`` with
      ``R = response_length``), or a donated buffer reused by the caller.
    Source: the token-mean SFT loss of verl's ``trainer/sft_trainer.py`` / TRL's ``SFTTrainer`` (cross-entropy on
    the response tokens only).
    """
    def loss_fn(p):
        model = nnx.merge(graphdef, p)
        lp, _ = response_log_probs_and_entropy(model, input_ids, attention_mask, response_length,
                                               seq_chunk=seq_chunk, calculate_entropy=False)
        m = response_mask.astype(jnp.float32)
        n = m.sum()
        return -(lp * m).sum() / jnp.maximum(n, 1.0), n

    (loss, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grad_norm = optax.tree.norm(grads)  # the metric, and make_optimizer's clip (computed once)
    updates, opt_state = update_with_norm(optimizer, grads, opt_state, params, grad_norm)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"sft/loss": loss, "sft/tokens": n, "sft/grad_norm": grad_norm}


def model_mesh(model):
    """The ``jax.sharding.Mesh`` the parameters of ``model`` (an nnx module) live on, or None when they are not
    placed with a ``NamedSharding`` (e.g. a model built on one device); never raises.

    Reads the first leaf of ``nnx.state(model)`` (any shape or dtype) with a ``NamedSharding``; nothing
    is moved. Source: the ``jax.sharding.NamedSharding.mesh`` convention (flax nnx sharded models)."""
    for x in jax.tree.leaves(nnx.state(model)):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding):
            return sh.mesh
    return None


def check_batch_size(batch_size: int, mesh) -> None:
    """Raise ``ConfigError`` (a ValueError) naming ``sft.batch_size`` when ``batch_size`` rows do not split into
    the data-parallel shards of ``mesh`` (``mesh.data`` x ``mesh.fsdp`` over all processes; None: one shard).

    ``batch_size``: int (sequences per step); returns None. Source: verl's rule that the batch
    divides the data-parallel world size (``ppo_mini_batch_size % dp == 0``), applied to ``sft.batch_size``."""
    from stapo_jax.core.errors import ConfigError

    from stapo_jax.train.batch_shapes import nearest

    dp = data_parallel_size(mesh)
    if batch_size % dp:
        near = " or ".join(str(b) for b in nearest(batch_size, lambda b: b % dp == 0))
        raise ConfigError(f"sft.batch_size={batch_size} does not split into {dp} data-parallel shards "
                          f"({jax.process_count()} processes x {jax.local_device_count()} devices, mesh.data x "
                          f"mesh.fsdp): nearest that does: {near}, or change mesh.*")


def run_sft(model, examples: Iterator[tuple[list[int], list[int]]], *, steps: int, batch_size: int, lr: float,
            warmup_steps: int, pad_id: int, weight_decay: float = 0.0, clip_grad: float | None = 1.0,
            seq_chunk: int = 512, log=None, progress: bool = False, should_stop=None,
            check_every: int = 10, mesh="model") -> list[dict]:
    """Train ``model`` in place on (prompt ids, response ids) pairs; returns the metrics of every step.

    Every process draws the same global batch of ``batch_size`` pairs; with a mesh, each device gets
    ``batch_size / dp`` of its rows (``dp`` = ``mesh.data`` x ``mesh.fsdp``, over all processes), so N processes
    x D devices take the steps of 1 process x N*D devices. Each step's packed batch is ``input_ids
    [batch_size, P+R]`` int32, ``attention_mask`` ``[batch_size, P+R]`` bool, ``response_mask
    [batch_size, R]`` bool (P, R: the step's longest prompt / response); the returned metrics are Python float
    scalars. Source: verl's ``trainer/sft_trainer.py`` (data-parallel SFT), with the optimizer of the RL update.

    Args:
      model: a ``models.qwen3.Qwen3`` (updated in place via ``nnx.update``).
      examples: an endless iterator of (prompt token ids, response token ids incl. EOS).
      steps, batch_size: optimizer steps and sequences per step (> 0).
      lr, warmup_steps, weight_decay, clip_grad: see ``stapo_jax.train.optim.make_optimizer``.
      pad_id: padding id; log: optional callable(step, metrics).
      progress: show a progress bar ``sft`` (step, loss, ETA) on stderr, on process 0 only.
      should_stop: optional callable asked every ``check_every`` steps (the trainer's SIGTERM agreement over
        processes, a collective: every process asks at the same steps); True ends the warm-up early, so a
        preempted job does not first finish minutes of SFT. The returned history is then shorter than ``steps``.
      mesh: the mesh whose data axes take the batch rows; default ``"model"``: the mesh of the model's
        parameters (:func:`model_mesh`); None: the whole batch on one device (replicated).
    Raises:
      ValueError: non-positive ``steps`` or ``batch_size``; ``batch_size`` not a multiple of the data-parallel
        size (names ``sft.batch_size``); a token id outside ``[0, vocab_size)`` (naming the example), e.g. a
        tokenizer larger than the model's embedding.
    """
    if steps <= 0 or batch_size <= 0:
        raise ValueError(f"sft.steps={steps} and sft.batch_size={batch_size} must be > 0")
    mesh = model_mesh(model) if isinstance(mesh, str) and mesh == "model" else mesh
    check_batch_size(batch_size, mesh)
    optimizer = make_optimizer(lr, warmup_steps, weight_decay, clip_grad)
    graphdef, params = nnx.split(model)
    opt_state = init_optimizer_state(optimizer, params)
    history = []
    from stapo_jax.train.metrics import progress_bar

    bar = progress_bar(steps, "sft", enabled=progress)
    for step in range(steps):
        pairs = [next(examples) for _ in range(batch_size)]
        b = pack_prompt_response([p for p, _ in pairs], [r for _, r in pairs], pad_id=pad_id,
                                 vocab_size=model.config.vocab_size)
        R = b["response_mask"].shape[1]
        params, opt_state, m = sft_step(graphdef, optimizer, R, seq_chunk, params, opt_state,
                                        *(place_rows(b[k], mesh) for k in ("input_ids", "attention_mask",
                                                                           "response_mask")))
        m = {k: float(v) for k, v in m.items()}
        history.append(m)
        bar.set_postfix(loss=f"{m['sft/loss']:.4f}", refresh=False)
        bar.update(1)
        if log is not None:
            log(step, m)
        if should_stop is not None and (step + 1) % check_every == 0 and step + 1 < steps and should_stop():
            break
    bar.close()
    nnx.update(model, params)
    return history


def gold_response_text(example: dict, cfg) -> str:
    """The gold answer written the way the configured verifier reads it: ``\\boxed{answer}`` for the math
    verifiers and gym's ``boxed`` format, ``<answer>...</answer>`` for ``answer_tag``, the bare answer for
    ``raw``.

    ``example``: a dict with an ``answer`` (any value, written with ``str``); returns a str.
    Raises KeyError when ``example`` has no ``answer``. Source: the answer formats of the verifiers
    (math-verify / DeepScaleR ``\\boxed{}``, Reasoning Gym ``<answer>`` tags)."""
    answer = str(example["answer"])
    fmt = cfg.reward.gym_answer_format if cfg.reward.kind == "gym" else "boxed"
    if fmt == "raw":
        return answer
    if fmt == "answer_tag":
        return f"<answer>{answer}</answer>"
    return "\\boxed{" + answer + "}"


def gold_response_ids(example: dict, tokenizer, cfg) -> list[int]:
    """Token ids of :func:`gold_response_text` followed by the tokenizer's EOS id.

    Returns a list of Python int token ids (length: the encoded answer + 1). Raises KeyError as
    :func:`gold_response_text`. Source: the HF ``tokenizer.encode(add_special_tokens=False)`` + EOS
    convention of verl's SFT dataset (responses end with EOS)."""
    ids = tokenizer.encode(gold_response_text(example, cfg), add_special_tokens=False)
    return list(ids) + [tokenizer.eos_token_id]


def sft_from_config(cfg, model, examples: Sequence[dict], tokenizer, log=None, progress: bool = True,
                    should_stop=None) -> list[dict]:
    """SFT warm-up of ``model`` (in place) on gold responses of ``examples`` drawn uniformly with
    ``trainer.seed``, with the ``sft.*`` settings, with a progress bar (process 0) unless ``progress`` is
    false; ``should_stop`` as in :func:`run_sft`. Returns per-step metrics (see :func:`run_sft`).

    ``examples``: dicts with ``prompt_ids`` (list of int token ids) and ``answer``; the batches' shapes and dtypes
    are those of :func:`run_sft` (int32 ids, bool masks), the metrics Python float scalars. Raises as
    :func:`run_sft` (bad ``sft.*`` values, token ids outside the vocabulary) and KeyError for an example without
    ``prompt_ids`` / ``answer``. Source: verl's SFT trainer settings (``trainer/sft_trainer.py``), as the
    ``sft.*`` config keys."""
    rng = np.random.RandomState(cfg.trainer.seed)

    def pairs():
        while True:
            ex = examples[rng.randint(len(examples))]
            yield list(ex["prompt_ids"]), gold_response_ids(ex, tokenizer, cfg)

    s = cfg.sft
    from stapo_jax.data.tokenizer import pad_token_id

    return run_sft(model, pairs(), steps=s.steps, batch_size=s.batch_size, lr=s.lr, warmup_steps=s.warmup_steps,
                   pad_id=pad_token_id(tokenizer), seq_chunk=cfg.actor.logprob_seq_chunk or 512, log=log,
                   progress=progress, should_stop=should_stop)


def main(argv: Sequence[str] | None = None) -> int:
    """``stapo-jax sft --config FILE [key=value ...]``: SFT warm-up only; exports the model as HF safetensors
    to ``<trainer.run_dir>/sft_hf`` (use it as ``model.path`` of an RL run).

    SIGTERM / SIGINT stop every process at the next 10-step check with one line, nothing exported, exit 0.
    argv: str arguments; returns the int exit status 0. Raises ConfigError for a bad config or an
    ``sft.batch_size`` that does not split over the devices, DistributedError for processes started with
    different configs. Source: verl ``trainer/sft_trainer.py``'s CLI entry."""
    import logging

    from stapo_jax.runtime import build
    from stapo_jax.runtime.checkpoint import export_hf
    from stapo_jax.runtime.distributed import check_same_config, initialize
    from stapo_jax.runtime.stopping import Preemption
    from stapo_jax.config.schema import load_config
    from stapo_jax.data.prompts import load_prompt_dataset

    p = argparse.ArgumentParser(prog="stapo-jax sft", description=main.__doc__)
    p.add_argument("--config", default=None)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, force=True)
    initialize()  # N processes (pod / SLURM): the same SFT on the global mesh; process 0 writes the export
    cfg = load_config(a.config, a.overrides)
    check_same_config(cfg)
    mesh = build.build_mesh(cfg)
    check_batch_size(cfg.sft.batch_size, mesh)  # before the model is built
    tok = build.build_tokenizer(cfg)
    model = build.build_model(cfg, mesh, tok, seed=cfg.trainer.seed)
    examples = load_prompt_dataset(cfg, tok, "train").examples
    # SIGTERM / SIGINT: every process stops at the same 10-step check (a collective); a second one stops at once
    preempt = Preemption("stopping at the next 10-step check; stapo-jax sft keeps no checkpoint, nothing is saved")
    try:
        hist = sft_from_config(cfg, model, examples, tok, should_stop=lambda: stop_requested(preempt))
    finally:
        preempt.restore()
    if len(hist) < cfg.sft.steps:
        print(f"SFT: {preempt.signal_name or 'SIGTERM'}: stopped after {len(hist)} of {cfg.sft.steps} steps; "
              f"nothing saved")
        return 0
    out = os.path.join(cfg.trainer.run_dir, "sft_hf")
    export_hf(model, tok, out)
    print(f"SFT: {cfg.sft.steps} steps, loss {hist[0]['sft/loss']:.4f} -> {hist[-1]['sft/loss']:.4f}; saved {out}")
    return 0
