"""Orbax checkpoints of a training run: train state (params, optimizer state, step, RNG) + data iterator state.

A thin layer over ``orbax.checkpoint.CheckpointManager`` with a ``Composite`` of ``StandardSave`` (the train
state pytree) and ``JsonSave`` (Grain iterator state and run metadata), as conventions.md §8 recommends.
Orbax writes each step into a temporary directory and renames it on commit, so a checkpoint killed half-way is
never listed by ``latest_step`` and never restored.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from stapo_jax.core.errors import CheckpointError


MAX_ERROR_DETAIL = 400  # characters of Orbax's / TensorStore's message kept in a CheckpointError
ITEMS = ("state", "data", "meta")  # the item folders every save writes into a step folder


class Checkpointer:
    """Save every ``save_every`` steps, keep the newest ``keep``, restore the latest committed step.

    Args:
      directory: run checkpoint directory (created if missing); absolute or relative path.
      save_every: save interval in optimizer steps (>= 1).
      keep: number of checkpoints kept (>= 1).
      async_save: write in a background thread (Orbax async checkpointing).
    Raises:
      ValueError: ``save_every`` or ``keep`` < 1.
    """

    def __init__(self, directory: str, *, save_every: int = 1, keep: int = 3, async_save: bool = True):
        if save_every < 1 or keep < 1:
            raise ValueError(f"checkpoint save_every={save_every} and keep={keep} must be >= 1")
        self.directory = os.path.abspath(directory)
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1, create=True,
                                               enable_async_checkpointing=async_save)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> Optional[int]:
        """Newest fully committed step, or None.

        Raises: CheckpointError when the newest step folder lacks an item every save writes (``ITEMS``): a
        non-atomic rename (a gcsfuse mount) or a copy of the run directory cut short. Orbax lists any folder
        named by a number as committed; one line names the folder and the way back to the step before."""
        step = self._mngr.latest_step()
        if step is not None:
            folder = os.path.join(self.directory, str(step))
            missing = [item for item in ITEMS if not os.path.isdir(os.path.join(folder, item))]
            if missing:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} is incomplete (no "
                                      f"{', '.join(missing)}): move {folder} aside and run again to resume "
                                      f"from the step before it")
        return step

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a save step (``step % save_every == 0``). Never raises."""
        return step % self.save_every == 0

    def save(self, step: int, state: Any, data_state: Optional[dict] = None, meta: Optional[dict] = None,
             *, force: bool = False) -> bool:
        """Save ``state`` (any pytree of arrays) plus JSON-serialisable ``data_state`` and ``meta`` at ``step``.

        Returns True when a save was started (``force`` or ``step % save_every == 0``). Asynchronous: call
        :meth:`wait` before relying on the files.
        """
        if not (force or self.should_save(step)):
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state or {}),
                                  meta=ocp.args.JsonSave(meta or {}))
        return bool(self._mngr.save(step, args=args, force=True))

    def restore(self, abstract_state: Any, step: Optional[int] = None) -> tuple[int, Any, dict, dict]:
        """Restore ``step`` (default: latest) into the structure/shardings of ``abstract_state``.

        Args:
          abstract_state: a pytree of arrays or ``jax.ShapeDtypeStruct`` (with ``sharding``) giving the target
            structure, dtypes and shardings.
        Returns:
          (step, state, data_state, meta).
        Raises:
          CheckpointError: no committed checkpoint exists, or the step cannot be restored (the stored tree does
            not match, or its files are damaged): one line naming the step, the cause (cut to
            ``MAX_ERROR_DETAIL`` characters) and the way back to the previous step.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no committed checkpoint in {self.directory}")
        # jax arrays restore into their shardings; numpy leaves (host state, e.g. the RNG) restore as numpy
        target = jax.tree.map(lambda x: x if isinstance(x, np.ndarray) else ocp.utils.to_shape_dtype_struct(x),
                              abstract_state)
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises several types; name the directory and step, one line
            detail = " ".join(str(e).split())  # TensorStore errors carry multi-line JSON specs
            if len(detail) > MAX_ERROR_DETAIL:
                detail = detail[:MAX_ERROR_DETAIL] + " ..."
            raise CheckpointError(f"cannot restore step {step} from {self.directory}: {type(e).__name__}: {detail} "
                                  f"(if that step is damaged, move {os.path.join(self.directory, str(step))} aside "
                                  f"and run again to resume from the step before it)") from e
        return step, out["state"], dict(out["data"] or {}), dict(out["meta"] or {})

    def read_meta(self, step: Optional[int] = None) -> dict:
        """The ``meta`` item of ``step`` (default: latest) alone, without restoring the state: what a resumed run
        checks before building the restore target. ``{}`` when the step holds none.
        Raises: CheckpointError when no committed checkpoint exists or the item cannot be read."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no committed checkpoint in {self.directory}")
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises several types
            raise CheckpointError(f"cannot read the metadata of step {step} in {self.directory}: "
                                  f"{type(e).__name__}: {' '.join(str(e).split())[:MAX_ERROR_DETAIL]}") from e
        return dict(out["meta"] or {})

    def wait(self) -> None:
        """Block until pending asynchronous saves are committed."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves, then close the orbax manager. Orbax errors propagate."""
        self._mngr.wait_until_finished()
        self._mngr.close()


def export_hf(model, tok, out: str) -> str:
    """HF safetensors + tokenizer into ``out``, written next to it (``out.tmp``) and swapped in (a re-run replaces
    it; the previous export is renamed to ``out.old`` before the swap and deleted after it, so a kill at any point
    leaves one complete export on disk).
    Every process takes part in gathering the (sharded, possibly multi-host) parameters tensor by tensor (never
    more than one tensor on the host); process 0 alone writes. Returns ``out``.

    Args:
      model: the ``models.qwen3.Qwen3`` to export; tok: its transformers tokenizer; out: target directory.
    Raises:
      stapo_jax.core.errors.CheckpointError: a parameter/config mismatch (see ``models.hf.save_hf_checkpoint``).
    Parameters are written in their own dtype (float32 or bfloat16 safetensors). Source: HF ``save_pretrained``
    layout (``config.json`` + ``model.safetensors``).
    """
    import shutil

    from jax.experimental import multihost_utils

    from models.hf import iter_hf_tensors, save_hf_checkpoint

    if jax.process_index() != 0:
        for _ in iter_hf_tensors(model, model.config):  # the same gathers, in the same order, as process 0
            pass
        multihost_utils.sync_global_devices("stapo_jax hf export")
        return out
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(model, model.config, tmp)
    tok.save_pretrained(tmp)
    old = out + ".old"  # the previous export moves aside first: a kill at any point leaves a complete copy
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out):
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("stapo_jax hf export")
    return out
