"""Prompt datasets for RL: load, validate, template, tokenize, length-filter, then a sharded, seeded Grain
iterator whose state is checkpointable.

Sources (``data.source``):

* ``jsonl`` / ``parquet``: local files (``data.train_files`` / ``data.val_files``), fields
  ``data.prompt_key`` / ``data.answer_key``;
* ``hf``: each entry is a local dataset directory or a Hugging Face hub dataset id (downloaded with
  ``huggingface_hub`` when the hub is reachable); the split's ``.parquet`` / ``.jsonl`` / ``.arrow`` files
  are read with pyarrow (the ``datasets`` package is not needed);
* ``gym``: a reasoning-gym task (``data.gym``), see :mod:`stapo_jax.rewards.gym`.

Each kept row becomes an *example* dict:

* ``index`` (int): the row's position among all rows read, in file order (a stable id);
* ``problem`` (str), ``answer`` (str), ``data_source`` (str);
* ``prompt`` (str): ``problem + data.prompt_suffix``, wrapped in the tokenizer's chat template as one user
  turn with the generation prompt (``enable_thinking`` passed to the template) when
  ``data.apply_chat_template``;
* ``prompt_ids`` (np.int32 [P], 1 <= P <= ``data.max_prompt_length``): ``prompt`` tokenized without adding
  special tokens (the template already has them);
* ``gold``: what :meth:`stapo_jax.rewards.RewardScorer.score` takes: the answer string, or for ``gym`` the
  reasoning-gym entry dict.

Rows whose prompt or answer field is missing, not a string, or empty (and JSONL lines that are not valid
UTF-8 or not JSON objects) are counted by reason in a :class:`DataReport` and skipped (``data.on_bad_row: skip``) or raise
:class:`DataError` (``error``). Prompts longer than ``data.max_prompt_length`` tokens are dropped and counted,
never truncated.

Iteration (:func:`make_iterator`): ``MapDataset.source(examples).shuffle(seed).repeat(epochs)`` (a new
permutation each epoch), then process ``p`` of ``P`` takes elements ``p, p+P, p+2P, ...`` and batches
``global_batch/P`` of them, so step ``s`` of all processes together covers global positions
``[s*B, (s+1)*B)``, the same prompts as a single-process run. ``iterator.get_state()`` /
``set_state()`` (a JSON-able dict) resume exactly; save it with Orbax (``grain.checkpoint.CheckpointSave``)
next to :attr:`PromptDataset.fingerprint` to detect a changed dataset on resume.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from stapo_jax.config.schema import Config, DataConfig
from stapo_jax.core.errors import ConfigError

log = logging.getLogger(__name__)

_HF_SUFFIXES = (".parquet", ".jsonl", ".arrow")


class DataError(ValueError):
    """A bad data row (with ``data.on_bad_row: error``), an unreadable file, or a dataset that cannot be
    fetched. The message names the file (and line) or dataset id."""


def examples_fingerprint(examples) -> str:
    """sha256 (hex str) over (index, prompt_ids as int32 bytes, answer) of every example dict, in order (no
    arrays: ``prompt_ids`` is a list of int). Never raises for the dicts the loaders here build (a KeyError for
    others). Source: ``hashlib.sha256``."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(str(ex["index"]).encode())
        h.update(np.asarray(ex["prompt_ids"], dtype=np.int32).tobytes())
        h.update(ex["answer"].encode())
    return h.hexdigest()


@dataclasses.dataclass
class DataReport:
    """What loading did to the rows of one split (also logged as one summary line)."""

    split: str
    source: str
    files: list[str]
    n_rows: int = 0
    n_bad: int = 0
    bad_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    n_too_long: int = 0
    n_overlap_dropped: int = 0
    n_kept: int = 0
    max_prompt_tokens: int = 0

    def summary(self) -> str:
        """One line: rows read, bad rows by reason, too-long prompts dropped, kept."""
        bad = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad_reasons.items())) or "none"
        overlap = (f", {self.n_overlap_dropped} dropped as overlapping the train split"
                   if self.n_overlap_dropped else "")
        return (f"data[{self.split}] {self.source} {self.files}: {self.n_rows + self.n_overlap_dropped} rows"
                f"{overlap}, {self.n_bad} bad ({bad}), {self.n_too_long} longer than max_prompt_length dropped, "
                f"{self.n_kept} kept (longest prompt {self.max_prompt_tokens} tokens)")


