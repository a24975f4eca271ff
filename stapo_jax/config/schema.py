"""Typed run configuration: dataclass schema, YAML loading, dotted overrides, validation, save/reload.

Every default is the interpretation adopted in the STAPO spec (``stapo_spec.md``) §10 (STAPO on the JustRL
recipe); key spellings follow verl (``actor.clip_ratio_c``, ``actor.loss_agg_mode``, ``actor.kl_loss_coef``,
``actor.entropy_coeff``, ``algorithm.norm_adv_by_std_in_grpo``, ``actor.ppo_mini_batch_size`` ...). The spec's
``loss.*`` names map to ``actor.*``: ``loss.dual_clip_c`` -> ``actor.clip_ratio_c``, ``loss.kl_coef`` ->
``actor.kl_loss_coef``, ``loss.kl_type`` -> ``actor.kl_loss_type``, ``loss.entropy_coef`` ->
``actor.entropy_coeff``, ``loss.agg_mode`` -> ``actor.loss_agg_mode``.

Resolution order for a key: command-line override > YAML file > recipe default (the row of
:data:`stapo_jax.config.presets.RECIPE_PRESETS`, applied only to keys neither the file nor an override sets) >
schema default below. The token mask is chosen by one key, ``actor.token_mask`` (unset: the recipe's); the older
``s2t.enabled`` / ``top_entropy.enabled`` flags are derived from it (still read, with a deprecation note).

Usage::

    cfg = load_config("configs/tiny_cpu.yaml", ["actor.clip_ratio_high=0.28", "trainer.total_steps=10"])
    cfg.save(run_dir)          # run_dir/config.yaml, reloads to an equal Config
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import yaml

from stapo_jax.algo.loss_settings import PolicyLossConfig  # the loss keys of the actor section (frozen)
# the s2t / top_entropy / cov sections (frozen)
from stapo_jax.algo.mask_settings import CovConfig, S2TConfig, TopEntropyConfig
# the sampling section and the bases of algorithm / reward (frozen)
from stapo_jax.algo.recipe_settings import AdvantageConfig, OverlongConfig, SamplingConfig
from stapo_jax.config.extensions import build_settings, declared_sections, split_sections
from stapo_jax.config.presets import RECIPE_PRESETS, RecipeName
from stapo_jax.config.selection import (  # noqa: F401  (token_mask_name is part of this module's API)
    TOKEN_MASK_FLAGS, check_registered_names, resolve_token_mask, token_mask_name)
from stapo_jax.config.loading import (  # noqa: F401  (parse_override is part of this module's API)
    has_dotted,
    parse_override,
    plain_copy,
    safe_load_unique,
    set_dotted,
)
from stapo_jax.core.errors import ConfigError
from stapo_jax.core.settings import build_dataclass, check_field_types, unknown_keys
# the cross-field checks and the model-size keys they read (part of this module's API)
from stapo_jax.config.validation import MODEL_SIZE_KEYS, validate  # noqa: F401

CONFIG_FILENAME = "config.yaml"
JUSTRL_PROMPT_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
MAX_SEQUENCES_FACTOR = 8  # actor.max_sequences_per_micro_batch=null: 8 x ppo_micro_batch_size (bench_packing.py)


# ----------------------------------------------------------------------------------------------- schema


@dataclass
class ModelConfig:
    """The policy model. Exactly one source: ``path`` (HF directory or hub id with ``config.json`` and
    safetensors), ``preset`` (an HF ``config.json`` shipped in ``stapo_jax/assets/qwen3_configs``, e.g.
    ``"Qwen3-0.6B"``), or, with both unset, the explicit size fields (a from-scratch model). With a
    preset, explicit size fields override the preset's values (e.g. a 2-layer Qwen3-0.6B for CI)."""

    path: Optional[str] = None
    preset: Optional[str] = "Qwen3-1.7B-Base"
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    rope_theta: Optional[float] = None
    max_position_embeddings: Optional[int] = None
    rms_norm_eps: Optional[float] = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # per-layer rematerialisation (jax.checkpoint policy); default measured by bench/bench_remat.py
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "dots_no_batch"
    # decoder layers per layer-scan iteration (jax.lax.scan unroll; models.layer_scan: auto = 4 on CPU, 1 else)
    scan_unroll: Union[int, Literal["auto"]] = "auto"
    # self-attention kernel of the forward/update and of prefill (models.attention): xla ([heads, T, T] scores),
    # blockwise (flash-style, any backend), cudnn (GPU, 16-bit), splash (TPU); auto: splash / cudnn / blockwise
    attention: Literal["xla", "blockwise", "cudnn", "splash", "auto"] = "xla"
    # verl's actor_rollout_ref.model.use_remove_padding: the old-log-prob pass and the update run each
    # micro-batch's sequences packed end to end into rows (segment ids, RoPE restarting per sequence), so the
    # transformer computes no padding (stapo_jax.train.packing); results equal the padded batch's
    use_remove_padding: bool = True


