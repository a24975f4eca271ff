"""In-process rollout loop over :class:`~stapo_jax.rollout.engine.Qwen3Engine` with continuous batching.

``RolloutDriver.generate`` samples ``num_samples`` (G, the group size) responses for each prompt:

* each prompt is prefilled once and its prefix inserted into G slots (group sampling); prompts are prefilled
  in batches (``Qwen3Engine.prefill_rows``: ``EngineConfig.prefill_batch_size``, fewer for long prompts): the
  prompt a free slot needs next together with the following not-yet-prefilled prompts of its prefill bucket.
  A prompt's prefix does not depend on its batch neighbours or row (fixed-shape batches;
  tests/rollout/test_batched_prefill.py);
* all slots decode together with one jitted step per token; after every step the host reads the step's
  tokens, log-probs and flags (three small arrays) and a slot that finished (EOS or its length limit) is
  refilled with the next pending sample **before the next step** (continuous batching; with
  ``steps_per_sync=k`` the host syncs, and refills, every k steps); the refill waits for the device after every
  ``DISPATCH_WINDOW`` dispatched programs (:mod:`stapo_jax.rollout.dispatch`: XLA:CPU deadlocks past 32 in-flight
  multi-device programs with gloo collectives, DESIGN.md "Multi-process runs");
* prefill, insert and step are jitted; parameters are ordinary arguments, so :meth:`RolloutDriver.sync_weights`
  swaps in new weights of the same shapes/shardings without recompiling.

Results are deterministic for a seed and do not depend on the number of slots or devices: sample
``i * G + g`` draws its n-th token with ``fold_in(fold_in(key(seed), row_offset + i * G + g), n)``
(``row_offset`` = 0 unless a process samples a share of a global batch). Bitwise so with
``EngineConfig.kv_cache_buckets=False``; with the default True the KV cache is kept at the smallest length that
holds the active slots (``kv_length_buckets``, resized between steps), which depends on the other slots, and
log-probs then agree to float rounding (about 1e-6 relative) across slot counts and process layouts.

Row order of the returned :class:`RolloutBatch` is prompt-major (row ``i * G + g``), as verl repeats prompts
``interleave=True`` for GRPO groups.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from typing import Optional, Sequence

import jax
import numpy as np

from stapo_jax.rollout.dispatch import DispatchWindow
from stapo_jax.rollout.engine import Qwen3Engine
from stapo_jax.rollout.sampling import SamplingParams
from stapo_jax.runtime.watchdog import progress

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
TRUNCATION_MODES = ("error", "left", "right")


class RolloutInputError(ValueError):
    """Invalid rollout input; the message names the field and, for prompts, the prompt index."""


class PromptTooLongError(RolloutInputError):
    """A prompt longer than the engine's ``max_prefill_length`` with ``prompt_truncation='error'``."""


@dataclasses.dataclass
class RolloutBatch:
    """Sampled responses for a batch of prompts (N = num_prompts * G rows, M = max_new_tokens).

    Attributes:
      prompt_index: [N] int32, the prompt of each row (row ``i * G + g`` belongs to prompt ``i``).
      responses: [N, M] int32 response token ids, right-padded with ``pad_token_id`` after the response;
        the EOS token, when generated, is included.
      response_mask: [N, M] int32, 1 on generated tokens (EOS included), 0 on padding.
      rollout_log_probs: [N, M] float32 sampler log-probs (full vocabulary, temperature-scaled; nats),
        0 on padding; None when the source cannot supply them (the gRPC client: JetStream 0.2.2's protocol
        carries token ids only).
      response_lengths: [N] int32 = ``response_mask.sum(-1)``.
      finish_reasons: N strings, ``"eos"`` (stopped on an EOS id) or ``"length"`` (hit ``max_new_tokens``).
      prompts: the N prompts actually used (after any truncation), as int32 arrays, one per row.
    """

    prompt_index: np.ndarray
    responses: np.ndarray
    response_mask: np.ndarray
    rollout_log_probs: Optional[np.ndarray]
    response_lengths: np.ndarray
    finish_reasons: list
    prompts: list

    @property
    def group_size(self) -> int:
        """G, the number of rows per prompt."""
        n_prompts = int(self.prompt_index.max()) + 1 if len(self.prompt_index) else 0
        return len(self.prompt_index) // n_prompts if n_prompts else 0