@dataclasses.dataclass
class PromptDataset:
    """The examples of one split, the loading report, and a content fingerprint."""

    examples: list[dict[str, Any]]
    report: DataReport

    @property
    def fingerprint(self) -> str:
        """:func:`examples_fingerprint` of the examples: equal fingerprints mean a resumed run iterates over the
        same prompts (and that every process of a job read the same ones)."""
        return examples_fingerprint(self.examples)

    def __len__(self) -> int:
        return len(self.examples)


# -------------------------------------------------------------------------------------------- entry


def load_prompt_dataset(cfg: Config | DataConfig, tokenizer: Any, split: str = "train") -> PromptDataset:
    """Load, validate, template, tokenize and length-filter the prompts of ``split``.

    Args:
      cfg: the run config (its ``data`` section is used) or a :class:`~stapo_jax.config.schema.DataConfig`.
      tokenizer: a transformers tokenizer (:func:`stapo_jax.data.tokenizer.load_tokenizer`).
      split: ``"train"`` (``data.train_files`` / ``data.gym.size``) or ``"val"`` (``data.val_files`` /
        ``data.gym.val_size``).

    Returns:
      :class:`PromptDataset`; its report is also logged.

    Raises:
      FileNotFoundError: a listed file does not exist (message names it).
      DataError: a bad row with ``on_bad_row: error``; an unreadable file; a hub dataset that cannot be
        downloaded (offline); no examples left for ``split="train"``.
      ConfigError: ``split`` is not train/val; ``apply_chat_template`` with a tokenizer that has no chat
        template.
    The examples are dicts of str (prompt text, gold) and int32-range token-id lists.
    """
    d = cfg.data if isinstance(cfg, Config) else cfg
    if split not in ("train", "val"):
        raise ConfigError(f"split={split!r}: expected 'train' or 'val'")
    if d.source == "gym":
        rows, report = _gym_rows(d, split)
    else:
        specs = d.train_files if split == "train" else d.val_files
        report = DataReport(split=split, source=d.source, files=[str(s) for s in specs])
        rows = list(_iter_file_rows(specs, d, split))
    examples = _build_examples(rows, tokenizer, d, report)
    report.n_kept = len(examples)
    report.max_prompt_tokens = max((len(ex["prompt_ids"]) for ex in examples), default=0)
    (log.warning if report.n_bad or report.n_too_long else log.info)(report.summary())
    if split == "train" and not examples:
        raise DataError(f"no training prompts left: {report.summary()}")
    return PromptDataset(examples, report)


def format_prompt(problem: str, tokenizer: Any, d: DataConfig) -> str:
    """The prompt text for one problem: ``problem + d.prompt_suffix`` as a single user turn of the chat
    template with the generation prompt (Qwen3: ``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``,
    plus ``<think>\\n\\n</think>\\n\\n`` when ``enable_thinking`` is false), or the bare text without a template.

    Raises:
      ConfigError: ``d.apply_chat_template`` but the tokenizer has no chat template.
    Takes and returns str. Source: Qwen3's chat template (HF ``tokenizer_config.json``); JustRL's prompt
    suffix (stapo_spec.md §10).
    """
    content = problem + d.prompt_suffix
    if not d.apply_chat_template:
        return content
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.apply_chat_template=true but the tokenizer has no chat_template")
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=d.enable_thinking)