@dataclass
class TokenizerConfig:
    """``kind: hf`` loads a transformers tokenizer from ``path`` (falls back to ``model.path``); ``kind:
    builtin`` builds the small offline character-level tokenizer of :mod:`stapo_jax.data.tokenizer`."""

    kind: Literal["hf", "builtin"] = "hf"
    path: Optional[str] = None


@dataclass
class MeshConfig:
    """Device mesh axis sizes; ``-1`` takes all remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclass
class GymConfig:
    """A reasoning-gym task as prompt source (``data.source: gym``): ``reasoning_gym.create_dataset(task,
    size=size, seed=seed, **config)``; the held-out split uses ``val_seed`` (default ``seed + size``:
    reasoning-gym seeds item i with seed + i) and drops questions that also occur in the training split."""

    task: Optional[str] = None
    size: int = 1000
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    val_size: int = 0
    val_seed: Optional[int] = None


@dataclass
class DataConfig:
    """Prompt datasets (see :mod:`stapo_jax.data.prompts`)."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    source: Literal["jsonl", "parquet", "hf", "gym"] = "jsonl"
    hf_split: str = "train"
    hf_val_split: str = "test"
    prompt_key: str = "problem"
    answer_key: str = "answer"
    max_prompt_length: int = 1024
    shuffle: bool = True
    seed: int = 0
    apply_chat_template: bool = True
    enable_thinking: bool = True
    prompt_suffix: str = JUSTRL_PROMPT_SUFFIX
    on_bad_row: Literal["skip", "error"] = "skip"
    drop_truncated: bool = False
    gym: GymConfig = field(default_factory=GymConfig)


@dataclass
class RolloutConfig:
    """Sampling of ``n`` responses per prompt (the group size G)."""

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    max_new_tokens: int = 15360
    max_concurrent_decodes: int = 64
    steps_per_sync: int = 8
    mode: Literal["inprocess", "grpc"] = "inprocess"
    kernel_layout: Literal["auto", "in_out", "out_in"] = "auto"  # EngineConfig.kernel_layout (decode weights)
    prefill_batch_size: int = 8  # EngineConfig.prefill_batch_size (prompts per batched prefill)
    kv_cache_buckets: bool = True  # EngineConfig.kv_cache_buckets (KV cache sized to the active slots)
    server_address: str = "127.0.0.1:9000"
    request_timeout_s: float = 600.0
    max_retries: int = 3


