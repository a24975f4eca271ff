"""JetStream 0.2.2 ``Engine`` over the Flax NNX Qwen3 (models/qwen3.py): slot-based KV cache, sampling with
temperature / top-k / top-p, and each sampled token's full-vocabulary temperature-scaled log-prob.

Layout (conventions.md §7). The decode state holds one KV-cache row per *slot* (``max_concurrent_decodes``
rows, ``samples_per_slot`` = 1). A request's life:

* ``prefill`` runs the prompt **minus its last token** through the model into a batch-1 cache and keeps the
  last prompt token as the slot's ``next_token``. (JetStream 0.2.2's ``prefill`` returns no token, so the
  first response token is sampled by the first ``generate`` step, which feeds that last prompt token. Every
  ``generate`` step therefore returns a freshly sampled token with its log-prob, uniformly for all slots.)
* ``insert`` copies the prefix into one slot. Group sampling = one ``prefill``, G ``insert`` calls.
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

import dataclasses
import functools
import logging
import math
from typing import Any, Optional, Sequence, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stapo_jax.rollout import compat

compat.install()

from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

from models import decode as model_decode  # noqa: E402
from models.decode import LAYERS_KEY, DecodeParams, split_layers, unstack_layers  # noqa: E402
from models.qwen3 import KVCache, Qwen3, Qwen3Config, init_cache  # noqa: E402
from models.sharding import make_mesh, param_path, param_shardings  # noqa: E402
from stapo_jax.rollout.sampling import SamplingParams, sample_tokens  # noqa: E402

log = logging.getLogger(__name__)

QWEN3_STOP_IDS = (151643, 151645)  # <|endoftext|> (base EOS, also pad), <|im_end|> (instruct EOS); §6
NO_BOS_ID = -1  # Qwen3 has no BOS; JetStream prepends bos_id to token requests, prefill masks it out.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # JetStream pad_tokens


class EngineConfigError(ValueError):
    """An invalid engine setting (names the field)."""


class ParamsMismatchError(ValueError):
    """New parameters whose tree structure, shapes or dtypes differ from the engine's (weight sync)."""


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
    """

    max_concurrent_decodes: int = 8
    max_prefill_length: int = 64
    max_decode_length: int = 128
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: Optional[tuple[int, ...]] = None
    seed: int = 0
    cache_dtype: Optional[str] = None

    def __post_init__(self):
        for f in ("max_concurrent_decodes", "max_prefill_length", "max_decode_length"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise EngineConfigError(f"EngineConfig.{f} must be a positive int, got {v!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise EngineConfigError(f"EngineConfig.sampling must be a SamplingParams, got {type(self.sampling)}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise EngineConfigError(f"EngineConfig.cache_dtype must be one of {CACHE_DTYPES}, got "
                                    f"{self.cache_dtype!r}")
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    @property
    def cache_length(self) -> int:
        """KV-cache positions per slot: ``max_prefill_length + max_decode_length``."""
        return self.max_prefill_length + self.max_decode_length


@flax.struct.dataclass
class Prefix:
    """Result of :meth:`Qwen3Engine.prefill` for one prompt.

    Fields:
      cache: batch-1 :class:`KVCache` of length ``P`` (the padded prompt length) holding the prompt's first
        ``true_length - 1`` tokens (``cache.length`` = that count).
      next_token: [] int32, the last prompt token (fed by the first generate step).
      valid: [] bool, False for a rejected request (its slot finishes at once with no tokens).
    """

    cache: KVCache
    next_token: jax.Array
    valid: jax.Array


@flax.struct.dataclass
class DecodeState:
    """Per-slot decoding state (B = ``max_concurrent_decodes``; S = ``cache_length``).

    Fields:
      cache: :class:`KVCache`, L per-layer arrays [B, Nkv, S, H] for keys and for values.
      next_token: [B] int32, the token each slot feeds at the next step.
      done: [B] bool, slot is free or finished (its outputs are ``valid = 0``).
      generated: [B] int32, tokens generated by the slot's current request.
      limit: [B] int32, the request's maximum number of new tokens.
      sample_id: [B] int32, the random stream of the slot's request.
      next_sample_id: [] int32, stream id given to the next plain ``insert``.
      rng: [] typed PRNG key, the base key.
    """

    cache: KVCache
    next_token: jax.Array
    done: jax.Array
    generated: jax.Array
    limit: jax.Array
    sample_id: jax.Array
    next_sample_id: jax.Array
    rng: jax.Array


@flax.struct.dataclass
class StepOutput:
    """What one decode step returns beside the new state.

    Fields:
      result: ``engine_api.ResultTokens`` with ``data`` [B, 3] int32 (token, valid, generated length).
      log_probs: [B] float32, ``log softmax(logits / T)[token]`` over the full vocabulary (nats), the
        trainer's definition (conventions.md §5); meaningless where valid is 0.
      done: [B] bool, slot finished after this step (EOS, its limit, or already free).
    """

    result: engine_api.ResultTokens
    log_probs: jax.Array
    done: jax.Array


# ------------------------------------------------------------------------------------------------- tokenizer
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
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos[0] if self._eos else self._pad

    @property
    def bos_id(self) -> int:
        return NO_BOS_ID

    @property
    def stop_tokens(self) -> set[int]:
        return set()


def load_tokenizer(path: Optional[str]):
    """A transformers tokenizer from a local directory (``AutoTokenizer``), or None for ``path`` None/""."""
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------------------------------- engine
def _fit_axes(mesh, axes: Sequence[str], dim: int):
    """The mesh axes (from the left) whose size product divides ``dim``; None when none do."""
    axes = [a for a in axes if a in mesh.shape]
    while axes and dim % math.prod(mesh.shape[a] for a in axes):
        axes.pop()
    return tuple(axes) if len(axes) > 1 else (axes[0] if axes else None)


# ------------------------------------------------------------------------------------------ jitted steps
# Module-level jitted functions keyed on a hashable static _Spec, so engines over the same model structure and
# settings (e.g. a test suite, or a rollout and an eval engine) share compiled code.
@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    graphdef: Any
    model_config: Qwen3Config
    config: EngineConfig
    eos_token_ids: tuple
    state_shardings: Any  # DecodeState of NamedSharding

    def _key(self):
        return (self.graphdef, self.model_config, self.config, self.eos_token_ids, self.state_shardings)

    def __post_init__(self):  # jit hashes static args on every call: compute the hash once
        object.__setattr__(self, "_hash", hash(self._key()))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, _Spec) and self._hash == other._hash and self._key() == other._key())


def decode_param_shardings(stacked, num_layers: int) -> DecodeParams:
    """Shardings of :class:`~models.decode.DecodeParams` from the stacked parameters' ``NamedSharding`` tree
    (``models.sharding.param_shardings``): each layer leaf keeps its stacked spec without the layer axis."""
    is_ns = lambda x: isinstance(x, NamedSharding)  # noqa: E731
    rest = nnx.State({k: v for k, v in stacked.items() if k != LAYERS_KEY})
    layer = jax.tree.map(lambda s: NamedSharding(s.mesh, P(*tuple(s.spec)[1:])), stacked[LAYERS_KEY], is_leaf=is_ns)
    return DecodeParams(rest=rest, layers=(layer,) * num_layers)


class _DecodeJit:
    """A jitted engine function whose second argument is the parameters.

    Calls pass the engine's :class:`DecodeParams`. ``lower`` also accepts parameters in the trainer's stacked
    layout, concrete or abstract (``jax.ShapeDtypeStruct`` with ``NamedSharding``, as ``stapo_jax.plan``
    passes them), and converts them to the engine's per-layer layout first, so what is lowered is the
    program the engine runs.
    """

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, spec, params, *args):
        return self.fn(spec, params, *args)

    def lower(self, spec, params, *args):
        return self.fn.lower(spec, _as_decode_params(params), *args)

    def _cache_size(self) -> int:
        return self.fn._cache_size()


def _as_decode_params(params):
    if isinstance(params, DecodeParams):
        return params
    leaves = jax.tree.leaves(params)
    if not all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return split_layers(params)
    shapes = jax.eval_shape(split_layers, params)
    sh = decode_param_shardings(jax.tree.map(lambda x: x.sharding, params), len(shapes.layers))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, sh)


@functools.partial(jax.jit, static_argnums=0)
def _prefill_jit(spec: _Spec, params, tokens, true_length, ok) -> Prefix:
    """tokens [P] int32 (right-padded; negative = marker), true_length [] int32, ok [] bool -> Prefix."""
    mc = spec.model_config
    p = tokens.shape[0]
    n_cache = jnp.clip(true_length - 1, 0, p)
    idx = jnp.arange(p)
    real = (idx < true_length) & (tokens >= 0)
    mask = real & (idx < n_cache)
    ids = jnp.clip(tokens, 0, mc.vocab_size - 1)
    cache = init_cache(mc, 1, p, dtype=spec.config.cache_dtype)
    _, cache = model_decode.prefill(spec.graphdef, params, ids[None], mask[None], cache)
    cache = cache.replace(length=jnp.reshape(n_cache, (1,)).astype(jnp.int32))
    last = tokens[jnp.clip(true_length - 1, 0, p - 1)]
    in_vocab = jnp.all(jnp.where(real, tokens < mc.vocab_size, True))
    valid = ok & (true_length >= 1) & (true_length <= p) & (last >= 0) & in_vocab & jnp.any(real)
    return Prefix(cache=cache, next_token=last.astype(jnp.int32), valid=valid)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _insert_fn(spec: _Spec, prefix: Prefix, state: DecodeState, slot, sample_id, limit) -> DecodeState:
    """Copy ``prefix`` into row ``slot``. sample_id < 0: take ``state.next_sample_id`` and advance it."""
    c, pc = state.cache, prefix.cache
    use_counter = sample_id < 0
    sample_id = jnp.where(use_counter, state.next_sample_id, sample_id)
    row_mask = jnp.zeros((1, c.max_length), bool).at[:, : pc.max_length].set(pc.key_mask)
    put = lambda dst, src: jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype), (slot, 0, 0, 0))  # noqa: E731
    cache = KVCache(
        k=tuple(map(put, c.k, pc.k)), v=tuple(map(put, c.v, pc.v)),
        key_mask=jax.lax.dynamic_update_slice(c.key_mask, row_mask, (slot, 0)),
        length=c.length.at[slot].set(pc.length[0]),
        next_position=c.next_position.at[slot].set(pc.next_position[0]),
    )
    state = state.replace(
        cache=cache,
        next_token=state.next_token.at[slot].set(prefix.next_token),
        done=state.done.at[slot].set(~prefix.valid),
        generated=state.generated.at[slot].set(0),
        limit=state.limit.at[slot].set(limit),
        sample_id=state.sample_id.at[slot].set(sample_id),
        next_sample_id=state.next_sample_id + use_counter.astype(jnp.int32),
    )
    return jax.lax.with_sharding_constraint(state, spec.state_shardings)


@functools.partial(jax.jit, static_argnums=0)
def _init_fn(spec: _Spec, rng) -> DecodeState:
    b, cfg = spec.config.max_concurrent_decodes, spec.config
    zeros = jnp.zeros((b,), jnp.int32)
    state = DecodeState(
        cache=init_cache(spec.model_config, b, cfg.cache_length, dtype=cfg.cache_dtype),
        next_token=zeros, done=jnp.ones((b,), bool), generated=zeros,
        limit=jnp.full((b,), cfg.max_decode_length, jnp.int32), sample_id=zeros,
        next_sample_id=jnp.zeros((), jnp.int32), rng=rng)
    return jax.lax.with_sharding_constraint(state, spec.state_shardings)


def _step_body(spec: _Spec, params, state: DecodeState, sampling: SamplingParams):
    """One token for every slot; see :meth:`Qwen3Engine.step`."""
    active = ~state.done
    logits, cache = model_decode.decode_step(spec.graphdef, params, state.next_token, state.cache, active)
    keys = jax.vmap(lambda sid, n: jax.random.fold_in(jax.random.fold_in(state.rng, sid), n))(
        state.sample_id, state.generated)
    tokens, log_probs = sample_tokens(logits, keys, sampling)
    generated = state.generated + active.astype(jnp.int32)
    eos = jnp.asarray(spec.eos_token_ids or (-1,), jnp.int32)
    done = state.done | jnp.isin(tokens, eos) | (generated >= state.limit)
    tokens = jnp.where(active, tokens, 0)
    new_state = state.replace(cache=cache, next_token=jnp.where(active, tokens, state.next_token),
                              done=done, generated=generated)
    new_state = jax.lax.with_sharding_constraint(new_state, spec.state_shardings)
    data = jnp.stack([tokens, active.astype(jnp.int32), generated], axis=-1).astype(jnp.int32)
    result = engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                                     samples_per_slot=1)
    return new_state, StepOutput(result=result, log_probs=log_probs, done=done)


@functools.partial(jax.jit, static_argnums=(0, 3, 4), donate_argnums=2)
def _step_jit(spec: _Spec, params, state: DecodeState, sampling: SamplingParams, num_steps: int = 1):
    """``num_steps`` decode steps in one call; outputs gain a leading [num_steps] axis when > 1."""
    if num_steps == 1:
        return _step_body(spec, params, state, sampling)
    return jax.lax.scan(lambda st, _: _step_body(spec, params, st, sampling), state, None, length=num_steps)


_prefill_fn = _DecodeJit(_prefill_jit)
_step_fn = _DecodeJit(_step_jit)


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
        vocab = self.model_config.vocab_size
        if config.eos_token_ids is not None:
            eos = config.eos_token_ids
        else:
            eos = tuple(sorted({*self.model_config.eos_token_ids, *(i for i in QWEN3_STOP_IDS if i < vocab)}))
        self.eos_token_ids: tuple[int, ...] = eos
        self._graphdef, state = nnx.split(model)
        self._param_shardings = param_shardings(state, self._mesh)
        self._param_ref = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        layer_shardings = decode_param_shardings(self._param_shardings, self.model_config.num_hidden_layers).layers
        self._unstack = jax.jit(unstack_layers, in_shardings=(self._param_shardings[LAYERS_KEY],),
                                out_shardings=layer_shardings)
        self._params = self.place_params(state)
        self._spec = _Spec(self._graphdef, self.model_config, config, eos, self._decode_state_shardings())

    # ------------------------------------------------------------------ shardings
    def _decode_state_shardings(self) -> DecodeState:
        mesh, c = self._mesh, self.model_config
        b = _fit_axes(mesh, ("data", "fsdp"), self.config.max_concurrent_decodes)
        h = _fit_axes(mesh, ("tensor",), c.num_key_value_heads)
        ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
        layers = self.model_config.num_hidden_layers
        kv = tuple(ns(b, h, None, None) for _ in range(layers))  # per layer [B, Nkv, S, H]
        cache = KVCache(k=kv, v=kv, key_mask=ns(b, None),
                        length=ns(b), next_position=ns(b))
        return DecodeState(cache=cache, next_token=ns(b), done=ns(b), generated=ns(b), limit=ns(b),
                           sample_id=ns(b), next_sample_id=ns(), rng=ns())

    # ------------------------------------------------------------------ helpers used by the driver
    def prefill_bucket(self, n: int) -> int:
        """Padded prefill length for a prompt of ``n`` tokens: the smallest power of two >= max(n, 16),
        capped at ``max_prefill_length`` (bounded number of compiled prefill shapes)."""
        b = 16
        while b < n:
            b *= 2
        return min(b, self.config.max_prefill_length) if n <= self.config.max_prefill_length else n

    def prefill_tokens(self, params, prompt: Sequence[int]) -> Prefix:
        """Prefill one unpadded prompt (validated by the caller): pads to :meth:`prefill_bucket` and runs
        the jitted prefill. ``prompt`` is a 1-D int sequence with 1 <= len <= ``max_prefill_length``."""
        ids = np.asarray(prompt, np.int32)
        padded = np.zeros((self.prefill_bucket(len(ids)),), np.int32)
        padded[: len(ids)] = ids
        with jax.set_mesh(self._mesh):
            return _prefill_fn(self._spec, params, padded, np.int32(len(ids)), np.bool_(True))

    def insert_sample(self, prefix: Prefix, decode_state: DecodeState, slot: int, sample_id: int,
                      max_new_tokens: int) -> DecodeState:
        """:meth:`insert` with an explicit random-stream id (>= 0) and new-token limit (the driver's insert)."""
        with jax.set_mesh(self._mesh):
            return _insert_fn(self._spec, prefix, decode_state, np.int32(slot), np.int32(sample_id),
                                    np.int32(max_new_tokens))

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
            return _step_fn(self._spec, params, decode_state, sampling or self.config.sampling, 1)

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
            return _step_fn(self._spec, params, decode_state, sampling or self.config.sampling, int(num_steps))

    def place_params(self, params) -> DecodeParams:
        """Check ``params`` against the engine's model and lay them out for decoding on the engine's mesh.

        The stacked layers are split into one state per layer (:func:`models.decode.split_layers`; the layer
        weights are copied once, by a jitted function with the engine's shardings): decode steps then read
        each layer's weights in place.

        Args:
          params: ``nnx.State`` in the model's stacked layout (``nnx.split(model)[1]``, e.g. the trainer's
            state after an update), device-resident or host (numpy) arrays.
        Returns:
          :class:`~models.decode.DecodeParams`; pass it to ``step``/``generate`` (jitted steps are reused,
          not recompiled).
        Raises:
          ParamsMismatchError: different structure, or a leaf with another shape or dtype (named).
        """
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
        placed = jax.device_put(params, self._param_shardings)
        return jax.block_until_ready(split_layers(placed, self._unstack))

    def set_params(self, params) -> Any:
        """:meth:`place_params` and make the result what :meth:`load_params` returns."""
        self._params = self.place_params(params)
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
          :class:`Prefix`; ``valid`` is False (never an exception, see the module docstring) when the
          prompt was truncated by JetStream (``true_length > P``), is padded beyond ``max_prefill_length``,
          is empty, or holds ids outside the vocabulary.
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
            return _prefill_fn(self._spec, params, tokens, np.int32(min(max(n, 0), tokens.shape[0])), np.bool_(ok))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Put ``prefix`` into ``slot`` (donates ``decode_state``), with limit ``max_decode_length`` and the
        state's next random-stream id."""
        with jax.set_mesh(self._mesh):
            return _insert_fn(self._spec, prefix, decode_state, np.int32(slot), np.int32(-1),
                                    np.int32(self.config.max_decode_length))

    def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, engine_api.ResultTokens]:
        """One step for every slot (JetStream API); :meth:`step` also returns the log-probs."""
        state, out = self.step(params, decode_state)
        return state, out.result

    def init_decode_state(self, seed: Optional[int] = None, *args, **kwargs) -> DecodeState:
        """All slots free; base key ``jax.random.key(seed)`` (default ``config.seed``)."""
        rng = jax.random.key(self.config.seed if seed is None else int(seed))
        with jax.set_mesh(self._mesh):
            return _init_fn(self._spec, rng)

    def get_prefix_destination_sharding(self) -> Any:
        """Replicated on the engine mesh (prefixes are batch-1)."""
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
        return self.config.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> Union[list, None]:
        """None: no colocated CPU devices are used."""
        return None