def make_iterator(examples: Sequence[dict[str, Any]], global_batch_size: int, *, seed: int, shuffle: bool = True,
                  num_epochs: Optional[int] = None, shard_index: Optional[int] = None,
                  shard_count: Optional[int] = None):
    """A Grain iterator over batches of examples for this process.

    Args:
      examples: :attr:`PromptDataset.examples`.
      global_batch_size: prompts per step over all processes (``trainer.train_batch_size``).
      seed: shuffle seed (``data.seed``); each epoch gets its own permutation.
      shuffle: False keeps file order.
      num_epochs: None repeats forever; otherwise iteration stops after that many passes (a last partial
        batch is dropped).
      shard_index, shard_count: this process's shard; default ``jax.process_index()`` /
        ``jax.process_count()`` (``grain.sharding.ShardByJaxProcess``).

    Returns:
      ``grain.DatasetIterator`` yielding lists of ``global_batch_size // shard_count`` example dicts; it has
      ``get_state()`` / ``set_state(state)``.

    Raises:
      DataError: no examples.
      ValueError: ``global_batch_size`` not divisible by ``shard_count``, or a shard index out of range.
    Takes lists of example dicts of str. Source: Grain ``MapDataset`` / ``ShardByJaxProcess``; verl's
    ``data.shuffle`` / ``data.seed``.
    """
    import grain

    if not examples:
        raise DataError("cannot iterate over an empty prompt dataset")
    if shard_index is None or shard_count is None:
        shard = grain.sharding.ShardByJaxProcess()
        shard_index = shard.shard_index if shard_index is None else shard_index
        shard_count = shard.shard_count if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} out of range for shard_count={shard_count}")
    if global_batch_size < 1 or global_batch_size % shard_count:
        raise ValueError(f"global batch size {global_batch_size} (trainer.train_batch_size) is not divisible by "
                         f"the {shard_count} data-loading processes")
    ds = grain.MapDataset.source(list(examples))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    ds = ds.batch(global_batch_size // shard_count, drop_remainder=True, batch_fn=list)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


# ------------------------------------------------------------------------------------ file reading


def _iter_file_rows(specs: Sequence[str], d: DataConfig, split: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, record)`` for every row of every spec; ``record`` is the parsed object or a
    ``BadRow(reason)`` for an unparseable line."""
    for spec in specs:
        if d.source == "hf":
            paths = resolve_hf_files(spec, d.hf_split if split == "train" else d.hf_val_split)
        else:
            p = Path(spec)
            if not p.is_file():
                raise FileNotFoundError(f"data file not found: {spec} (data.{split}_files, cwd {Path.cwd()})")
            paths = [p]
        for path in paths:
            kind = d.source if d.source != "hf" else path.suffix.lstrip(".")
            yield from read_file(path, kind)


@dataclasses.dataclass(frozen=True)
class BadRow:
    """A row that could not be parsed; ``reason`` is a short tag (``invalid_json``, ``invalid_utf8``)."""

    reason: str


def read_file(path: Path, kind: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, record)`` for each row of one file: ``location`` is ``"<path>:<line>"`` (JSONL) or
    ``"<path>:row<n>"`` (parquet / arrow); ``record`` is the parsed object (dict) or a :class:`BadRow`.

    Args:
      path: the file; kind: ``"jsonl"``, ``"parquet"`` or ``"arrow"``.
    Raises:
      DataError: an unreadable parquet/arrow file or an unsupported ``kind`` (the message names the path).
    Records are dicts of str / numbers. Source: JSONL, Parquet / Arrow (``pyarrow``), the HF
    datasets file formats.
    """
    if kind == "jsonl":
        # bytes, decoded line by line: a bad UTF-8 byte is a bad row of its own line (file:line in the report
        # or error), not a UnicodeDecodeError from the file iterator that names neither
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                where = f"{path}:{line_no}"
                try:
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
                except UnicodeDecodeError:
                    yield where, BadRow("invalid_utf8")
                    continue
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError:
                    yield where, BadRow("invalid_json")
    elif kind in ("parquet", "arrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            if kind == "parquet":
                table = pq.read_table(path)
            else:
                with pa.memory_map(str(path)) as source:
                    try:
                        table = pa.ipc.open_stream(source).read_all()
                    except pa.ArrowInvalid:
                        table = pa.ipc.open_file(source).read_all()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"cannot read {kind} file {path}: {e}") from e
        for row_no, rec in enumerate(table.to_pylist(), 1):
            yield f"{path}:row{row_no}", rec
    else:
        raise DataError(f"{path}: unsupported file type {kind!r} (expected jsonl, parquet or arrow)")


def resolve_hf_files(spec: str, split: str) -> list[Path]:
    """Files of ``split`` in a local dataset directory / file, or in a hub dataset downloaded with
    ``huggingface_hub.snapshot_download`` (HF datasets' file layout: ``<split>.parquet``,
    ``<split>-00000-of-00001.parquet``, ``<split>/...``).

    Returns:
      list of ``Path`` (parquet / arrow / jsonl files), at least one.
    Raises:
      FileNotFoundError: a local path that does not exist; DataError: the hub is unreachable or no file of
      ``split`` exists (the message names the dataset and split).
    Takes str spec and split. Source: HF datasets' repository layout.
    """
    p = Path(spec)
    if p.is_file():
        return [p]
    if not p.is_dir():
        if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
            raise FileNotFoundError(f"HF dataset path not found: {spec} (not a directory, file, or org/name hub id)")
        from huggingface_hub import snapshot_download

        try:
            p = Path(snapshot_download(repo_id=spec, repo_type="dataset",
                                       allow_patterns=[f"*{s}" for s in _HF_SUFFIXES]))
        except Exception as e:  # offline (HF_HUB_OFFLINE), unreachable, or no such dataset
            raise DataError(f"cannot download hub dataset {spec!r} ({type(e).__name__}: {e}); the hub may be "
                            "unreachable from here: download it elsewhere and point data.train_files at the "
                            "local directory or its .parquet/.jsonl files") from e
    files = sorted(f for f in p.rglob("*") if f.suffix in _HF_SUFFIXES and f.is_file())
    for pick in (lambda f: f.stem == split,
                 lambda f: f.stem.startswith(f"{split}-") or f.stem.startswith(f"{split}_"),
                 lambda f: f.parent.name == split,
                 lambda f: split in f.stem):
        chosen = [f for f in files if pick(f)]
        if chosen:
            return chosen
    raise DataError(f"HF dataset {spec!r}: no {'/'.join(_HF_SUFFIXES)} file for split {split!r} under {p} "
                    f"(found {[str(f.relative_to(p)) for f in files][:10]})")


# ------------------------------------------------------------------------------------- examples


def _gym_rows(d: DataConfig, split: str) -> tuple[list[tuple[str, Any]], DataReport]:
    from stapo_jax.rewards.gym import train_val_entries

    g = d.gym
    if not g.task:
        raise ConfigError("data.source=gym needs data.gym.task")
    train, val, n_overlap = train_val_entries(g.task, g.size, g.seed, g.config, g.val_size if split == "val" else 0,
                                              g.val_seed)
    entries = train if split == "train" else val
    report = DataReport(split=split, source="gym", files=[f"reasoning_gym:{g.task}"],
                        n_overlap_dropped=n_overlap if split == "val" else 0)
    rows = [(f"gym:{g.task}:{i}", {"problem": e["question"], "answer": e["answer"], "data_source": f"gym/{g.task}",
                                   "_gym_entry": e}) for i, e in enumerate(entries)]
    return rows, report


def _build_examples(rows: Sequence[tuple[str, Any]], tokenizer: Any, d: DataConfig,
                    report: DataReport) -> list[dict[str, Any]]:
    prompt_key, answer_key = ("problem", "answer") if d.source == "gym" else (d.prompt_key, d.answer_key)
    bad = collections.Counter()
    valid: list[tuple[int, dict]] = []
    for index, (where, rec) in enumerate(rows):
        reason = _row_problem(rec, prompt_key, answer_key)
        if reason is not None:
            if d.on_bad_row == "error":
                raise DataError(f"{where}: bad row ({reason}); set data.on_bad_row=skip to count and skip such rows")
            bad[reason] += 1
            continue
        valid.append((index, rec))
    report.n_rows = len(rows)
    report.n_bad = sum(bad.values())
    report.bad_reasons = dict(bad)
    prompts = [format_prompt(rec[prompt_key], tokenizer, d) for _, rec in valid]
    ids_list = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    examples = []
    for (index, rec), prompt, ids in zip(valid, prompts, ids_list):
        if len(ids) > d.max_prompt_length:
            report.n_too_long += 1
            continue
        answer = rec[answer_key]
        examples.append({
            "index": index, "problem": rec[prompt_key], "answer": answer,
            "data_source": str(rec.get("data_source", d.source)), "prompt": prompt,
            "prompt_ids": np.asarray(ids, dtype=np.int32),
            "gold": rec["_gym_entry"] if "_gym_entry" in rec else answer,
        })
    return examples


def _row_problem(rec: Any, prompt_key: str, answer_key: str) -> Optional[str]:
    """Why a record is unusable (``"missing:<key>"``, ``"not_str:<key>"``, ``"empty:<key>"``,
    ``"not_object"``, ``"invalid_json"``, ``"invalid_utf8"``), or None if it is fine."""
    if isinstance(rec, BadRow):
        return rec.reason
    if not isinstance(rec, dict):
        return "not_object"
    for key in (prompt_key, answer_key):
        if key not in rec or rec[key] is None:
            return f"missing:{key}"
        if not isinstance(rec[key], str):
            return f"not_str:{key}"
        if not rec[key].strip():
            return f"empty:{key}"
    return None