@dataclass(frozen=True)
class AlgorithmConfig(AdvantageConfig):
    """Recipe and advantage estimator (verl ``algorithm.*``): this section *is* the recipe's
    :class:`~stapo_jax.algo.recipe_settings.AdvantageConfig` (its keys and validation) plus the recipe's name.
    ``strict_recipe: false`` allows a config to deviate from the recipe's invariants (e.g. a KL term under
    ``stapo``); the deviation is then the user's."""

    recipe: RecipeName = "stapo"  # a row of stapo_jax.config.presets.RECIPE_PRESETS
    strict_recipe: bool = True


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then constant lr, global-norm gradient clipping (``clip_grad``; None = off).
    Raises: ConfigError naming ``actor.optim.<key>`` for an invalid value."""

    lr: float = 1e-6
    warmup_steps: int = 10
    weight_decay: float = 0.1
    clip_grad: Optional[float] = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self):
        check_field_types(self, "actor.optim")
        _check("actor.optim", [
            (self.lr > 0, f"lr={self.lr} must be > 0"),
            (self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0"),
            (self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0"),
            (self.clip_grad is None or self.clip_grad > 0, f"clip_grad={self.clip_grad} must be > 0 or null"),
            (all(0 <= b < 1 for b in self.betas), f"betas={list(self.betas)} must lie in [0, 1)"),
            (self.eps > 0, f"eps={self.eps} must be > 0")])


@dataclass(frozen=True)
class ActorConfig(PolicyLossConfig):
    """verl ``actor_rollout_ref.actor.*``: the policy loss (this section *is* a
    :class:`~stapo_jax.algo.loss_settings.PolicyLossConfig`, its keys, validation and meaning; the recipe uses the
    section directly as its loss) plus the PPO batching and optimizer keys. Mini-batch size counts prompts (each
    brings ``rollout.n`` responses); micro-batch size counts sequences per device. The loss defaults here are the
    project's recipe (JustRL / STAPO: clip-higher 0.28, dual clip 10, no KL), the library's are verl's.
    Raises: ConfigError naming ``actor.<key>`` for an invalid value."""

    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 10.0
    kl_loss_coef: float = 0.0
    # a registered policy loss (verl policy_loss.loss_mode; stapo_jax.algo.objectives.POLICY_LOSSES)
    policy_loss: str = "vanilla"
    # the one key choosing the token mask: a registered mask (stapo_jax.algo.masks.TOKEN_MASKS) or "none"; unset /
    # null in a file: the recipe's (RECIPE_PRESETS); the older s2t.enabled / top_entropy.enabled flags are derived
    # from it (selection.resolve_token_mask). The default is the default recipe's (stapo).
    token_mask: Optional[str] = "s2t"
    ppo_mini_batch_size: int = 64
    # sequences per device per forward/backward; auto: the whole mini-batch's share of a device (K = 1), resolved
    # by Config to ppo_mini_batch_size x rollout.n (a size at or above a shard's rows gives K = 1)
    ppo_micro_batch_size: Union[int, Literal["auto"]] = "auto"
    ppo_epochs: int = 1
    logprob_seq_chunk: Optional[int] = 512
    logprob_vocab_chunk: Optional[int] = None
    max_sequences_per_micro_batch: Optional[int] = None
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self):
        super().__post_init__()
        micro = self.ppo_micro_batch_size if isinstance(self.ppo_micro_batch_size, int) else 1  # auto: resolved later
        _check("actor", [
            (self.ppo_epochs >= 1, f"ppo_epochs={self.ppo_epochs} must be >= 1"),
            (self.ppo_mini_batch_size >= 1, f"ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 1"),
            (micro >= 1, f"ppo_micro_batch_size={self.ppo_micro_batch_size} must be >= 1 or auto "
                         "(gradient accumulation would be 0)")]
            + [(getattr(self, k) is None or getattr(self, k) >= 1, f"{k}={getattr(self, k)} must be >= 1 or null "
                "(no chunking)") for k in ("logprob_seq_chunk", "logprob_vocab_chunk")]
            + [(self.max_sequences_per_micro_batch is None or self.max_sequences_per_micro_batch >= micro,
                f"max_sequences_per_micro_batch={self.max_sequences_per_micro_batch} must be null or >= "
                f"actor.ppo_micro_batch_size={self.ppo_micro_batch_size}")])

    def sequences_cap(self) -> int:
        """Most sequences per device in one micro-batch of a packed update chosen by tokens
        (``packing.token_budget_slots``; it bounds the slot layout's n_max): ``max_sequences_per_micro_batch`` or,
        when null, ``MAX_SEQUENCES_FACTOR`` x ``ppo_micro_batch_size``. An int; never raises.
        Source: this project's cap on verl's ``use_dynamic_bsz`` micro-batches."""
        m = self.max_sequences_per_micro_batch
        if m is None and not isinstance(self.ppo_micro_batch_size, int):
            raise ConfigError("actor.ppo_micro_batch_size=auto is resolved by Config (ppo_mini_batch_size x "
                              "rollout.n); a bare ActorConfig has no size")
        return MAX_SEQUENCES_FACTOR * self.ppo_micro_batch_size if m is None else m


def _check(section: str, rules) -> None:
    """Raise one ConfigError listing every failed ``(ok, "key=value rule")`` of ``section``."""
    bad = [f"{section}.{msg}" for ok, msg in rules if not ok]
    if bad:
        raise ConfigError(bad[0] if len(bad) == 1 else "invalid config:\n  " + "\n  ".join(bad))


@dataclass(frozen=True)
class RewardConfig(OverlongConfig):
    """Verifier (stapo_jax.rewards) and DAPO overlong shaping (stapo_spec §5; the ``overlong_*`` keys are the
    recipe's :class:`~stapo_jax.algo.recipe_settings.OverlongConfig`, ``overlong_buffer_len: 0`` is off).
    ``boxed_normalize`` applies DAPO's ``normalize_final_answer`` to both sides before the exact match (JustRL's
    strict-box verifier compares raw strings: false). ``gym_answer_format`` says how the answer is taken from a
    response for reasoning-gym scoring. Raises: ConfigError naming ``reward.<key>`` for an invalid value."""

    kind: str = "boxed_exact_pm1"  # a registered reward kind (stapo_jax.rewards.registry.REWARD_KINDS)
    timeout_s: float = 10.0
    num_workers: int = 4
    max_pool_restarts: int = 3          # verifier-pool rebuilds allowed per batch (rewards/pool.py); one more stops
    boxed_normalize: bool = False
    gym_answer_format: Literal["boxed", "answer_tag", "raw"] = "boxed"

    def __post_init__(self):
        super().__post_init__()
        _check("reward", [(self.timeout_s > 0, f"timeout_s={self.timeout_s} must be > 0"),
                          (self.num_workers >= 1, f"num_workers={self.num_workers} must be >= 1"),
                          (self.max_pool_restarts >= 0, f"max_pool_restarts={self.max_pool_restarts} must be >= 0")])


@dataclass
class TrainerConfig:
    """The RL loop. ``total_steps`` has no default (stapo_spec §10.15): every RL run must set it."""

    total_steps: Optional[int] = None
    train_batch_size: int = 256
    seed: int = 0
    run_dir: str = "runs/stapo"
    log_every: int = 1
    save_every: int = 50
    keep_checkpoints: int = 3
    eval_every: int = 0
    export_hf: bool = True
    resume: bool = True
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])  # verl's trainer.logger
    project_name: str = "stapo_jax"            # W&B project (verl's trainer.project_name)
    experiment_name: Optional[str] = None      # W&B run name (verl's trainer.experiment_name); None = run_dir's name
    compilation_cache_dir: Optional[str] = "auto"  # persistent XLA cache (configs/base.yaml); null / "" = off
    precompile: Union[bool, Literal["auto"]] = "auto"  # bounded shapes compiled in the warm-up; auto: GPU / TPU
    stall_timeout_s: Optional[float] = None    # runtime/watchdog.py: None = 600 s on CPU, 1800 s else; 0 = off

    def __post_init__(self):
        _check("trainer", [(self.stall_timeout_s is None or self.stall_timeout_s >= 0,
                            f"stall_timeout_s={self.stall_timeout_s} must be >= 0 (0 = off, null = by backend)")])


@dataclass
class SFTConfig:
    """Supervised warm-up (``stapo-jax sft``); ``steps: 0`` skips it."""

    steps: int = 0
    lr: float = 1e-4
    batch_size: int = 32
    warmup_steps: int = 10


@dataclass
class EvalConfig:
    """Benchmark evaluation (stapo_spec §8): avg@N per benchmark, two decoding settings."""

    benchmarks: list[str] = field(default_factory=lambda: [
        "aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench"])
    data_dir: Optional[str] = None      # None: the six benchmarks shipped in stapo_jax/assets/benchmarks
    n_samples: Union[int, dict[str, int]] = field(default_factory=lambda: {
        "aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva_math": 4, "olympiadbench": 4})
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 31744
    grader: Literal["math_verify", "boxed_exact"] = "math_verify"


def micro_batch_count(rows: int, dp: int, micro: int) -> Optional[int]:
    """K for a mini-batch of ``rows`` sequences over ``dp`` data-parallel shards in micro-batches of ``micro``
    sequences (``actor.ppo_micro_batch_size``): ``rows / dp / micro``, or 1 when ``micro`` is at least the rows per
    shard; None when the rows do not split evenly. The one rule of the trainer (``train.batch_shapes.check_batch_shapes``),
    the planner and :meth:`Config.grad_accum_steps`. Ints in, an int or None out; never raises. Source: verl's
    gradient accumulation (mini-batch / micro-batch)."""
    if dp < 1 or micro < 1 or rows % dp:
        return None
    per_device = rows // dp
    k = max(per_device // micro, 1)
    if per_device % k or (per_device > micro and per_device % micro):
        return None
    return k


@dataclass
class Config:
    """The whole run configuration (one section per dataclass above)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    s2t: S2TConfig = field(default_factory=S2TConfig)
    top_entropy: TopEntropyConfig = field(default_factory=TopEntropyConfig)
    cov: CovConfig = field(default_factory=CovConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # the settings of registered extensions whose section is not a field above (stapo_jax.config.extensions):
    # {dotted section: settings instance}, e.g. "reward.math_verify_strict"; filled by from_dict with the sections
    # the YAML sets (an absent one means its defaults: stapo_jax.core.registry.settings_for)
    extensions: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.actor.ppo_micro_batch_size == "auto":  # the mini-batch's sequences: one micro-batch per shard
            self.actor = dataclasses.replace(self.actor, ppo_micro_batch_size=max(
                self.actor.ppo_mini_batch_size * self.rollout.n, 1))

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain YAML/JSON types (tuples become lists); each extension's settings sit at
        their own dotted section (``reward.math_verify_strict``), as in the YAML they were read from.
        ``actor.token_mask`` is the resolved name (:func:`token_mask_name`: for a Config built in Python with
        ``token_mask=None``, the mask its ``<mask>.enabled`` flag chooses), and the flags are not written, so
        ``from_dict(cfg.to_dict())`` selects the same mask. Returns a nested dict; never raises.
        Source: this module's schema (verl-style one key naming the mask)."""
        out = plain_copy(dataclasses.asdict(self))
        out["actor"]["token_mask"] = token_mask_name(self)
        for mask in TOKEN_MASK_FLAGS:  # derived from actor.token_mask: not written (the older spelling)
            out[mask].pop("enabled")
        for section, values in out.pop("extensions").items():
            set_dotted(out, section, values)
        return out

    def save(self, run_dir: str | os.PathLike) -> Path:
        """Write the resolved config to ``run_dir/config.yaml`` (atomically); returns the path.
        ``load_config(path)`` of that file gives a Config equal to ``self``."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / CONFIG_FILENAME
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False, width=120))
        os.replace(tmp, path)
        return path

    def grad_accum_steps(self, data_parallel_size: int) -> int:
        """Micro-batches K per mini-batch on each data-parallel shard, by the trainer's rule
        (:func:`micro_batch_count`: ``ppo_mini_batch_size * rollout.n / data_parallel_size /
        ppo_micro_batch_size``, 1 when the micro-batch size is at least a shard's rows).

        Raises:
          ConfigError: the mini-batch's sequences do not split evenly over the shards and micro-batches.
        """
        seqs = self.actor.ppo_mini_batch_size * self.rollout.n
        k = micro_batch_count(seqs, data_parallel_size, self.actor.ppo_micro_batch_size)
        if k is None:
            raise ConfigError(f"actor.ppo_mini_batch_size x rollout.n = {seqs} sequences do not split into "
                              f"{data_parallel_size} data-parallel shards of micro-batches of "
                              f"actor.ppo_micro_batch_size={self.actor.ppo_micro_batch_size}")
        return k

    def check_rl_ready(self) -> None:
        """Checks that only an RL run needs (stapo_spec §10.15: ``trainer.total_steps`` is required).

        Raises:
          ConfigError: ``trainer.total_steps`` unset, or no training prompts configured.
        """
        if self.trainer.total_steps is None:
            raise ConfigError("trainer.total_steps is required for an RL run (the spec sets no default)")
        if self.data.source == "gym":
            if not self.data.gym.task:
                raise ConfigError("data.gym.task is required with data.source=gym")
        elif not self.data.train_files:
            raise ConfigError(f"data.train_files is empty (data.source={self.data.source})")


# --------------------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config, apply dotted ``key.sub=value`` overrides, recipe defaults, type checks and
    cross-field validation.

    Args:
      path: YAML file (a mapping of sections); None gives the schema defaults.
      overrides: strings ``"section.key=value"``; the value is parsed with ``yaml.safe_load`` (so
        ``true``, ``3``, ``[a, b]``, ``null`` work). Later overrides win.

    Returns:
      The validated :class:`Config`.

    Raises:
      FileNotFoundError: ``path`` does not exist (IsADirectoryError: it is a directory).
      ConfigError: unknown keys (all of them in one message, each with the closest valid key suggested),
        wrong type, malformed override, or a cross-field check failed; the message names the key(s).
    Source: verl's Hydra config (key spellings), stapo_spec.md §10 (defaults).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"config file {path} is a directory (expected a YAML file)")
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            loaded = safe_load_unique(path.read_text())  # a key given twice is an error, not last-wins
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        except ConfigError as e:  # a repeated key
            raise ConfigError(f"{path}: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(loaded).__name__}")
        raw = loaded or {}
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    source = f"{path}" + (" with overrides" if overrides else "") if path is not None else None
    return from_dict(raw, source=source or ("overrides" if overrides else None))


def from_dict(raw: Mapping[str, Any], source: Optional[str] = None) -> Config:
    """Build and validate a Config from a nested mapping (as :func:`load_config`, without file I/O).
    ``source``: where the mapping came from (a file name), named by the registry errors.

    Raises:
      ConfigError: see :func:`load_config`.
    Takes YAML scalars, lists, mappings. Source: stapo_spec.md §5 (recipe defaults), verl key names.
    """
    raw = plain_copy(raw)
    sections = declared_sections(Config)  # the registered extensions' own sections (imports the registries)
    own = split_sections(raw, sections, Config)
    recipe = raw.get("algorithm", {}).get("recipe", AlgorithmConfig.recipe) if isinstance(
        raw.get("algorithm", {}), dict) else AlgorithmConfig.recipe
    preset = RECIPE_PRESETS.get(recipe) if isinstance(recipe, str) else None  # a bad recipe: reported by its Literal
    resolve_token_mask(raw, preset.token_mask if preset is not None else "none")
    if preset is not None:
        for key, value in preset.defaults.items():
            section = raw.get(key.split(".", 1)[0])
            # a section that is not a mapping (``s2t: []``) is reported by build_dataclass, naming the section
            if (section is None or isinstance(section, dict)) and not has_dotted(raw, key):
                set_dotted(raw, key, value)
    unknown = unknown_keys(Config, raw, "")
    if len(unknown) == 1:
        raise ConfigError(unknown[0])
    if unknown:
        raise ConfigError(f"{len(unknown)} unknown config keys:\n  " + "\n  ".join(unknown))
    cfg = build_dataclass(Config, raw, "")
    cfg.extensions = build_settings(own, sections)
    validate(cfg)
    check_registered_names(cfg, source)
    return cfg
