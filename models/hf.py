"""HF Qwen3 safetensors checkpoints <-> ``models.qwen3.Qwen3`` parameters, both directions, without torch.

Loading reads ``config.json`` and ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``) tensor by tensor with ``safetensors.safe_open(framework="numpy")`` (lazy,
memory-mapped slices; bf16 via ``ml_dtypes``) straight into each parameter's ``NamedSharding``: every device
shard is built by ``jax.make_array_from_callback`` from only its own slice of the file, and the stacked layer
parameters ``[L, ...]`` are assembled layer by layer from ``model.layers.{i}.*``. No full host copy of a
parameter is made per device.

Export writes ``config.json`` + ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` + 
``model.safetensors.index.json`` when larger than ``max_shard_size``, 5 GB by default, as
``transformers.PreTrainedModel.save_pretrained`` does), which ``transformers.Qwen3ForCausalLM.from_pretrained``
loads. A tied model (``tie_word_embeddings``) has no ``lm_head.weight`` in the files, as in HF.

Name mapping (HF torch weights are ``[out, in]``, our kernels ``[in, out]``; conventions.md §6):

===========================================  ========================================  ==========
ours (``nnx.state`` path)                    HF safetensors name                       transform
===========================================  ========================================  ==========
``embed_tokens.embedding`` [V, D]            ``model.embed_tokens.weight`` [V, D]      none
``layers.<m>.kernel`` [L, in, out]           ``model.layers.{i}.<m>.weight`` [out, in]  transpose
``layers.<m>.weight`` [L, n]                 ``model.layers.{i}.<m>.weight`` [n]        none
``norm.weight`` [D]                          ``model.norm.weight`` [D]                 none
``lm_head.kernel`` [D, V] (untied only)      ``lm_head.weight`` [V, D]                 transpose
===========================================  ========================================  ==========
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
from pathlib import Path
from typing import Iterator, Optional, Union

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors' numpy backend can read bf16)
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from models.sharding import PARAM_RULES, param_path, param_shardings
from stapo_jax.core.errors import CheckpointError, ConfigError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes, transformers' save_pretrained default ("5GB")


@dataclasses.dataclass(frozen=True)
class _Entry:
    """How one of our parameters maps to HF tensors."""

    ours: str            # dotted nnx path, e.g. "layers.mlp.up_proj.kernel"
    template: str        # HF name; "{}" = layer index for stacked params
    transpose: bool      # ours = hf.T (last two axes)
    stacked: bool        # leading L axis in ours

    def hf_names(self, num_layers: int) -> list[str]:
        return [self.template.format(i) for i in range(num_layers)] if self.stacked else [self.template]

    def hf_shape(self, our_shape: tuple[int, ...]) -> tuple[int, ...]:
        s = tuple(our_shape[1:] if self.stacked else our_shape)
        return s[::-1] if self.transpose else s


_OUR_NAME = re.compile(r"^(embed_tokens\.embedding|norm\.weight|lm_head\.kernel|layers\.[\w.]+\.(kernel|weight))$")


def _entry(ours: str) -> _Entry:
    """HF name of one of our parameters (see the module table)."""
    if not _OUR_NAME.match(ours):
        raise CheckpointError(f"parameter {ours!r} has no HF Qwen3 name (models/hf.py knows embed_tokens, "
                              f"layers.*.kernel|weight, norm, lm_head)")
    if ours == "lm_head.kernel":
        return _Entry(ours, "lm_head.weight", True, False)
    base, leaf = ours.rsplit(".", 1)
    transpose = leaf == "kernel"
    if ours.startswith("layers."):
        return _Entry(ours, "model.layers.{}." + base[len("layers."):] + ".weight", transpose, True)
    return _Entry(ours, f"model.{base}.weight", transpose, False)


# ----------------------------------------------------------------------------------------------- locating
def resolve_checkpoint(path_or_id: Union[str, os.PathLike], revision: Optional[str] = None) -> Path:
    """A local directory holding ``config.json`` and the safetensors files.

    Args:
      path_or_id: a local directory, or an HF hub repo id (``"Qwen/Qwen3-0.6B"``) downloaded with
        ``huggingface_hub.snapshot_download`` (config, safetensors and index only) when not a local path.
      revision: hub revision (branch, tag or commit) for a repo id.
    Raises:
      CheckpointError: the path does not exist and is not a repo id, or the hub cannot be reached (offline).

    Str / path in, a ``pathlib.Path`` out. Source: HF transformers ``from_pretrained`` resolution
    (local directory first, else ``huggingface_hub.snapshot_download``).
    """
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p}: expected a checkpoint directory (config.json + *.safetensors), got a file")
    s = str(path_or_id)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", s):
        raise CheckpointError(f"{s}: no such checkpoint directory, and not an HF hub repo id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        local = snapshot_download(s, revision=revision,
                                  allow_patterns=["config.json", "*.safetensors", INDEX_NAME])
    except Exception as e:  # offline, no such repo, gated, ...
        raise CheckpointError(f"{s}: not a local directory, and downloading it from the Hugging Face Hub failed "
                              f"({type(e).__name__}: {e}). Pass a local directory when offline.") from e
    return Path(local)


def read_config(ckpt_dir: Union[str, os.PathLike], **overrides) -> Qwen3Config:
    """``Qwen3Config`` from ``<ckpt_dir>/config.json`` (4.51 ``rope_theta`` or 5.x ``rope_parameters`` form).

    Args:
      overrides: ``Qwen3Config`` fields to set (``dtype``, ``param_dtype``, ``remat``).
    Raises:
      CheckpointError: no config.json, invalid JSON, or not a Qwen3 config (``model_type`` /
        ``architectures``); the message names the file and the values found.

    Int / float / bool / str fields of config.json become ``Qwen3Config`` fields. Source: HF
    transformers ``Qwen3Config`` (``config.json``, ``model_type: qwen3``).
    """
    f = Path(ckpt_dir) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (a Qwen3 checkpoint needs config.json)")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from e
    archs = d.get("architectures") or []
    if d.get("model_type") != "qwen3" or (archs and "Qwen3ForCausalLM" not in archs):
        raise CheckpointError(f"{f}: not a Qwen3 checkpoint: model_type={d.get('model_type')!r}, "
                              f"architectures={archs!r} (expected 'qwen3' / ['Qwen3ForCausalLM'])")
    try:
        return Qwen3Config.from_hf_dict(d, **overrides)
    except ConfigError as e:
        raise CheckpointError(f"{f}: {e}") from e


def _tensor_files(ckpt_dir: Path) -> tuple[dict[str, Path], str]:
    """HF tensor name -> file, and a description of where the names came from (for error messages)."""
    index = ckpt_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from e
        files = {name: ckpt_dir / fn for name, fn in weight_map.items()}
        for fn in sorted(set(files.values())):
            if not fn.is_file():
                raise CheckpointError(f"{index}: lists {fn.name}, which does not exist in {ckpt_dir}")
        return files, str(index)
    paths = [ckpt_dir / SINGLE_NAME] if (ckpt_dir / SINGLE_NAME).is_file() else sorted(ckpt_dir.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{ckpt_dir}: no *.safetensors files (weights are only read from safetensors)")
    files = {}
    for fn in paths:
        try:
            with safe_open(fn, framework="numpy") as h:
                for name in h.keys():
                    files[name] = fn
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{fn}: not a readable safetensors file ({e}); is it truncated? Re-copy or "
                                  f"re-export it") from e
    return files, ", ".join(str(p) for p in paths)


# ----------------------------------------------------------------------------------------------- loading
def load_hf_checkpoint(path_or_id: Union[str, os.PathLike], *, mesh: Optional[jax.sharding.Mesh] = None,
                       rules=PARAM_RULES, dtype: Optional[str] = None, param_dtype: Optional[str] = None,
                       remat: Optional[str] = None, revision: Optional[str] = None, attention: Optional[str] = None,
                       strict: bool = True, scan_unroll: Optional[int] = None) -> tuple[Qwen3Config, Qwen3]:
    """Load an HF Qwen3 checkpoint into a ``Qwen3`` whose parameters are placed on ``mesh``.

    Each parameter is created with ``jax.make_array_from_callback``: a device receives only its slice, read
    lazily from the memory-mapped safetensors file(s) and cast to ``param_dtype`` on the host.

    Args:
      path_or_id: local checkpoint directory or HF hub repo id (see :func:`resolve_checkpoint`).
      mesh: target mesh (:func:`models.sharding.make_mesh`); ``None`` = the first device, unsharded.
      rules: partition rules (:data:`models.sharding.PARAM_RULES`).
      dtype: compute dtype (``"float32"`` default, ``"bfloat16"``); param_dtype: parameter storage dtype
        (default float32, whatever the file holds: bf16 files are upcast exactly). remat: remat policy.
        attention: attention kernel (``Qwen3Config.attention``; default ``xla``). scan_unroll: layers per
        iteration of the layer scan (``Qwen3Config.scan_unroll``, an int >= 1; default 1).
      revision: hub revision for a repo id.
      strict: a tensor in the files that the model has no parameter for (e.g. ``model.layers.{i}`` beyond
        ``num_hidden_layers``, or another architecture's weights) raises; ``False`` warns and ignores it
        (transformers reports such names as "unexpected keys"). A stored ``lm_head.weight`` of a tied model
        is always only a warning, as in HF.
    Returns:
      ``(config, model)``: the ``Qwen3Config`` read from config.json (with the overrides) and the model.
      Use ``nnx.split(model)`` for ``(graphdef, state)``.
    Raises:
      CheckpointError: not a Qwen3 config; a missing tensor or one of the wrong shape (message names the
        tensor, the expected and actual shapes and the file); with ``strict``, tensors the model does not
        have (names up to 10 of them and their files); unreadable/absent files; hub unreachable.

    Source: HF transformers ``Qwen3ForCausalLM`` safetensors names and ``[out, in]`` layout (transposed to
    Flax's ``[in, out]`` kernels).
    """
    ckpt = resolve_checkpoint(path_or_id, revision)
    overrides = {k: v for k, v in dict(dtype=dtype, param_dtype=param_dtype, remat=remat, attention=attention,
                                       scan_unroll=scan_unroll).items() if v is not None}
    cfg = read_config(ckpt, **overrides)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    if mesh is None:
        device_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device_sharding, abstract_state)
    else:
        shardings = param_shardings(abstract_state, mesh, rules)
    files, where = _tensor_files(ckpt)
    _check_unexpected(files, abstract_state, cfg, where, strict)

    with contextlib.ExitStack() as stack:
        reader = _TensorReader(files, where, cfg.num_hidden_layers, stack)
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        loaded = jax.tree_util.tree_map_with_path(reader.load_param, abstract_state, shardings, is_leaf=is_var)

    if cfg.tie_word_embeddings and "lm_head.weight" in files:
        warnings.warn(f"{where}: config has tie_word_embeddings=true; ignoring the stored lm_head.weight "
                      f"(HF ties it to model.embed_tokens.weight too)")
    return cfg, nnx.merge(graphdef, loaded)


class _TensorReader:
    """Places each parameter from the HF tensors it is made of: ``files`` maps a tensor name to its safetensors
    file (each opened once, memory-mapped, and closed with ``stack``); ``where`` names the checkpoint in errors."""

    def __init__(self, files: dict[str, Path], where: str, num_layers: int, stack: contextlib.ExitStack):
        self.files, self.where, self.num_layers, self.stack = files, where, num_layers, stack
        self.handles: dict[Path, object] = {}

    def handle(self, fn: Path):
        """The open safetensors file ``fn``."""
        if fn not in self.handles:
            self.handles[fn] = self.stack.enter_context(safe_open(fn, framework="numpy"))
        return self.handles[fn]

    def sources(self, entry: _Entry, shape: tuple[int, ...]) -> list[tuple[object, str]]:
        """``(file handle, tensor name)`` of each HF tensor of ``entry`` (one per layer when stacked), each checked
        to exist with the shape ``shape`` implies; raises CheckpointError naming the tensor and file."""
        want, files = entry.hf_shape(shape), self.files
        out = []
        for name in entry.hf_names(self.num_layers):
            if name not in files:
                raise CheckpointError(f"{self.where}: tensor {name!r} is missing (expected shape {list(want)}"
                                      f"{', untied lm_head' if name == 'lm_head.weight' else ''})")
            h = self.handle(files[name])
            try:
                got = tuple(h.get_slice(name).get_shape())
            except Exception as e:  # listed in an index but absent from the shard
                raise CheckpointError(f"{files[name]}: tensor {name!r} (expected shape {list(want)}) "
                                      f"cannot be read: {e}") from e
            if got != want:
                raise CheckpointError(f"{files[name]}: tensor {name!r} has shape {list(got)}, "
                                      f"expected {list(want)}")
            out.append((h, name))
        return out

    def load_param(self, path, var, sharding):
        """``var`` (an abstract ``nnx.Param``) with its value: a device receives only its slice, read lazily and
        cast on the host (``jax.make_array_from_callback``)."""
        if not isinstance(var, nnx.Param):
            raise CheckpointError(f"model variable {param_path(path)!r} ({type(var).__name__}) is not a "
                                  f"parameter; models/hf.py only loads nnx.Param")
        shape, np_dtype = tuple(var.get_value().shape), np.dtype(var.get_value().dtype)
        entry = _entry(param_path(path))
        sources = self.sources(entry, shape)

        def read(h, name, idx):
            sl = h.get_slice(name)
            a = sl[tuple(reversed(idx))].T if entry.transpose else sl[tuple(idx)]
            return np.asarray(a, dtype=np_dtype)

        def callback(index):
            index = tuple(index) + (slice(None),) * (len(shape) - len(index))
            if not entry.stacked:
                return read(*sources[0], index)
            layers = range(shape[0])[index[0]]
            return np.stack([read(*sources[i], index[1:]) for i in layers])

        arr = jax.make_array_from_callback(shape, sharding.get_value() if isinstance(sharding, nnx.Variable)
                                           else sharding, callback, dtype=np_dtype)
        return var.replace(arr)

def _check_unexpected(files: dict[str, Path], abstract_state, cfg: Qwen3Config, where: str, strict: bool) -> None:
    """Raise (``strict``) or warn about HF tensors that no parameter of ``abstract_state`` reads."""
    expected = set()
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    for path, var in jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=is_var)[0]:
        if isinstance(var, nnx.Param):  # other variables are rejected by the loader with their own message
            expected.update(_entry(param_path(path)).hf_names(cfg.num_hidden_layers))
    if cfg.tie_word_embeddings:
        expected.add("lm_head.weight")  # HF ties it too; warned about after loading
    unexpected = sorted(set(files) - expected)
    if not unexpected:
        return
    shown = ", ".join(f"{n!r} ({files[n].name})" for n in unexpected[:10])
    more = f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""
    msg = (f"{where}: {len(unexpected)} tensor(s) that the Qwen3 model (num_hidden_layers="
           f"{cfg.num_hidden_layers}, tie_word_embeddings={cfg.tie_word_embeddings}) does not have: {shown}{more}")
    if strict:
        raise CheckpointError(msg + "; pass strict=False to ignore them")
    warnings.warn(msg + "; ignored (strict=False)")


# ----------------------------------------------------------------------------------------------- export
def _param_state(model_or_state):
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    return model_or_state


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def iter_hf_tensors(model_or_state, config: Qwen3Config, dtype: Optional[str] = None
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, host array)`` in HF order, one layer slice at a time (host memory: one tensor).

    Args:
      model_or_state: a ``Qwen3`` or its ``nnx.State`` (Param variables; sharded arrays are gathered).
      config: the model's ``Qwen3Config`` (decides whether ``lm_head`` is expected).
      dtype: output dtype (``"float32"``, ``"bfloat16"``, ...); default: each parameter's own dtype.
    Yields:
      HF tensor name and a C-contiguous numpy array in HF's ``[out, in]`` layout.
    Raises:
      CheckpointError: a parameter with no HF name, or ``lm_head`` present/absent against the config.

    Source: HF transformers ``Qwen3ForCausalLM`` state-dict names and ``[out, in]`` weight layout (as
    ``save_pretrained`` writes them).
    """
    state = _param_state(model_or_state)
    flat = {param_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    if config.tie_word_embeddings and "lm_head.kernel" in flat:
        raise CheckpointError("config.tie_word_embeddings=true but the state has lm_head.kernel")
    if not config.tie_word_embeddings and "lm_head.kernel" not in flat:
        raise CheckpointError("config.tie_word_embeddings=false but the state has no lm_head.kernel")
    entries = {name: _entry(name) for name in flat}
    out_dtype = None if dtype is None else np.dtype(jax.numpy.dtype(dtype))

    def emit(entry: _Entry, x):
        a = _to_host(x)
        if entry.transpose:
            a = a.T
        if out_dtype is not None:
            a = a.astype(out_dtype)
        return np.ascontiguousarray(a)

    order = ["embed_tokens.embedding"]
    for name in order:
        yield entries[name].template, emit(entries[name], flat[name])
    layer_names = sorted(n for n in flat if entries[n].stacked)
    for i in range(config.num_hidden_layers):
        for name in layer_names:
            yield entries[name].template.format(i), emit(entries[name], flat[name][i])
    for name in ("norm.weight", "lm_head.kernel"):
        if name in flat:
            yield entries[name].template, emit(entries[name], flat[name])
    unknown = set(flat) - set(order) - set(layer_names) - {"norm.weight", "lm_head.kernel"}
    if unknown:
        raise CheckpointError(f"parameters {sorted(unknown)} were not exported")


def save_hf_checkpoint(model_or_state, config: Qwen3Config, out_dir: Union[str, os.PathLike], *,
                       max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, dtype: Optional[str] = None) -> list[Path]:
    """Write ``config.json`` and safetensors that ``transformers.Qwen3ForCausalLM.from_pretrained`` loads.

    Shards are filled in HF order and a new one is started when the next tensor would exceed
    ``max_shard_size`` bytes (transformers' rule); more than one shard gets ``model-0000i-of-0000N.safetensors``
    and ``model.safetensors.index.json`` (``metadata.total_size`` in bytes, ``weight_map``), one shard is
    ``model.safetensors``. Files carry ``{"format": "pt"}`` metadata as transformers expects.

    Args:
      model_or_state: a ``Qwen3`` or its Param ``nnx.State`` (may be sharded; gathered layer by layer).
      config: its ``Qwen3Config``; written via ``config.to_hf_dict()`` with ``torch_dtype`` = the saved dtype.
      out_dir: created if absent; must not already contain ``*.safetensors``.
      max_shard_size: bytes per shard (default 5e9).
      dtype: dtype to save (default: the parameters' dtype, e.g. ``"bfloat16"`` for a bf16 release).
    Returns:
      The written files (safetensors, index if any, config.json).
    Raises:
      CheckpointError: ``out_dir`` already holds safetensors, ``max_shard_size`` < 1, or a state/config
        mismatch (see :func:`iter_hf_tensors`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")) or (out / INDEX_NAME).exists():
        raise CheckpointError(f"{out}: already holds safetensors files; refusing to mix checkpoints")
    if max_shard_size < 1:
        raise CheckpointError(f"max_shard_size={max_shard_size} must be a positive number of bytes")

    shards: list[list[str]] = []
    tmp_files: list[Path] = []
    current: dict[str, np.ndarray] = {}
    size = total = 0
    saved_dtype = None

    def flush():
        nonlocal current, size
        if current:
            tmp = out / f".tmp-{len(tmp_files):05d}.safetensors"
            save_file(current, str(tmp), metadata={"format": "pt"})
            tmp_files.append(tmp)
            shards.append(list(current))
        current, size = {}, 0

    for name, arr in iter_hf_tensors(model_or_state, config, dtype):
        saved_dtype = saved_dtype or arr.dtype
        if current and size + arr.nbytes > max_shard_size:
            flush()
        current[name] = arr
        size += arr.nbytes
        total += arr.nbytes
    flush()

    written: list[Path] = []
    n = len(tmp_files)
    if n == 1:
        final = out / SINGLE_NAME
        tmp_files[0].replace(final)
        written.append(final)
    else:
        weight_map = {}
        for i, (tmp, names) in enumerate(zip(tmp_files, shards)):
            final = out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tmp.replace(final)
            written.append(final)
            weight_map.update({k: final.name for k in names})
        index = out / INDEX_NAME
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append(index)
    d = config.to_hf_dict()
    d["torch_dtype"] = str(np.dtype(saved_dtype)) if saved_dtype is not None else config.param_dtype
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    written.append(out / "config.json")
    return written


__all__ = ["resolve_checkpoint", "read_config", "load_hf_checkpoint", "iter_hf_tensors",
           "save_hf_checkpoint", "INDEX_NAME", "DEFAULT_MAX_SHARD_SIZE"]
