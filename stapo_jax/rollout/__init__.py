"""Rollouts: a JetStream 0.2.2 engine over the Flax Qwen3, the in-process driver, and gRPC serving.

* :mod:`~stapo_jax.rollout.engine`: ``Qwen3Engine`` (JetStream ``Engine``), ``EngineConfig``.
* :mod:`~stapo_jax.rollout.driver`: ``RolloutDriver`` (default for training), ``RolloutBatch``.
* :mod:`~stapo_jax.rollout.multihost`: ``MultiHostRollout`` (one driver per JAX process, global results).
* :mod:`~stapo_jax.rollout.server` / :mod:`~stapo_jax.rollout.client`: ``stapo-jax serve`` and
  ``GrpcRolloutClient`` (``rollout.mode: grpc``).
* :mod:`~stapo_jax.rollout.sampling`: temperature / top-k / top-p with full-vocabulary log-probs.
* :mod:`~stapo_jax.rollout.compat`: the JetStream shim; imported before any ``jetstream`` module.

:func:`build_rollout` turns a run config into the object the trainer samples from; both kinds have
``generate(prompts, *, num_samples, max_new_tokens, seed, sampling) -> RolloutBatch`` and
``sync_weights(params) -> seconds``. Heavy modules are imported lazily.
"""
from __future__ import annotations

from typing import Any, Optional


def engine_config(cfg: Any, tokenizer: Any = None, *, max_prefill_length: Optional[int] = None,
                  max_decode_length: Optional[int] = None, seed: Optional[int] = None):
    """``EngineConfig`` from a run config (:class:`stapo_jax.config.schema.Config`).

    Slots ``rollout.max_concurrent_decodes``; ``max_decode_length`` = ``rollout.max_new_tokens`` unless given
    (eval passes its ``--max-new-tokens``); ``max_prefill_length`` = ``data.max_prompt_length`` unless given;
    sampling from ``rollout.temperature/top_p/top_k`` (top_k null = off); ``rollout.kernel_layout``,
    ``rollout.prefill_batch_size``, ``rollout.kv_cache_buckets``; stop ids from the tokenizer
    (``stapo_jax.data.tokenizer.stop_token_ids``) or, without one, the model config's plus Qwen3's; seed
    ``trainer.seed`` unless given.

    Reads int / float / bool config fields; returns an ``EngineConfig`` whose ``eos_token_ids`` is a
    tuple of int ids. Raises ``EngineConfigError`` (a ValueError naming the field) for a non-positive slot count
    or length. Source: JetStream's ``max_concurrent_decodes`` / prefill / decode-length engine settings; sampling
    as HF transformers ``generate`` (temperature, top_p, top_k).
    """
    from stapo_jax.rollout.engine import EngineConfig
    from stapo_jax.rollout.sampling import SamplingParams

    r = cfg.rollout
    eos = None
    if tokenizer is not None:
        from stapo_jax.data.tokenizer import stop_token_ids

        eos = tuple(stop_token_ids(tokenizer))
    return EngineConfig(
        max_concurrent_decodes=r.max_concurrent_decodes,
        max_prefill_length=max_prefill_length or cfg.data.max_prompt_length,
        max_decode_length=max_decode_length or r.max_new_tokens,
        sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k or 0),
        eos_token_ids=eos,
        seed=cfg.trainer.seed if seed is None else seed,
        kernel_layout=r.kernel_layout,
        prefill_batch_size=r.prefill_batch_size,
        kv_cache_buckets=r.kv_cache_buckets,
    )


def multihost_rollout(model: Any, config: Any, cfg_mesh: Any = None, tokenizer: Any = None, *,
                      pad_token_id: Optional[int] = None, steps_per_sync: int = 1):
    """This process's sampler replica in a multi-process job: a ``Qwen3Engine`` with ``config``
    (``EngineConfig``) over the local devices (``multihost.local_mesh(cfg_mesh)``), holding a full copy of
    ``model``'s (global, sharded) parameters gathered chunk by chunk, wrapped in ``MultiHostRollout`` (global
    results on every process). Every process must call it.

    Takes ``model``, a Flax NNX ``Qwen3`` (bfloat16 / float32 parameters), ``config``
    an ``EngineConfig``, ``pad_token_id`` / ``steps_per_sync`` ints. Raises ``EngineConfigError`` (ValueError) for
    an invalid ``config``; errors of the parameter gather propagate. Source: one sampler replica per process,
    as verl's hybrid engine (a rollout worker next to each training worker).
    """
    from flax import nnx

    from stapo_jax.rollout.driver import RolloutDriver
    from stapo_jax.rollout.engine import Qwen3Engine
    from stapo_jax.rollout.multihost import MultiHostRollout, local_mesh, localize_tree

    lmesh = local_mesh(cfg_mesh)
    graphdef, state = nnx.split(model)
    local_model = nnx.merge(graphdef, localize_tree(state, lmesh))
    engine = Qwen3Engine(local_model, config, mesh=lmesh, tokenizer=tokenizer)
    driver = RolloutDriver(engine, pad_token_id=pad_token_id, steps_per_sync=steps_per_sync)
    return MultiHostRollout(driver, lmesh)


