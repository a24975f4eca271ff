"""JetStream 0.2.2 ``Engine`` over the Flax NNX Qwen3 (models/qwen3.py): slot-based KV cache, sampling with
temperature / top-k / top-p, and each sampled token's full-vocabulary temperature-scaled log-prob.

Layout (conventions.md §7). The decode state holds one KV-cache row per *slot* (``max_concurrent_decodes``
rows, ``samples_per_slot`` = 1). A request's life:

* ``prefill`` runs the prompt **minus its last token** through the model into a batch-1 cache and keeps the
  last prompt token as the slot's ``next_token`` (:meth:`Qwen3Engine.prefill_batch`, the driver's path, does
  the same for up to ``prefill_batch_size`` prompts of one padding bucket in one call, one cache row each).
  (JetStream 0.2.2's ``prefill`` returns no token, so the first response token is sampled by the first
  ``generate`` step, which feeds that last prompt token. Every ``generate`` step therefore returns a freshly
  sampled token with its log-prob, uniformly for all slots.)
* ``insert`` copies the prefix (one row of it) into one slot. Group sampling = one prefill, G ``insert`` calls.
* ``generate`` feeds every slot's ``next_token``, samples the next one with ``sampling.sample_tokens`` and
  returns ``ResultTokens`` (tokens ``(0,1)``, valid ``(1,2)``, length ``(2,3)``, as the mock engine) plus, in
  :meth:`Qwen3Engine.step`, a :class:`StepOutput` pytree carrying the log-probs beside ``ResultTokens``
  (0.2.2 has no log-prob field). A slot stops after an EOS id or when it has generated its limit; the stop
  token itself is returned as valid, the following steps return ``valid = 0``. That is how JetStream's
  detokenizer learns the request is complete, so the tokenizer's ``stop_tokens`` is empty and clients
  receive the EOS token (the trainer needs it: it is part of the response and of the loss).

Randomness: the key of the n-th token of sample ``sid`` is ``fold_in(fold_in(key(seed), sid), n)``, so a
sample's tokens do not depend on which slot it lands in, on the other slots, or on the mesh.

JetStream quirks handled here: its token-content path prepends ``bos_id`` to every new request; Qwen3 has no
BOS, so the tokenizer reports ``bos_id = NO_BOS_ID = -1`` and prefill masks negative ids out. Any exception
in an orchestrator thread SIGKILLs the server, so ``prefill`` never raises on bad requests: it returns a
prefix marked invalid (too long, empty, or ids outside the vocabulary), whose slot finishes at once with zero
tokens. The in-process driver validates its inputs and raises clear errors before calling the engine.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stapo_jax.rollout import compat

compat.install()

from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2  # noqa: E402

from models.decode import (  # noqa: E402
    LAYERS_KEY,
    DecodeParams,
    copy_layer_into,
    decode_layer_dtype,
    split_layers,
    unstack_layers,
)
from models.qwen3 import Qwen3  # noqa: E402
from models.qwen3_config import Qwen3Config  # noqa: E402
from models.sharding import make_mesh, param_path, param_shardings  # noqa: E402
from stapo_jax.rollout.decode_fns import (  # noqa: E402,F401  (the pytrees are part of this module's API)
    DecodeSpec,
    DecodeState,
    Prefix,
    StepOutput,
    decode_param_shardings,
    decode_state_shardings,
    init_fn,
    insert_fn,
    kv_length_buckets,
    prefill_fn,
    resize_along,
    resolve_kernel_layout,
    step_fn,
)
from stapo_jax.rollout.jetstream_tokenizer import NO_BOS_ID, HFTokenizer, load_tokenizer  # noqa: E402,F401
from stapo_jax.rollout.engine_settings import CACHE_DTYPES, EngineConfig, EngineConfigError  # noqa: E402,F401
from stapo_jax.rollout.sampling import SamplingParams  # noqa: E402
from stapo_jax.rollout.dispatch import DispatchWindow  # noqa: E402
from stapo_jax.data.tokenizer import QWEN3_STOP_IDS  # noqa: E402

log = logging.getLogger(__name__)

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # JetStream pad_tokens


class ParamsMismatchError(ValueError):
    """New parameters whose tree structure, shapes or dtypes differ from the engine's (weight sync)."""


