"""JetStream's ``Tokenizer`` over a transformers tokenizer (split from ``engine.py``): :class:`HFTokenizer`,
:func:`load_tokenizer` and ``NO_BOS_ID``, the BOS marker Qwen3 (which has none) reports to JetStream."""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import numpy as np

from stapo_jax.rollout import compat

compat.install()

from jetstream.engine import token_utils, tokenizer_api  # noqa: E402

from stapo_jax.data.tokenizer import QWEN3_STOP_IDS  # noqa: E402

log = logging.getLogger(__name__)

NO_BOS_ID = -1  # Qwen3 has no BOS; JetStream prepends bos_id to token requests, prefill masks it out.


class HFTokenizer(tokenizer_api.Tokenizer):
    """JetStream ``Tokenizer`` over a transformers tokenizer (or token ids only, when none is given).

    ``encode`` returns JetStream-padded ids (``token_utils.pad_tokens``: right padding to a bucket,
    ``jax_padding``) without a BOS (Qwen3 has none); ``bos_id`` is ``NO_BOS_ID`` (-1), which the engine
    masks out when JetStream prepends it to token requests. ``stop_tokens`` is empty: the engine itself
    marks the step after an EOS invalid, so the EOS token reaches the client.
    Without a tokenizer, ``encode`` returns a rejected (all-marker) request and ``decode`` returns "".
    """

    def __init__(self, tokenizer: Any = None, eos_token_ids: Sequence[int] = QWEN3_STOP_IDS):
        self.tokenizer = tokenizer
        self._eos = tuple(int(i) for i in eos_token_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad = int(pad) if pad is not None else (self._eos[0] if self._eos else 0)

    def encode(self, s: str, **kwargs):
        """Text -> (padded ids, true_length); see the class docstring. Never raises on text input."""
        max_len = kwargs.get("max_prefill_length")
        jax_padding = kwargs.get("jax_padding", True)
        if self.tokenizer is None:
            log.error("text request received but the server has no tokenizer; rejecting it")
            ids = np.array([NO_BOS_ID], np.int32)
        else:
            ids = np.asarray(self.tokenizer.encode(s, add_special_tokens=False), np.int32)
        if ids.size == 0:
            ids = np.array([NO_BOS_ID], np.int32)
        return token_utils.pad_tokens(ids, NO_BOS_ID, self._pad, is_bos=False, max_prefill_length=max_len,
                                      jax_padding=jax_padding)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        """Ids -> text (special tokens kept); "" without a tokenizer."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    @property
    def pad_id(self) -> int:
        """The padding id (int) ``encode`` right-pads with (JetStream ``Tokenizer.pad_id``)."""
        return self._pad

    @property
    def eos_id(self) -> int:
        """The first EOS id (int), or ``pad_id`` when there is none (JetStream ``Tokenizer.eos_id``)."""
        return self._eos[0] if self._eos else self._pad

    @property
    def bos_id(self) -> int:
        """``NO_BOS_ID`` (-1): Qwen3 has no BOS; prefill masks out the -1 JetStream prepends."""
        return NO_BOS_ID

    @property
    def stop_tokens(self) -> set[int]:
        """Empty: the engine marks the step after an EOS invalid itself, so the EOS token reaches the client."""
        return set()


def load_tokenizer(path: Optional[str]):
    """A transformers tokenizer from a local directory (``AutoTokenizer``), or None for ``path`` None/"".

    ``path`` a str or None. Raises OSError (from transformers) when ``path`` holds no tokenizer files.
    Source: HF transformers ``AutoTokenizer.from_pretrained``.
    """
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