def inprocess_rollout(cfg: Any, model: Any, config: Any, mesh: Any = None, tokenizer: Any = None):
    """The in-process sampler for ``model`` with ``config`` (``EngineConfig``): one ``RolloutDriver`` over
    ``mesh`` in a single process, one replica per process (:func:`multihost_rollout`) in a multi-process job.
    Training (:func:`build_rollout`) and ``stapo-jax eval`` both build their sampler here, so both honour
    ``rollout.steps_per_sync`` and the multi-process layout. Every process must call it.

    Takes ``cfg``, the run config (int ``rollout.steps_per_sync``), ``model`` a Flax
    NNX ``Qwen3``, ``config`` an ``EngineConfig``. Raises ``EngineConfigError`` (ValueError) for an invalid
    ``config``. Source: verl's hybrid-engine layout (sampler in the trainer's process); engine API of JetStream.
    """
    import jax

    from stapo_jax.rollout.driver import RolloutDriver
    from stapo_jax.rollout.engine import Qwen3Engine

    pad = None if tokenizer is None else tokenizer.pad_token_id
    if jax.process_count() == 1:
        engine = Qwen3Engine(model, config, mesh=mesh, tokenizer=tokenizer)
        return RolloutDriver(engine, pad_token_id=pad, steps_per_sync=cfg.rollout.steps_per_sync)
    return multihost_rollout(model, config, getattr(cfg, "mesh", None), tokenizer, pad_token_id=pad,
                             steps_per_sync=cfg.rollout.steps_per_sync)


def build_rollout(cfg: Any, model: Any = None, mesh: Any = None, tokenizer: Any = None):
    """The rollout source selected by ``rollout.mode``.

    Args:
      cfg: run config.
      model: the policy ``Qwen3`` (``inprocess`` only; its parameters are copied onto ``mesh``).
      mesh: device mesh for the engine (``inprocess``); None = first device.
      tokenizer: transformers tokenizer (stop ids and pad id).
    Returns:
      ``RolloutDriver`` (``inprocess``) or ``GrpcRolloutClient`` (``grpc``, talking to
      ``rollout.server_address`` with ``rollout.request_timeout_s`` / ``rollout.max_retries``).
    Raises:
      ValueError: ``inprocess`` without a model, or an unknown mode.

    Configuration in, a sampler object out (its ``generate`` returns int32 ``[B*n, T]`` token arrays).
    Source: verl's ``rollout.mode`` / JetStream gRPC server convention.
    """
    from stapo_jax.rollout.sampling import SamplingParams

    r = cfg.rollout
    if r.mode == "inprocess":
        if model is None:
            raise ValueError("rollout.mode=inprocess needs the policy model")
        return inprocess_rollout(cfg, model, engine_config(cfg, tokenizer), mesh, tokenizer)
    if r.mode == "grpc":
        import jax

        if jax.process_count() > 1:
            raise ValueError(f"rollout.mode=grpc with {jax.process_count()} JAX processes is not supported: use "
                             f"rollout.mode=inprocess (one sampler replica per process)")
        from stapo_jax.rollout.client import GrpcRolloutClient

        kw = {}
        if tokenizer is not None:
            from stapo_jax.data.tokenizer import pad_token_id, stop_token_ids

            kw = dict(eos_token_ids=stop_token_ids(tokenizer), pad_token_id=pad_token_id(tokenizer))
        return GrpcRolloutClient(
            r.server_address, max_prompt_length=cfg.data.max_prompt_length, max_new_tokens_limit=r.max_new_tokens,
            sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k or 0),
            request_timeout_s=r.request_timeout_s, max_retries=r.max_retries, **kw)
    raise ValueError(f"rollout.mode must be 'inprocess' or 'grpc', got {r.mode!r}")