def validate_prompts(prompts: Sequence[Sequence[int]], max_prompt_length: int, vocab_size: int,
                     truncation: str = "error") -> list[np.ndarray]:
    """Check (and optionally truncate) prompts before sampling.

    Args:
      prompts: token-id sequences.
      max_prompt_length: the longest allowed prompt.
      vocab_size: ids must lie in ``[0, vocab_size)``.
      truncation: ``"error"`` (default), ``"left"`` (keep the last ``max_prompt_length`` tokens) or
        ``"right"`` (keep the first), as verl's ``data.truncation``.
    Returns:
      The prompts as int32 arrays.
    Raises:
      RolloutInputError: no prompts, an empty prompt, a non-1-D prompt, ids outside the vocabulary, or an
        unknown ``truncation`` (each naming the prompt index); PromptTooLongError: too long with "error".
    """
    if truncation not in TRUNCATION_MODES:
        raise RolloutInputError(f"prompt_truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    if len(prompts) == 0:
        raise RolloutInputError("prompts is empty: need at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1:
            raise RolloutInputError(f"prompt {i} must be a 1-D sequence of token ids, got shape {a.shape}")
        if a.size == 0:
            raise RolloutInputError(f"prompt {i} is empty (0 tokens)")
        if not np.issubdtype(a.dtype, np.integer):
            raise RolloutInputError(f"prompt {i} must hold integer token ids, got dtype {a.dtype}")
        if a.min() < 0 or a.max() >= vocab_size:
            raise RolloutInputError(
                f"prompt {i} holds token ids outside [0, {vocab_size}): min {a.min()}, max {a.max()}")
        if a.size > max_prompt_length:
            if truncation == "error":
                raise PromptTooLongError(
                    f"prompt {i} has {a.size} tokens, more than max_prefill_length={max_prompt_length} "
                    f"(set prompt_truncation='left' or 'right' to truncate)")
            a = a[-max_prompt_length:] if truncation == "left" else a[:max_prompt_length]
        out.append(a.astype(np.int32))
    return out


def check_generation_args(num_samples: int, max_new_tokens: int, limit: int) -> None:
    """Raise RolloutInputError unless ``1 <= num_samples`` and ``1 <= max_new_tokens <= limit``.

    Three ints (bools rejected); returns None. ``RolloutInputError`` is a ValueError naming the
    argument. Source: HF transformers ``generate`` names (``num_return_sequences`` = group size,
    ``max_new_tokens``).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise RolloutInputError(f"num_samples (group size) must be an int >= 1, got {num_samples!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise RolloutInputError(f"max_new_tokens must be an int > 0, got {max_new_tokens!r}")
    if max_new_tokens > limit:
        raise RolloutInputError(f"max_new_tokens={max_new_tokens} exceeds the engine's max_decode_length={limit}")


def assemble_batch(prompts: list[np.ndarray], num_samples: int, max_new_tokens: int, rows: list[list[int]],
                   row_log_probs: Optional[list[list[float]]], eos_token_ids: Sequence[int],
                   pad_token_id: int) -> RolloutBatch:
    """Pack per-row token lists (and log-probs) into a :class:`RolloutBatch` (shared with the gRPC client).

    Args:
      rows: N sequences (lists or 1-D arrays) of generated ids, row ``i * G + g``; each at most
        ``max_new_tokens`` long.
      row_log_probs: N sequences of the same lengths, or None.
    Returns:
      The batch; a row's finish reason is ``"eos"`` iff its last token is in ``eos_token_ids``.

    Shapes / dtypes: ``prompts`` P int32 id arrays; the batch has ``responses`` [N, max_new_tokens] int32
    (``pad_token_id`` after each row), ``response_mask`` [N, max_new_tokens] int32, ``rollout_log_probs``
    [N, max_new_tokens] float32 or None, ``response_lengths`` [N] int32, ``prompt_index`` [N] int32 (N = P * G).
    Raises ValueError (numpy broadcast) when a row is longer than ``max_new_tokens`` or its log-probs differ in
    length. Source: verl's ``DataProto`` rollout layout (``responses``, ``response_mask``, ``rollout_log_probs``).
    """
    n, m = len(rows), max_new_tokens
    responses = np.full((n, m), pad_token_id, np.int32)
    mask = np.zeros((n, m), np.int32)
    lps = None if row_log_probs is None else np.zeros((n, m), np.float32)
    eos = set(int(e) for e in eos_token_ids)
    reasons = []
    for r, toks in enumerate(rows):
        k = len(toks)
        responses[r, :k] = toks
        mask[r, :k] = 1
        if lps is not None:
            lps[r, :k] = row_log_probs[r]
        reasons.append(FINISH_EOS if k and int(toks[-1]) in eos else FINISH_LENGTH)
    prompt_index = np.repeat(np.arange(len(prompts), dtype=np.int32), num_samples)
    return RolloutBatch(prompt_index=prompt_index, responses=responses, response_mask=mask,
                        rollout_log_probs=lps, response_lengths=mask.sum(-1).astype(np.int32),
                        finish_reasons=reasons, prompts=[prompts[i] for i in prompt_index])


class RolloutDriver:
    """Batched sampling over a :class:`Qwen3Engine` (see the module docstring).

    Args:
      engine: the engine (its ``max_concurrent_decodes`` is the number of slots).
      prompt_truncation: ``"error"`` (default), ``"left"`` or ``"right"``, for prompts longer than
        ``engine.max_prefill_length``.
      pad_token_id: fill value of ``responses`` after a row ends; default the tokenizer/config pad
        (151643 for Qwen3). Masks come from lengths, never from this id (conventions §6).
      steps_per_sync: decode steps per jitted call and host round trip (>= 1). 1 (default) refills a
        finished slot before the very next step; k > 1 refills after the current chunk of k steps (a finished
        slot idles at most k - 1 steps) and saves per-step dispatch/transfer overhead, which matters for
        small models. Results do not depend on it.
    Raises:
      RolloutInputError: unknown ``prompt_truncation`` or ``steps_per_sync`` < 1.
    """

    def __init__(self, engine: Qwen3Engine, *, prompt_truncation: str = "error",
                 pad_token_id: Optional[int] = None, steps_per_sync: int = 1):
        if isinstance(steps_per_sync, bool) or not isinstance(steps_per_sync, int) or steps_per_sync < 1:
            raise RolloutInputError(f"steps_per_sync must be an int >= 1, got {steps_per_sync!r}")
        self.steps_per_sync = steps_per_sync
        if prompt_truncation not in TRUNCATION_MODES:
            raise RolloutInputError(f"prompt_truncation must be one of {TRUNCATION_MODES}, got {prompt_truncation!r}")
        self.engine = engine
        self.prompt_truncation = prompt_truncation
        cfg = engine.model_config
        if pad_token_id is None:
            pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (
                engine.eos_token_ids[0] if engine.eos_token_ids else 0)
        self.pad_token_id = int(pad_token_id)

    @property
    def params(self):
        """The parameters rollouts are sampled with (``engine.load_params()``, read afresh: a weight sync
        donates the previous ones)."""
        return self.engine.load_params()

    def sync_weights(self, params) -> float:
        """Swap in new parameters (same tree, shapes, dtypes; placed with the engine's shardings).

        The jitted prefill/insert/step functions are reused: nothing recompiles.

        Args:
          params: ``nnx.State`` like ``nnx.split(model)[1]`` of the trainer's model.
        Returns:
          Seconds spent (validation + device placement, until the arrays are ready).
        Raises:
          ParamsMismatchError: structure, shape or dtype differs (names the parameter).
        """
        t0 = time.perf_counter()
        self.engine.set_params(params)
        return time.perf_counter() - t0

    def generate(self, prompts: Sequence[Sequence[int]], *, num_samples: int = 1,
                 max_new_tokens: Optional[int] = None, seed: int = 0,
                 sampling: Optional[SamplingParams] = None, row_offset: int = 0) -> RolloutBatch:
        """Sample ``num_samples`` responses per prompt.

        Args:
          prompts: P token-id sequences (ragged lengths allowed), each 1..``max_prefill_length`` tokens.
          num_samples: G >= 1, responses per prompt (the GRPO group size).
          max_new_tokens: 1..``engine.config.max_decode_length``; default that maximum.
          seed: base random seed; the result is a deterministic function of (params, prompts, G, seed,
            sampling), independent of slot count and mesh.
          sampling: overrides the engine's :class:`SamplingParams`.
          row_offset: global index of this call's first row (>= 0): row ``r`` draws from the random stream of
            sample ``row_offset + r``, so a process sampling a share of a global batch
            (:mod:`stapo_jax.rollout.multihost`) draws exactly the tokens one process would draw for those rows.
        Returns:
          :class:`RolloutBatch` with N = P * G rows.
        Raises:
          RolloutInputError / PromptTooLongError: see :func:`validate_prompts` and
          :func:`check_generation_args`. RuntimeError: the engine rejected a validated prompt.
        """
        eng = self.engine
        limit = eng.config.max_decode_length
        max_new_tokens = limit if max_new_tokens is None else max_new_tokens
        check_generation_args(num_samples, max_new_tokens, limit)
        _check_row_offset(row_offset, len(prompts), num_samples)
        prompts = validate_prompts(prompts, eng.max_prefill_length, eng.model_config.vocab_size,
                                   self.prompt_truncation)
        run = _SlotLoop(eng, prompts, int(num_samples), max_new_tokens, self.steps_per_sync, row_offset, seed)
        while run.pending or run.n_active:
            run.refill()
            run.record(*run.decode(sampling))
        rows = [run.tokens[r, :n] for r, n in enumerate(run.lengths)]
        row_lps = [run.lps[r, :n] for r, n in enumerate(run.lengths)]
        return assemble_batch(prompts, run.g_size, max_new_tokens, rows, row_lps, eng.eos_token_ids,
                              self.pad_token_id)


def _check_row_offset(row_offset: int, n_prompts: int, num_samples: int) -> None:
    """``row_offset`` is an int >= 0 and the call's sample ids fit int32; else RolloutInputError naming it."""
    if isinstance(row_offset, bool) or not isinstance(row_offset, (int, np.integer)) or row_offset < 0:
        raise RolloutInputError(f"row_offset must be an int >= 0, got {row_offset!r}")
    if row_offset + n_prompts * num_samples > np.iinfo(np.int32).max:
        raise RolloutInputError(f"row_offset={row_offset} + {n_prompts} prompts x num_samples={num_samples} "
                                f"exceeds the int32 sample ids ({np.iinfo(np.int32).max})")


class _SlotLoop:
    """The continuous-batching state of one ``generate`` call: which row each slot decodes, the rows still
    pending, the prompts' prefixes awaiting their G inserts, the decode state and the tokens / log-probs read
    back so far (``[n_rows, max_new_tokens]`` int32 / float32, ``lengths`` ``[n_rows]``)."""

    def __init__(self, eng: Qwen3Engine, prompts: list, g_size: int, max_new_tokens: int, k: int,
                 row_offset: int, seed: int):
        self.eng, self.prompts, self.g_size, self.max_new_tokens, self.k = eng, prompts, g_size, max_new_tokens, k
        self.row_offset = row_offset
        n_rows, n_slots = len(prompts) * g_size, eng.max_concurrent_decodes
        self.tokens = np.zeros((n_rows, max_new_tokens), np.int32)  # filled per step, vectorised over slots
        self.lps = np.zeros((n_rows, max_new_tokens), np.float32)
        self.lengths = np.zeros((n_rows,), np.int64)
        self.pending = deque(range(n_rows))
        self.prefixes: dict[int, tuple] = {}  # prompt -> (batched Prefix, its row), until its G samples are inserted
        self.slot_row = np.full((n_slots,), -1, np.int64)
        self.free = deque(range(n_slots))
        self.params = eng.load_params()
        self.state = eng.init_decode_state(seed, length=eng.kv_length_buckets[0])
        # KV cache sized to the active slots (EngineConfig.kv_cache_buckets): slot s holds prompt_cached[s] +
        # (tokens generated) positions; k more steps need that + k, at most prompt_cached[s] + max_new_tokens
        # (the prefix itself must fit at insert).
        self.prompt_cached = np.zeros((n_slots,), np.int64)
        self.n_active = 0
        self.window = DispatchWindow()  # bounded async dispatch (stapo_jax.rollout.dispatch)

    def _prefill_group(self, i: int, bucket: int) -> int:
        """Prefill prompt ``i`` with the next not-yet-prefilled prompts of its bucket; returns programs dispatched."""
        eng, prompts = self.eng, self.prompts
        group = [i, *itertools.islice((j for j in range(i + 1, len(prompts)) if j not in self.prefixes
                                       and eng.prefill_bucket(len(prompts[j])) == bucket),
                                      eng.prefill_rows(bucket) - 1)]
        batch_prefix = eng.prefill_batch(self.params, [prompts[j] for j in group])
        self.prefixes.update({j: (batch_prefix, r) for r, j in enumerate(group)})
        return 1

    def refill(self) -> None:
        """Insert the next pending sample into every free slot before the next step, waiting for the device after
        every ``DISPATCH_WINDOW`` dispatched programs (prefills, cache resizes, inserts)."""
        eng, k = self.eng, self.k
        self.window.waited()  # the last step's results were read: nothing in flight
        while self.free and self.pending:
            dispatched = 0
            row = self.pending.popleft()
            i, g = divmod(row, self.g_size)
            bucket = eng.prefill_bucket(len(self.prompts[i]))
            if i not in self.prefixes:
                dispatched += self._prefill_group(i, bucket)
            slot = self.free.popleft()
            prefix, prefix_row = self.prefixes[i]
            need = max(bucket, len(self.prompts[i]) - 1 + min(k, self.max_new_tokens))  # the prefix must fit
            if need > self.state.cache.max_length:
                self.state = eng.resize_decode_state(self.state, eng.kv_bucket(need))
                dispatched += 1
            self.state = eng.insert_sample(prefix, self.state, slot, self.row_offset + row, self.max_new_tokens,
                                           prefix_row)
            self.state = self.window.count(self.state, dispatched + 1)  # the state depends on this refill's programs
            if g == self.g_size - 1:
                del self.prefixes[i]
            self.slot_row[slot] = row
            self.prompt_cached[slot] = len(self.prompts[i]) - 1
            self.n_active += 1

    def decode(self, sampling: Optional[SamplingParams]):
        """Resize the KV cache to the active slots' bucket, run k decode steps and read their results back:
        ``(data [k, slots, 2] int32, log_probs [k, slots] float32, done [k, slots] bool)``; marks watchdog
        progress."""
        eng, k, busy = self.eng, self.k, np.nonzero(self.slot_row >= 0)[0]
        target = eng.kv_bucket(int((self.prompt_cached[busy] + np.minimum(self.lengths[self.slot_row[busy]] + k,
                                                                          self.max_new_tokens)).max()))
        if target != self.state.cache.max_length:
            self.state = eng.resize_decode_state(self.state, target)
        if k == 1:
            self.state, out = eng.step(self.params, self.state, sampling)
        else:
            self.state, out = eng.multi_step(self.params, self.state, k, sampling)
        data, log_probs, done = jax.device_get((out.result.data, out.log_probs, out.done))
        progress()  # the stall watchdog (runtime/watchdog.py): a decode step finished
        if k == 1:
            data, log_probs, done = data[None], log_probs[None], done[None]
        return data, log_probs, done

    def record(self, data: np.ndarray, log_probs: np.ndarray, done: np.ndarray) -> None:
        """Append each step's token and log-prob to its slot's row and free the slots whose row finished."""
        for j in range(self.k):
            slots = np.nonzero(self.slot_row >= 0)[0]
            if not slots.size:
                break
            row_ids = self.slot_row[slots]
            valid = data[j, slots, 1].astype(bool)
            if not valid.all():
                row = int(row_ids[~valid][0])
                raise RuntimeError(f"engine rejected prompt {row // self.g_size} (sample {row}); this is a bug")
            pos = self.lengths[row_ids]
            self.tokens[row_ids, pos] = data[j, slots, 0]
            self.lps[row_ids, pos] = log_probs[j, slots]
            self.lengths[row_ids] = pos + 1
            finished = slots[done[j, slots].astype(bool)]
            self.slot_row[finished] = -1
            self.free.extend(finished.tolist())
            self.n_active -= finished.size
