"""The project's error classes, one of each: every layer raises and catches these (``models`` included).

* :class:`ConfigError`: a settings value (run config key, model config field) is unknown, of the wrong type or
  range, or contradicts another.
* :class:`CheckpointError`: a checkpoint (an Orbax run checkpoint or a Hugging Face safetensors checkpoint) cannot
  be read, restored or written.
"""
from __future__ import annotations

__all__ = ["ConfigError", "CheckpointError"]


class ConfigError(ValueError):
    """A config key is unknown, a value has the wrong type or range, or two keys contradict each other; also a
    model config that is not a Qwen3 config or holds an unsupported value.

    The message always names the dotted key(s) or the config field involved.
    """


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint that cannot be used: a run checkpoint directory that cannot be restored into the requested
    state (no committed step, a damaged or mismatched step), or a Hugging Face checkpoint that is not a Qwen3
    checkpoint, lacks a tensor, holds a tensor of the wrong shape, or cannot be written.

    Both a ``ValueError`` (bad input: ``stapo-jax`` prints it as one line) and a ``RuntimeError``.
    """