def engine_stop_ids(model_config: Qwen3Config, config: EngineConfig) -> tuple[int, ...]:
    """The stop ids an engine uses: ``config.eos_token_ids``, or the model config's EOS ids plus Qwen3's
    (``stapo_jax.data.tokenizer.QWEN3_STOP_IDS``) that lie inside its vocabulary, sorted.

    Returns a tuple of int token ids; never raises. Source: HF transformers ``generation_config``
    ``eos_token_id`` plus Qwen3's ``<|im_end|>`` / ``<|endoftext|>`` ids.
    """
    if config.eos_token_ids is not None:
        return tuple(config.eos_token_ids)
    vocab = model_config.vocab_size
    return tuple(sorted({*model_config.eos_token_ids, *(i for i in QWEN3_STOP_IDS if i < vocab)}))


class Qwen3Engine(engine_api.Engine):
    """JetStream ``Engine`` for the Flax Qwen3; see the module docstring for the slot/step layout.

    Args:
      model: a :class:`models.qwen3.Qwen3` (its parameters are copied onto ``mesh``).
      config: :class:`EngineConfig`.
      mesh: a ``(data, fsdp, tensor)`` mesh (:func:`models.sharding.make_mesh`); default: the first device.
        Parameters follow ``models.sharding.param_shardings``; the slot axis of the decode state is sharded
        over ``data``/``fsdp`` and KV heads over ``tensor`` where the sizes divide.
      tokenizer: a transformers tokenizer, a local tokenizer directory, or None (token ids only).
    Raises:
      EngineConfigError: invalid ``config`` or a cache longer than the model's position range.
    """

    def __init__(self, model: Qwen3, config: EngineConfig, *, mesh=None, tokenizer: Any = None):
        if not isinstance(config, EngineConfig):
            raise EngineConfigError(f"config must be an EngineConfig, got {type(config)}")
        self.config = config
        self.model_config: Qwen3Config = model.config
        if config.cache_length > self.model_config.max_position_embeddings:
            raise EngineConfigError(
                f"max_prefill_length + max_decode_length = {config.cache_length} exceeds the model's "
                f"max_position_embeddings = {self.model_config.max_position_embeddings}")
        self._mesh = mesh if mesh is not None else make_mesh(1, 1, 1, devices=jax.devices()[:1])
        self._tokenizer_path = tokenizer if isinstance(tokenizer, str) else ""
        self._hf_tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        eos = engine_stop_ids(self.model_config, config)
        self.eos_token_ids: tuple[int, ...] = eos
        self._graphdef, state = nnx.split(model)
        self._param_shardings = param_shardings(state, self._mesh)
        self._param_ref = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        self.kernel_layout: str = resolve_kernel_layout(config.kernel_layout, self._mesh)
        buckets = kv_length_buckets(config.cache_length)
        self._kv_lengths = buckets if config.kv_cache_buckets else buckets[-1:]
        layer_shardings = decode_param_shardings(self._param_shardings, self.model_config.num_hidden_layers,
                                                 self.kernel_layout).layers
        # the layers in the dtype the forward pass reads them in (bf16 of f32 master weights: half the memory,
        # bitwise the same tokens and log-probs; models.decode.decode_layer_dtype)
        self.layer_dtype = decode_layer_dtype(self.model_config)
        self._unstack = jax.jit(functools.partial(unstack_layers, kernel_layout=self.kernel_layout,
                                                  layer_dtype=self.layer_dtype),
                                in_shardings=(self._param_shardings[LAYERS_KEY],), out_shardings=layer_shardings)
        # set_params: the same copy, layer by layer into the engine's previous per-layer buffers (donated)
        replicated = NamedSharding(self._mesh, P())
        self._copy_layer = jax.jit(functools.partial(copy_layer_into, kernel_layout=self.kernel_layout),
                                   donate_argnums=2, out_shardings=layer_shardings[0],
                                   in_shardings=(self._param_shardings[LAYERS_KEY], replicated, layer_shardings[0]))
        self._layer_index = [jax.device_put(np.int32(i), replicated) for i in range(len(layer_shardings))]
        self._params = self.place_params(state)
        self._spec = DecodeSpec(self._graphdef, self.model_config, config, eos, self._decode_state_shardings(),
                                self.kernel_layout)
        # JetStream's orchestrator calls prefill (its prefill thread) and insert / generate (its generate thread)
        # in loops that never wait for the device: each loop's programs are bounded (stapo_jax.rollout.dispatch)
        self.prefill_window, self.generate_window = DispatchWindow(), DispatchWindow()

    # ------------------------------------------------------------------ shardings
    def _decode_state_shardings(self) -> DecodeState:
        return decode_state_shardings(self._mesh, self.model_config, self.config)

    @property
    def decode_spec(self) -> DecodeSpec:
        """The static spec of this engine's jitted functions (``decode_fns.step_fn.lower(engine.decode_spec,
        ...)`` lowers exactly what :meth:`step` runs)."""
        return self._spec

    # ------------------------------------------------------------------ helpers used by the driver
    def prefill_bucket(self, n: int) -> int:
        """Padded prefill length for a prompt of ``n`` tokens: the smallest power of two >= max(n, 16),
        capped at ``max_prefill_length`` (bounded number of compiled prefill shapes)."""
        b = 16
        while b < n:
            b *= 2
        return min(b, self.config.max_prefill_length) if n <= self.config.max_prefill_length else n

    def prefill_rows(self, bucket: int) -> int:
        """Rows of a :meth:`prefill_batch` call for prompts of prefill bucket ``bucket`` (int tokens):
        ``prefill_batch_size``, fewer where ``rows * bucket`` would pass ``prefill_batch_tokens`` (at least 1), so
        the batch's activations and prefix caches stay those of about ``prefill_batch_tokens`` prompt tokens.
        A function of the bucket alone, so a prompt's row never depends on its neighbours. Never raises."""
        return max(1, min(self.config.prefill_batch_size, self.config.prefill_batch_tokens // bucket))

    def prefill_batch(self, params, prompts: Sequence[Sequence[int]]) -> Prefix:
        """Prefill 1..``prefill_rows(bucket)`` unpadded prompts of one prefill bucket (validated by the caller)
        in one call.

        Args:
          params: engine parameters.
          prompts: 1-D int sequences, each 1..``max_prefill_length`` tokens, all with the same
            :meth:`prefill_bucket`.
        Returns:
          :class:`Prefix` of exactly ``k = prefill_rows(bucket)`` rows (cache [k, Nkv, bucket, H]); row ``r`` is
          ``prompts[r]``, the rows after ``len(prompts)`` are dummies (``valid`` False). Every call has the same
          shape per bucket (one compiled program each), and a prompt's row does not depend on the other rows or
          on its position (tests/rollout/test_batched_prefill.py).
        Raises:
          ValueError: no prompts, more than ``prefill_rows(bucket)``, or prompts of different buckets.
        Source: HF ``generate`` (all prompts prefilled in one forward), with JetStream's fixed padding buckets.
        """
        lens = [len(p) for p in prompts]
        buckets = {self.prefill_bucket(n) for n in lens}
        if len(buckets) > 1:
            raise ValueError(f"prefill_batch prompts must share one prefill bucket, got buckets {sorted(buckets)}")
        bucket = buckets.pop() if buckets else 16  # no prompts: reported below against the smallest bucket
        k = self.prefill_rows(bucket)
        if not 1 <= len(lens) <= k:
            raise ValueError(f"prefill_batch takes 1..{k} prompts of bucket {bucket} (EngineConfig."
                             f"prefill_batch_size, prefill_batch_tokens), got {len(lens)}")
        padded = np.zeros((k, bucket), np.int32)
        true_length = np.ones((k,), np.int32)  # dummy rows: one token 0, ok False
        ok = np.zeros((k,), np.bool_)
        for r, p in enumerate(prompts):
            padded[r, : lens[r]] = np.asarray(p, np.int32)
            true_length[r], ok[r] = lens[r], True
        with jax.set_mesh(self._mesh):
            return prefill_fn(self._spec, params, padded, true_length, ok)

    def prefill_tokens(self, params, prompt: Sequence[int]) -> Prefix:
        """Prefill one unpadded prompt (validated by the caller): :meth:`prefill_batch` of ``[prompt]``; its
        prefix is row 0. ``prompt`` is a 1-D int sequence with 1 <= len <= ``max_prefill_length``. Raises
        nothing for such a prompt. Source: :meth:`prefill_batch`."""
        return self.prefill_batch(params, [prompt])

    @property
    def kv_length_buckets(self) -> tuple[int, ...]:
        """The decode state's possible KV-cache lengths (:func:`~stapo_jax.rollout.decode_fns.kv_length_buckets`
        of ``config.cache_length``; only the largest when ``config.kv_cache_buckets`` is False), ints ascending."""
        return self._kv_lengths

    def kv_bucket(self, n: int) -> int:
        """The smallest of :attr:`kv_length_buckets` >= ``n`` (int cache positions).

        Raises ValueError when ``n`` exceeds the largest (a bug in the caller: slots never outgrow
        ``config.cache_length``)."""
        for b in self.kv_length_buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} cache positions exceed the engine's cache ({self.kv_length_buckets[-1]})")

    def check_kv_length(self, length) -> int:
        """``length`` as an int if it is one of :attr:`kv_length_buckets`; ValueError naming the allowed lengths
        otherwise (floats and bools included). Source: this engine's bucket rule."""
        is_int = isinstance(length, (int, np.integer)) and not isinstance(length, bool)
        if not is_int or length not in self.kv_length_buckets:
            raise ValueError(f"length {length!r} is not one of the engine's KV-cache lengths {self.kv_length_buckets}")
        return int(length)

    def resize_decode_state(self, decode_state: DecodeState, length: int) -> DecodeState:
        """``decode_state`` with every layer's K/V (and the key mask) cut or zero-padded to ``length`` positions.

        Slots whose filled positions all lie below ``length`` decode as before (to float rounding: see
        ``EngineConfig.kv_cache_buckets``); the caller guarantees that. Layer by layer, each old buffer
        deleted once copied, so at most one layer is held twice: ``decode_state`` is consumed (as a donated
        argument). Shapes: ``[B, Nkv, S, H]`` -> ``[B, Nkv, length, H]``, ``key_mask`` ``[B, S]`` ->
        ``[B, length]``; dtypes and shardings kept. Raises ValueError for a ``length`` not in
        :attr:`kv_length_buckets` or a ``decode_state`` already consumed. Source: bucketed decode shapes as
        JetStream's prefill padding buckets.
        """
        length = self.check_kv_length(length)
        cache = decode_state.cache
        if cache.k[0].is_deleted():
            raise ValueError("decode_state was consumed (donated to a step/insert or resized); pass the state that "
                             "call returned")
        if cache.max_length == length:
            return decode_state
        sh = self._spec.state_shardings.cache

        def resized(x, sharding, axis):
            y = self._resize(x, sharding, axis, length)
            x.delete()
            return y

        k = tuple(resized(x, s, 2) for x, s in zip(cache.k, sh.k))
        v = tuple(resized(x, s, 2) for x, s in zip(cache.v, sh.v))
        mask = resized(cache.key_mask, sh.key_mask, 1)
        return decode_state.replace(cache=cache.replace(k=k, v=v, key_mask=mask))

    @staticmethod
    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def _resize(x, sharding, axis, length):
        return jax.lax.with_sharding_constraint(resize_along(x, axis, length), sharding)

    def insert_sample(self, prefix: Prefix, decode_state: DecodeState, slot: int, sample_id: int,
                      max_new_tokens: int, row: int = 0) -> DecodeState:
        """:meth:`insert` of row ``row`` of ``prefix`` with an explicit random-stream id (>= 0) and new-token
        limit (the driver's insert). Ints; ``decode_state`` is donated. The state must hold the prefix's padded
        length (ValueError otherwise) and, before each later step, every position the slot writes (the caller
        grows it with :meth:`resize_decode_state`, as the driver does; a full-length state always does);
        ``slot`` in [0, B) and ``row`` in [0, k) are the caller's duty. Source: JetStream ``Engine.insert``."""
        self._check_fits(prefix, decode_state)
        with jax.set_mesh(self._mesh):
            return insert_fn(self._spec, prefix, decode_state, np.int32(slot), np.int32(sample_id),
                             np.int32(max_new_tokens), np.int32(row))

    def _check_fits(self, prefix: Prefix, decode_state: DecodeState, positions: int = 0) -> None:
        """ValueError unless the state's cache holds the prefix's padded length and ``positions``."""
        need, have = max(prefix.cache.max_length, positions), decode_state.cache.max_length
        if need > have:
            raise ValueError(f"decode_state's KV cache holds {have} positions, the insert needs {need} (prefix of "
                             f"{prefix.cache.max_length}); grow it with resize_decode_state(state, "
                             f"{self.kv_bucket(need)})")

    def step(self, params, decode_state: DecodeState,
             sampling: Optional[SamplingParams] = None) -> tuple[DecodeState, StepOutput]:
        """One decode step for all slots, returning the log-probs beside ``ResultTokens``.

        Args:
          params: from :meth:`load_params` / :meth:`place_params`.
          decode_state: from :meth:`init_decode_state` (donated: do not reuse the argument).
          sampling: overrides ``config.sampling`` (a new value compiles once per distinct setting).
        Returns:
          ``(new_state, StepOutput)``.
        """
        with jax.set_mesh(self._mesh):
            return step_fn(self._spec, params, decode_state, sampling or self.config.sampling, 1)

    def multi_step(self, params, decode_state: DecodeState, num_steps: int,
                   sampling: Optional[SamplingParams] = None) -> tuple[DecodeState, StepOutput]:
        """``num_steps`` (static, >= 1) decode steps in one jitted call (``lax.scan``), one host round trip.

        Returns:
          ``(new_state, StepOutput)`` whose leaves have a leading ``[num_steps]`` axis when ``num_steps`` > 1
          (``result.data`` [num_steps, B, 3], ``log_probs`` / ``done`` [num_steps, B]). A slot that finishes
          inside the chunk returns ``valid = 0`` for the rest of it. Tokens equal ``num_steps`` calls of
          :meth:`step` (the random keys depend on the token index, not on the call).
        Raises:
          ValueError: ``num_steps`` < 1.
        """
        if int(num_steps) < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        with jax.set_mesh(self._mesh):
            return step_fn(self._spec, params, decode_state, sampling or self.config.sampling, int(num_steps))

    def place_params(self, params) -> DecodeParams:
        """Check ``params`` against the engine's model and lay them out for decoding on the engine's mesh.

        The stacked layers are split into one state per layer (:func:`models.decode.split_layers`; the layer
        weights are copied once, into fresh buffers, by a jitted function with the engine's shardings): decode
        steps then read each layer's weights in place. The engine's current parameters are left alone; the
        weight sync of a running engine is :meth:`set_params`, which reuses their buffers.

        Args:
          params: ``nnx.State`` in the model's stacked layout (``nnx.split(model)[1]``, e.g. the trainer's
            state after an update), device-resident or host (numpy) arrays.
        Returns:
          :class:`~models.decode.DecodeParams`; pass it to ``step``/``generate`` (jitted steps are reused,
          not recompiled).
        Raises:
          ParamsMismatchError: different structure, or a leaf with another shape or dtype (named).
        """
        return jax.block_until_ready(split_layers(self._check_and_put(params), self._unstack, self.kernel_layout))

    def _check_and_put(self, params):
        """``params`` validated against the engine's model (ParamsMismatchError) and put on its shardings."""
        ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(self._param_ref)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if treedef != ref_def:
            paths = {param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
            ref_paths = {param_path(p) for p, _ in ref_leaves}
            if paths == ref_paths:  # same names, other containers
                raise ParamsMismatchError(f"parameter tree differs from the engine's: {treedef} vs {ref_def}")
            missing, extra = sorted(ref_paths - paths), sorted(paths - ref_paths)
            raise ParamsMismatchError(f"parameter tree differs from the engine's: missing {missing[:10]}"
                                      f"{' ...' if len(missing) > 10 else ''}, unexpected {extra[:10]}"
                                      f"{' ...' if len(extra) > 10 else ''}")
        for (path, ref), new in zip(ref_leaves, leaves):
            if tuple(ref.shape) != tuple(np.shape(new)) or ref.dtype != new.dtype:
                raise ParamsMismatchError(
                    f"parameter {param_path(path)}: expected {ref.dtype}{tuple(ref.shape)}, "
                    f"got {new.dtype}{tuple(np.shape(new))}")
        return jax.device_put(params, self._param_shardings)

    def set_params(self, params) -> DecodeParams:
        """The weight sync: validate ``params`` (as :meth:`place_params`), copy their layer weights into the
        engine's current per-layer buffers (donated, so no new allocation and no second copy of the layers:
        bench/bench_weight_sync.py), and make the result what :meth:`load_params` returns.

        The previous :meth:`load_params` result is invalidated (its layer arrays are donated):
        :class:`~stapo_jax.rollout.driver.RolloutDriver` reads :meth:`load_params` afresh for every batch, and
        the JetStream server, which takes :meth:`load_params` once at start, is never synced (its client's
        ``sync_weights`` raises).
        Arguments/raises as :meth:`place_params`; on ParamsMismatchError the current parameters stay valid
        (validation comes before the copy).
        """
        placed = self._check_and_put(params)
        rest = nnx.State({k: v for k, v in placed.items() if k != LAYERS_KEY})
        stacked = placed[LAYERS_KEY]
        layers = tuple(self._copy_layer(stacked, i, old) for i, old in zip(self._layer_index, self._params.layers))
        self._params = jax.block_until_ready(DecodeParams(rest=rest, layers=layers, kernel_layout=self.kernel_layout))
        return self._params

    # ------------------------------------------------------------------ JetStream Engine API
    def load_params(self, *args, **kwargs) -> DecodeParams:
        """The engine's current parameters (:class:`~models.decode.DecodeParams` placed on the mesh)."""
        return self._params

    def prefill(self, *, params, existing_prefix: Optional[Prefix] = None, padded_tokens, true_length: int
                ) -> Prefix:
        """JetStream prefill of one right-padded prompt.

        Args:
          params: engine parameters.
          existing_prefix: unsupported; must be None.
          padded_tokens: [P] int ids (JetStream-padded; a leading ``NO_BOS_ID`` marker is masked out).
          true_length: number of real entries (marker included), an int.
        Returns:
          :class:`Prefix` of one row; ``valid`` [1] is False (never an exception, see the module docstring) when the
          prompt was truncated by JetStream (``true_length > P``), is padded beyond ``max_prefill_length``,
          is empty, or holds ids outside the vocabulary. Every ``DISPATCH_WINDOW``-th call waits for its prefix
          (:attr:`prefill_window`, :mod:`stapo_jax.rollout.dispatch`).
        Raises:
          NotImplementedError: ``existing_prefix`` is given (no prefix caching).
        """
        if existing_prefix is not None:
            raise NotImplementedError("Qwen3Engine.prefill: existing_prefix (prefix caching) is not supported")
        tokens = jnp.asarray(padded_tokens, jnp.int32).reshape(-1)
        n = int(true_length)
        ok = 1 <= n <= tokens.shape[0] <= self.config.max_prefill_length
        tokens = tokens[: self.config.max_prefill_length]  # a rejected over-long request must still fit a slot
        if not ok:
            log.error("rejecting a request of %d tokens (padded length %d, max_prefill_length %d)",
                      n, tokens.shape[0], self.config.max_prefill_length)
        with jax.set_mesh(self._mesh):
            prefix = prefill_fn(self._spec, params, tokens[None], np.full((1,), min(max(n, 0), tokens.shape[0]),
                                                                          np.int32), np.full((1,), ok))
        return self.prefill_window.count(prefix)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Put ``prefix`` (row 0, the one prompt of :meth:`prefill`) into ``slot`` (donates ``decode_state``),
        with limit ``max_decode_length`` and the state's next random-stream id; waits for the state after every
        ``DISPATCH_WINDOW`` programs of JetStream's generate loop (:attr:`generate_window`). Raises ValueError for
        a state shorter than ``cache_length`` (the row could outgrow it: make it with ``init_decode_state()``)."""
        self._check_fits(prefix, decode_state, self.config.cache_length)
        with jax.set_mesh(self._mesh):
            state = insert_fn(self._spec, prefix, decode_state, np.int32(slot), np.int32(-1),
                              np.int32(self.config.max_decode_length), np.int32(0))
        return self.generate_window.count(state)

    def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, engine_api.ResultTokens]:
        """One step for every slot (JetStream API); :meth:`step` also returns the log-probs. With :meth:`insert`,
        waits for the decode state after every ``DISPATCH_WINDOW`` programs (:attr:`generate_window`)."""
        state, out = self.step(params, decode_state)
        return self.generate_window.count(state), out.result

    def init_decode_state(self, seed: Optional[int] = None, *args, length: Optional[int] = None,
                          **kwargs) -> DecodeState:
        """All slots free; base key ``jax.random.key(seed)`` (default ``config.seed``); a KV cache of ``length``
        positions (one of :attr:`kv_length_buckets`; default the largest, which the JetStream API path needs: a
        shorter state is for :class:`~stapo_jax.rollout.driver.RolloutDriver`, which grows it with
        :meth:`resize_decode_state` before any slot outgrows it). Raises ValueError for another length."""
        length = self.kv_length_buckets[-1] if length is None else self.check_kv_length(length)
        rng = jax.random.key(self.config.seed if seed is None else int(seed))
        with jax.set_mesh(self._mesh):
            return init_fn(self._spec, rng, length)

    def get_prefix_destination_sharding(self) -> Any:
        """Replicated on the engine mesh (prefixes are small: one to ``prefill_batch_size`` prompts)."""
        return NamedSharding(self._mesh, P())

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        """Tokenizer path ("" = token ids only)."""
        return tokenizer_pb2.TokenizerParameters(path=self._tokenizer_path, extra_ids=0)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> tokenizer_api.Tokenizer:
        """:class:`HFTokenizer` (overrides JetStream's SentencePiece default)."""
        tok = self._hf_tokenizer
        if tok is None and metadata.path:
            tok = load_tokenizer(metadata.path)
        return HFTokenizer(tok, self.eos_token_ids)

    @property
    def max_concurrent_decodes(self) -> int:
        """Decode slots B (``config.max_concurrent_decodes``; JetStream ``Engine`` property)."""
        return self.config.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        """1: each slot decodes one sample (JetStream ``Engine`` property)."""
        return 1

    @property
    def max_prefill_length(self) -> int:
        """Longest prompt in tokens (``config.max_prefill_length``); longer prefills are marked invalid."""
        return self.config.max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The engine's device mesh (parameters and decode state are sharded over it)."""
        return self._mesh

    @property
    def colocated_cpus(self) -> Union[list, None]:
        """None: no colocated CPU devices are used."""
        return None
