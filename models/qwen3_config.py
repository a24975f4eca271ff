"""The Qwen3 architecture settings of this port (:class:`Qwen3Config`, HF ``config.json`` field names) and the
per-layer rematerialisation policies it names (:data:`REMAT_POLICIES`).

A config is validated when built: an unsupported value is a :class:`~stapo_jax.core.errors.ConfigError`.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import jax
import jax.numpy as jnp

from models.attention import DEFAULT_BLOCK, IMPLEMENTATIONS
from models.special_tokens import QWEN3_ENDOFTEXT_ID, QWEN3_IM_END_ID
from stapo_jax.core.errors import ConfigError

__all__ = ["Qwen3Config", "REMAT_POLICIES"]

REMAT_POLICIES = {  # Qwen3Config.remat -> jax.checkpoint policy (models.qwen3_layers.remat_layer)
    "none": None,
    "full": "full",
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 architecture plus the dtype / remat policy of this port. Field names follow HF ``config.json``.

    ``dtype`` is the compute dtype (activations, matmul inputs), ``param_dtype`` the storage dtype of
    parameters; norms, softmax and logits are always computed in float32. ``remat`` is one of
    ``none | full | dots | dots_no_batch`` (``jax.checkpoint`` policy per layer); ``scan_unroll`` the layers per
    iteration of the layer scan (:mod:`models.layer_scan`; 1: a rolled loop). ``attention`` is the
    self-attention kernel of the uncached forward and of prefill (``xla | blockwise | cudnn | splash | auto``,
    see :mod:`models.attention`); cached decoding always attends over the KV cache. ``attention_block_size``
    is the blockwise/splash tile in tokens.
    """

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    bos_token_id: Optional[int] = QWEN3_ENDOFTEXT_ID
    eos_token_id: Any = QWEN3_IM_END_ID  # int or tuple of ints
    pad_token_id: Optional[int] = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    scan_unroll: int = 1
    attention: str = "xla"
    attention_block_size: int = DEFAULT_BLOCK

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"Qwen3Config.{f}={getattr(self, f)!r}: expected float32, bfloat16 or float16")
        if self.attention not in IMPLEMENTATIONS:
            raise ConfigError(f"Qwen3Config.attention={self.attention!r}: expected one of {list(IMPLEMENTATIONS)}")
        if self.attention_block_size <= 0:
            raise ConfigError(f"Qwen3Config.attention_block_size={self.attention_block_size} must be positive")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"Qwen3Config.remat={self.remat!r}: expected one of {sorted(REMAT_POLICIES)}")
        if isinstance(self.scan_unroll, bool) or not isinstance(self.scan_unroll, int) or self.scan_unroll < 1:
            raise ConfigError(f"Qwen3Config.scan_unroll={self.scan_unroll!r}: expected an int >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All EOS ids as a tuple (HF allows an int or a list)."""
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (tuple, list)) else (int(e),)

    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "Qwen3Config":
        """Build from an HF ``config.json`` dict (transformers 4.51 form or 5.x ``rope_parameters`` form).

        Raises:
          ConfigError: ``model_type``/``architectures`` is not Qwen3, RoPE scaling, attention bias or sliding
            window is requested, or a required field is missing.
        """
        mt = d.get("model_type")
        archs = d.get("architectures") or []
        if mt != "qwen3" and "Qwen3ForCausalLM" not in archs:
            raise ConfigError(f"not a Qwen3 config: model_type={mt!r}, architectures={archs!r} (expected 'qwen3')")
        rope = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise ConfigError("Qwen3 config has neither 'rope_theta' nor 'rope_parameters.rope_theta'")
        rope_type = rope.get("rope_type", "default")
        scaling = d.get("rope_scaling")
        if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
            raise ConfigError(f"RoPE scaling is not supported: rope_parameters={rope!r}, rope_scaling={scaling!r}")
        if d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not Qwen3's architecture and is not supported")
        if d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ConfigError(f"Qwen3 config is missing {missing}")
        nh = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=nh,
            num_key_value_heads=d.get("num_key_value_heads") or nh,
            head_dim=d.get("head_dim") or d["hidden_size"] // nh,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            initializer_range=d.get("initializer_range", 0.02),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_json(cls, path, **overrides) -> "Qwen3Config":
        """Read an HF ``config.json`` file (see :meth:`from_hf_dict`)."""
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), **overrides)

    def to_hf_dict(self) -> dict:
        """The ``config.json`` dict that ``transformers.Qwen3ForCausalLM`` / ``Qwen3Config`` loads."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": None, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": self.num_hidden_layers,
            "initializer_range": self.initializer_range, "bos_token_id": self.bos_token_id,
            "eos_token_id": eos, "pad_token_id": self.pad_token_id, "use_cache": True,
            "torch_dtype": self.param_dtype,
        }

    @property
    def compute_dtype(self):
        """``jnp.dtype`` of ``dtype``: activations and matmul inputs."""
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        """``jnp.dtype`` of ``param_dtype``: how the parameters are stored."""
        return jnp.dtype(self.param_dtype)
