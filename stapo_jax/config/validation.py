"""Cross-field checks of a run ``Config`` (:func:`validate`), one function per section, each returning its
messages; every message names the keys involved. A section's own ranges (loss, masks, advantage, sampling, reward
shaping) are checked by the section itself (``stapo_jax.algo.*_settings``); here are the checks that read other
fields or sections. Functions take the run ``Config`` (duck-typed: this module does not import the schema).
"""
from __future__ import annotations

from stapo_jax.core.errors import ConfigError
from stapo_jax.config.selection import recipe_violations

__all__ = ["MODEL_SIZE_KEYS", "REQUIRED_SIZE_KEYS", "validate"]

MODEL_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta",
                   "max_position_embeddings", "rms_norm_eps")
# a from-scratch model needs at least these (vocab_size may come from the tokenizer: stapo_jax.runtime.build)
REQUIRED_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _failed(*checks: tuple[bool, str]) -> list[str]:
    """The messages of the ``(condition, message)`` pairs whose condition is false."""
    return [msg for cond, msg in checks if not cond]


def _model_errors(m) -> list[str]:
    """``model.*``: one source of the shape (path, preset or explicit sizes), positive sizes, GQA head ratio."""
    out = []
    sizes_set = [k for k in MODEL_SIZE_KEYS if getattr(m, k) is not None]
    if m.path is not None and m.preset is not None:
        out.append("model.path and model.preset are both set; set one (model.preset=null to use a path)")
    if m.path is not None and sizes_set:
        out.append(f"model.path cannot be combined with explicit size fields {['model.' + k for k in sizes_set]}")
    if m.path is None and m.preset is None:
        missing = [f"model.{k}" for k in REQUIRED_SIZE_KEYS if getattr(m, k) is None]
        out += _failed((not missing, f"a from-scratch model (model.path and model.preset unset) needs {missing}"))
    for k in ("vocab_size", "num_key_value_heads", "head_dim", "max_position_embeddings") + REQUIRED_SIZE_KEYS:
        v = getattr(m, k)
        out += _failed((v is None or v >= 1, f"model.{k}={v} must be >= 1"))
    out += _failed((m.scan_unroll == "auto" or m.scan_unroll >= 1,
                    f"model.scan_unroll={m.scan_unroll} must be 'auto' or >= 1"))
    if m.num_attention_heads and m.num_key_value_heads:
        out += _failed((m.num_attention_heads % m.num_key_value_heads == 0,
                        f"model.num_attention_heads={m.num_attention_heads} is not a multiple of "
                        f"model.num_key_value_heads={m.num_key_value_heads}"))
    return out


def _mesh_and_data_errors(mesh, d) -> list[str]:
    """``mesh.*`` axis sizes (at most one -1) and ``data.*`` lengths and reasoning-gym settings."""
    out = []
    for k in ("data", "fsdp", "tensor"):
        v = getattr(mesh, k)
        out += _failed((v == -1 or v >= 1, f"mesh.{k}={v} must be -1 (all remaining devices) or >= 1"))
    out += _failed(([getattr(mesh, k) for k in ("data", "fsdp", "tensor")].count(-1) <= 1,
                    "at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1"),
                   (d.max_prompt_length >= 1, f"data.max_prompt_length={d.max_prompt_length} must be >= 1"))
    if d.source == "gym":
        out += _failed((bool(d.gym.task), "data.source=gym needs data.gym.task (a reasoning-gym dataset name)"),
                       (d.gym.size >= 1, f"data.gym.size={d.gym.size} must be >= 1"),
                       (d.gym.val_size >= 0, f"data.gym.val_size={d.gym.val_size} must be >= 0"))
    return out


