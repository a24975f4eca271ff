"""Tokenizers: the real Qwen3 one from files (transformers) or a small offline character-level one.

``load_tokenizer(cfg)`` returns a ``transformers`` fast tokenizer either way, so the data pipeline, the
rollout engine and the HF export treat both alike (``apply_chat_template``, ``decode``, ``save_pretrained``).

The builtin tokenizer (``tokenizer.kind: builtin``) is built with the ``tokenizers`` library: one token per
printable ASCII character plus newline and tab, the Qwen3 special tokens ``<|endoftext|>`` (pad; also a stop
token, as Qwen3 base models' EOS), ``<|im_start|>``, ``<|im_end|>`` (EOS), ``<think>``, ``</think>``, and an
``<|unk|>`` token for any other character. Its chat template is Qwen3's (ChatML turns; ``enable_thinking=
False`` appends an empty think block), without the tool-calling parts.

Pad and EOS may share an id (Qwen3: ``<|endoftext|>`` is both base-model EOS and pad), so masks must never be
derived from ``token == pad_id``; carry explicit lengths / masks (conventions.md §6).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from models.special_tokens import QWEN3_STOP_IDS  # noqa: F401  (re-exported: the engine and client use it)
from stapo_jax.config.schema import Config, TokenizerConfig
from stapo_jax.core.errors import ConfigError

ENDOFTEXT, IM_START, IM_END, THINK, END_THINK, UNK = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|unk|>")
BUILTIN_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK, UNK)
BUILTIN_CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))  # newline, tab, printable ASCII
# Qwen3's stop set is {<|endoftext|>, <|im_end|>} (conventions.md §6); the same names are used here.
STOP_TOKEN_NAMES = (ENDOFTEXT, IM_END)
# Qwen3's stop ids QWEN3_STOP_IDS are defined once in models.special_tokens (conventions.md §6), for a model
# without a tokenizer (the engine, the gRPC client, the planner); the pad id is <|endoftext|>
QWEN3_PAD_ID = QWEN3_STOP_IDS[0]

BUILTIN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def load_tokenizer(cfg: Config | TokenizerConfig, model_path: str | None = None):
    """Load the configured tokenizer.

    Args:
      cfg: the run :class:`~stapo_jax.config.schema.Config` (uses ``tokenizer`` and falls back to ``model.path``)
        or just its ``TokenizerConfig`` (then ``model_path`` is the fallback).
      model_path: fallback directory / hub id when ``tokenizer.path`` is unset.

    Returns:
      A ``transformers`` fast tokenizer (``PreTrainedTokenizerFast`` / ``TokenizersBackend`` subclass) with
      ``eos_token``, ``pad_token`` and a chat template set.

    Raises:
      ConfigError: ``kind: hf`` without ``tokenizer.path`` or ``model.path``; a local path that does not exist.
      OSError: transformers cannot load the files (message names the path).
    The tokenizer maps str to lists of int ids.
    """
    if isinstance(cfg, Config):
        model_path = cfg.model.path
        cfg = cfg.tokenizer
    if cfg.kind == "builtin":
        return build_builtin_tokenizer()
    path = cfg.path or model_path
    if not path:
        raise ConfigError("tokenizer.kind=hf needs tokenizer.path or model.path "
                          "(or set tokenizer.kind=builtin for the offline character tokenizer)")
    if _looks_local(path) and not Path(path).exists():
        raise ConfigError(f"tokenizer.path={path!r} does not exist")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError/ValueError/... with its own wording
        raise OSError(f"could not load a tokenizer from {path!r}: {e}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_builtin_tokenizer():
    """The offline character-level tokenizer (module docstring). Deterministic: the same ids every call.

    Ids: specials 0..5 in the order of :data:`BUILTIN_SPECIAL_TOKENS` (``<|endoftext|>``=0, ``<|im_start|>``=1,
    ``<|im_end|>``=2, ``<think>``=3, ``</think>``=4, ``<|unk|>``=5), then the characters of
    :data:`BUILTIN_CHARS` in order; ``len(tok) == 6 + 97 == 103``.
    Returns a tokenizer of str to int ids (103 ids). Raises nothing of its own (ImportError without
    ``tokenizers`` / ``transformers``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(BUILTIN_SPECIAL_TOKENS)}
    for ch in BUILTIN_CHARS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BUILTIN_SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=UNK,
        extra_special_tokens={"im_start": IM_START, "think": THINK, "end_think": END_THINK},
        chat_template=BUILTIN_CHAT_TEMPLATE, model_max_length=1 << 20, clean_up_tokenization_spaces=False)
    return tok


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Token ids that end a response: ``eos_token_id`` plus Qwen3's ``<|endoftext|>`` and ``<|im_end|>`` where
    the vocabulary has them (Qwen3: [151645, 151643]; builtin: [2, 0]). Sorted by first occurrence, unique.
    Returns Python int ids. Raises AttributeError for an object without the tokenizer API. Source: Qwen3's
    ``generation_config.json`` stop ids (conventions.md §6)."""
    ids = [tokenizer.eos_token_id]
    for name in STOP_TOKEN_NAMES:
        i = tokenizer.convert_tokens_to_ids(name)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.append(i)
    out: list[int] = []
    for i in ids:
        if i is not None and i not in out:
            out.append(int(i))
    return out


def pad_token_id(tokenizer: Any) -> int:
    """The padding id (Qwen3: 151643 = ``<|endoftext|>``, which is also a stop token: never use it to build
    masks). Raises ValueError if the tokenizer has neither a pad nor an EOS token.
    Returns a Python int. Source: Qwen3's ``tokenizer_config.json`` (pad = ``<|endoftext|>``;
    conventions.md §6)."""
    pid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pid is None:
        raise ValueError("tokenizer has neither pad_token_id nor eos_token_id")
    return int(pid)


def _looks_local(path: str) -> bool:
    """A path (not a hub id ``org/name``): absolute, starts with '.', or exists."""
    return path.startswith((".", "/", "~")) or Path(path).exists() or path.count("/") != 1
