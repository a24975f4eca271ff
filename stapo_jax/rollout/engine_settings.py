"""The static settings of a :class:`~stapo_jax.rollout.engine.Qwen3Engine` (:class:`EngineConfig`) and their
error type, in a module of their own so that the engine and its jitted functions (:mod:`stapo_jax.rollout.decode_fns`)
both import them without importing each other. Re-exported by :mod:`stapo_jax.rollout.engine`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from models.linear import KERNEL_LAYOUTS
from stapo_jax.rollout.sampling import SamplingParams

__all__ = ["CACHE_DTYPES", "EngineConfig", "EngineConfigError"]


class EngineConfigError(ValueError):
    """An invalid engine setting (names the field)."""


CACHE_DTYPES = (None, "float32", "bfloat16", "float16")  # None: the model's compute dtype


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of a :class:`Qwen3Engine`.

    Attributes:
      max_concurrent_decodes: number of slots (KV-cache rows) decoded together; > 0.
      max_prefill_length: longest prompt in tokens; > 0. For gRPC serving it must be one of
        ``PREFILL_BUCKETS`` (JetStream's padding buckets), and a served prompt may hold at most
        ``max_prefill_length - 1`` tokens (JetStream adds a BOS marker).
      max_decode_length: most tokens generated per request (cache capacity after the prompt); > 0.
      sampling: :class:`SamplingParams` used by ``generate``.
      eos_token_ids: stop ids. ``None``: the model config's EOS ids plus Qwen3's {151643, 151645} (those
        inside the vocabulary).
      seed: default seed of ``init_decode_state``.
      cache_dtype: KV-cache dtype name; ``None`` = the model's compute dtype.
      kernel_layout: how the engine's per-layer decode copy holds the linear kernels: ``"in_out"`` (as the
        trainer), ``"out_in"`` (transposed, PyTorch's layout: faster skinny matmuls on XLA:CPU on an Intel
        Xeon or an AVX2 AMD EPYC, for a transpose at each weight sync) or ``"auto"`` (``"in_out"`` off CPU
        and on an AVX-512 AMD host, ``"out_in"`` on other CPUs; :func:`models.linear.preferred_kernel_layout`).
      kv_cache_buckets: True (default): :class:`~stapo_jax.rollout.driver.RolloutDriver` keeps the decode state's
        KV cache at the smallest of :func:`~stapo_jax.rollout.decode_fns.kv_length_buckets` that holds its
        active slots (a decode step reads all S cache positions of every slot, filled or not), resizing it
        between steps; False: always ``cache_length``. The two agree to float rounding (log-probs to about
        1e-6 relative; a token can differ only where two candidates tie to that precision): XLA:CPU's sums and
        ``exp`` round differently for different cache lengths, as for different slot counts.
      prefill_batch_size: prompts per :meth:`Qwen3Engine.prefill_batch` call (the driver's batched prefill;
        every call of a prefill bucket pads to the same number of rows, so each bucket compiles once, and a
        call with fewer prompts still computes every row: set 1 where calls carry one prompt); > 0.
      prefill_batch_tokens: fewer rows for long prompts: at most ``max(1, prefill_batch_tokens // bucket)``
        (:meth:`Qwen3Engine.prefill_rows`), which bounds a prefill call's memory; > 0.
    """

    max_concurrent_decodes: int = 8
    max_prefill_length: int = 64
    max_decode_length: int = 128
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: Optional[tuple[int, ...]] = None
    seed: int = 0
    cache_dtype: Optional[str] = None
    kernel_layout: str = "auto"
    kv_cache_buckets: bool = True
    prefill_batch_size: int = 8
    prefill_batch_tokens: int = 4096

    def __post_init__(self):
        for f in ("max_concurrent_decodes", "max_prefill_length", "max_decode_length", "prefill_batch_size",
                  "prefill_batch_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise EngineConfigError(f"EngineConfig.{f} must be a positive int, got {v!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise EngineConfigError(f"EngineConfig.sampling must be a SamplingParams, got {type(self.sampling)}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise EngineConfigError(f"EngineConfig.cache_dtype must be one of {CACHE_DTYPES}, got "
                                    f"{self.cache_dtype!r}")
        if self.kernel_layout not in ("auto",) + KERNEL_LAYOUTS:
            raise EngineConfigError(f"EngineConfig.kernel_layout must be one of {('auto',) + KERNEL_LAYOUTS}, got "
                                    f"{self.kernel_layout!r}")
        if not isinstance(self.kv_cache_buckets, bool):
            raise EngineConfigError(f"EngineConfig.kv_cache_buckets must be a bool, got {self.kv_cache_buckets!r}")
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    @property
    def cache_length(self) -> int:
        """KV-cache positions per slot: ``max_prefill_length + max_decode_length``."""
        return self.max_prefill_length + self.max_decode_length