def _rollout_errors(cfg) -> list[str]:
    """``rollout.*`` ranges, and prompt + response length against the model's context."""
    r, m, d = cfg.rollout, cfg.model, cfg.data
    out = _failed((r.n >= 1, f"rollout.n={r.n} must be >= 1"),
                  (r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0"),
                  (0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]"),
                  (r.top_k is None or r.top_k >= 1, f"rollout.top_k={r.top_k} must be null (off) or >= 1"))
    for k in ("max_new_tokens", "max_concurrent_decodes", "steps_per_sync", "prefill_batch_size"):
        out += _failed((getattr(r, k) >= 1, f"rollout.{k}={getattr(r, k)} must be >= 1"))
    out += _failed((r.request_timeout_s > 0, f"rollout.request_timeout_s={r.request_timeout_s} must be > 0"),
                   (r.max_retries >= 0, f"rollout.max_retries={r.max_retries} must be >= 0"))
    if m.max_position_embeddings is not None:
        out += _failed((d.max_prompt_length + r.max_new_tokens <= m.max_position_embeddings,
                        f"data.max_prompt_length + rollout.max_new_tokens = {d.max_prompt_length + r.max_new_tokens} "
                        f"exceeds model.max_position_embeddings={m.max_position_embeddings}"))
    return out


def _batch_and_method_errors(cfg) -> list[str]:
    """The estimator against the group size, the batch sizes against each other, reward shaping
    against the response length and the reward kind against the data source."""
    r, al, a, t, rw = cfg.rollout, cfg.algorithm, cfg.actor, cfg.trainer, cfg.reward
    out = _failed(
        (not (al.adv_estimator == "rloo" and r.n < 2), "algorithm.adv_estimator=rloo needs rollout.n >= 2"),
        (a.ppo_micro_batch_size <= a.ppo_mini_batch_size * r.n,
         f"actor.ppo_micro_batch_size={a.ppo_micro_batch_size} exceeds the mini-batch's "
         f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size * r.n} sequences "
         "(gradient accumulation would be 0)"),
        (t.train_batch_size >= 1, f"trainer.train_batch_size={t.train_batch_size} must be >= 1"))
    if t.train_batch_size >= 1:
        out += _failed((t.train_batch_size % a.ppo_mini_batch_size == 0,
                        f"trainer.train_batch_size={t.train_batch_size} is not divisible by "
                        f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}"))
    out += _failed((rw.overlong_buffer_len <= r.max_new_tokens,
                    f"reward.overlong_buffer_len={rw.overlong_buffer_len} exceeds rollout.max_new_tokens="
                    f"{r.max_new_tokens}"),
                   (rw.kind != "gym" or cfg.data.source == "gym",
                    f"reward.kind=gym needs data.source=gym (got data.source={cfg.data.source})"))
    return out


def _trainer_sft_eval_errors(cfg) -> list[str]:
    """``trainer.*`` step counts and loggers, ``sft.*`` and ``eval.*`` ranges."""
    t, sft, e = cfg.trainer, cfg.sft, cfg.eval
    out = _failed((t.total_steps is None or t.total_steps >= 1, f"trainer.total_steps={t.total_steps} must be >= 1"))
    for k in ("log_every", "keep_checkpoints"):
        out += _failed((getattr(t, k) >= 1, f"trainer.{k}={getattr(t, k)} must be >= 1"))
    for k in ("save_every", "eval_every"):
        out += _failed((getattr(t, k) >= 0, f"trainer.{k}={getattr(t, k)} must be >= 0 (0 = off)"))
    bad_loggers = sorted(set(t.logger) - {"console", "tensorboard", "wandb", "jsonl"})
    ns = e.n_samples
    return out + _failed(
        (not bad_loggers, f"trainer.logger: unknown logger(s) {bad_loggers} (expected console, tensorboard, wandb; "
         f"metrics.jsonl is always written)"),
        (sft.steps >= 0, f"sft.steps={sft.steps} must be >= 0"),
        (sft.lr > 0, f"sft.lr={sft.lr} must be > 0"),
        (sft.batch_size >= 1, f"sft.batch_size={sft.batch_size} must be >= 1"),
        (sft.warmup_steps >= 0, f"sft.warmup_steps={sft.warmup_steps} must be >= 0"),
        (e.max_new_tokens >= 1, f"eval.max_new_tokens={e.max_new_tokens} must be >= 1"),
        (e.temperature > 0 and 0 < e.top_p <= 1,
         f"eval.temperature={e.temperature} must be > 0 and eval.top_p={e.top_p} in (0, 1]"),
        (all(v >= 1 for v in (ns.values() if isinstance(ns, dict) else [ns])), f"eval.n_samples={ns} must be >= 1"))


def validate(cfg) -> None:
    """Cross-field checks of a run ``Config``; every failed check is listed in one error, each naming its keys.

    Raises:
      ConfigError: a range or consistency check failed.
    Takes a ``Config``. Source: stapo_spec.md §4-5, §10 (the ranges and recipe invariants).
    """
    errors = _failed((bool(cfg.trainer.run_dir.strip()),
                      "trainer.run_dir is empty (it would write the run into the working directory)"))
    errors += _model_errors(cfg.model)
    errors += _mesh_and_data_errors(cfg.mesh, cfg.data)
    errors += _rollout_errors(cfg)
    errors += _batch_and_method_errors(cfg)
    errors += _trainer_sft_eval_errors(cfg)
    if cfg.algorithm.strict_recipe:
        errors += recipe_violations(cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
