"""Compatibility shim for google-jetstream 0.2.2 on current JAX, imported before any ``jetstream`` import.

JetStream 0.2.2 (the PyPI version, installed ``--no-deps``; conventions §7 "Installing it on current JAX") has
three problems on jax >= 0.6 without seqio/TensorFlow:

1. ``jetstream.core.orchestrator.delete_pytree`` calls ``jax.tree_map``, which JAX removed. An exception in an
   orchestrator thread makes ``JetThread`` SIGKILL the whole process, so the alias must exist first.
2. ``jetstream.engine.token_utils`` imports ``seqio.vocabularies`` (``Vocabulary``, ``SentencePieceVocabulary``)
   at module import. We register a stub module; its ``SentencePieceVocabulary`` raises, because our engine
   overrides ``build_tokenizer`` and never uses SentencePiece.
3. Importing ``jetstream.core.orchestrator`` sets the root logger to DEBUG and adds a stdout handler; we restore
   the previous root level and handlers.

Also ``jetstream.core.server_lib._HOST`` is ``"[::]"`` (all interfaces); :func:`import_server_lib` sets it to
``127.0.0.1`` unless told otherwise.

Usage: ``from stapo_jax.rollout import compat; orchestrator = compat.import_orchestrator()`` or call
:func:`install` before importing ``jetstream`` yourself.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

import jax

DEFAULT_HOST = "127.0.0.1"
_installed = False


class SeqioStubError(ImportError):
    """Raised when JetStream tries to use SentencePiece through the seqio stub (seqio is not installed)."""


def _make_seqio_stub() -> tuple[types.ModuleType, types.ModuleType]:
    seqio = types.ModuleType("seqio")
    vocabularies = types.ModuleType("seqio.vocabularies")

    class Vocabulary:  # noqa: D401 - a type marker only (token_utils uses it in annotations)
        """Stand-in for ``seqio.vocabularies.Vocabulary`` (annotations only)."""

    class SentencePieceVocabulary(Vocabulary):
        """Stand-in that refuses to build: stapo_jax engines use a transformers tokenizer."""

        def __init__(self, *args, **kwargs):
            raise SeqioStubError(
                "seqio is not installed (JetStream is installed --no-deps); SentencePiece tokenizers are not "
                "supported. Engines must override build_tokenizer (stapo_jax.rollout.engine does)."
            )

    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    seqio.vocabularies = vocabularies
    seqio.Vocabulary = Vocabulary
    seqio.SentencePieceVocabulary = SentencePieceVocabulary
    seqio.__stapo_jax_stub__ = True
    return seqio, vocabularies


def install() -> None:
    """Install the ``jax.tree_map`` alias and, when seqio is absent, the seqio stub. Idempotent.

    Returns:
      None. Side effects: ``jax.tree_map`` (if missing) and ``sys.modules["seqio"]``,
      ``sys.modules["seqio.vocabularies"]`` (only if the real seqio cannot be found).

    Raises nothing: a missing seqio is stubbed, not an error. Source: JetStream 0.2.2
    (``jetstream.core.orchestrator``), conventions §7.
    """
    global _installed
    if _installed:
        return
    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree_util.tree_map  # used by jetstream.core.orchestrator.delete_pytree
    if "seqio" not in sys.modules and importlib.util.find_spec("seqio") is None:
        seqio, vocabularies = _make_seqio_stub()
        sys.modules["seqio"] = seqio
        sys.modules["seqio.vocabularies"] = vocabularies
    _installed = True


def import_orchestrator() -> types.ModuleType:
    """Import ``jetstream.core.orchestrator`` with the shim installed, keeping the root logger as it was.

    Returns:
      The ``jetstream.core.orchestrator`` module.

    Raises ImportError when JetStream is not installed. Source: JetStream 0.2.2
    ``jetstream.core.orchestrator`` (conventions §7).
    """
    install()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        return importlib.import_module("jetstream.core.orchestrator")
    finally:
        root.setLevel(level)
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)


def import_server_lib(host: str = DEFAULT_HOST) -> types.ModuleType:
    """Import ``jetstream.core.server_lib`` (after the orchestrator shim) and bind it to ``host``.

    Args:
      host: the interface the gRPC server binds (``server_lib._HOST``); default ``127.0.0.1``. Pass
        ``"[::]"`` to listen on all interfaces deliberately.
    Returns:
      The ``jetstream.core.server_lib`` module with ``_HOST`` set.
    Raises:
      ValueError: ``host`` is empty.

    ``host`` a str. Also raises ImportError when JetStream is not installed. Source: JetStream 0.2.2
    ``jetstream.core.server_lib`` (``_HOST``).
    """
    if not host:
        raise ValueError("server host must be a non-empty string, e.g. '127.0.0.1'")
    import_orchestrator()
    server_lib = importlib.import_module("jetstream.core.server_lib")
    server_lib._HOST = host  # pylint: disable=protected-access
    return server_lib
