"""gRPC client of ``stapo-jax serve`` with the in-process driver's return type (``rollout.mode: grpc``).

Each sample is one JetStream ``Decode`` stream with client-side tokenization
(``DecodeRequest(token_content=TokenContent(token_ids=prompt), max_tokens=N)``, conventions.md §7); up to
``max_parallel`` streams run at once so the server's continuous batching stays full. Rows come back in the
driver's prompt-major order, packed by :func:`stapo_jax.rollout.driver.assemble_batch`.

Failure handling, so that a dead or stuck server never hangs the trainer: before a batch, a ``HealthCheck``
with ``connect_timeout_s``; each stream has a deadline of ``request_timeout_s`` seconds; a stream that fails
with UNAVAILABLE, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED is retried from scratch at most ``max_retries``
times (backoff 0.5 s, 1 s, 2 s, ...); then :class:`RolloutServerError` names the address, the prompt index,
the gRPC status and the attempts. Worst case per batch: about ``(max_retries + 1) * request_timeout_s``.

Differences from the in-process driver (JetStream 0.2.2 protocol limits): ``rollout_log_probs`` is None (the
protocol carries token ids only); sampling settings are fixed by the server's config; sampled (non-greedy)
responses are not reproducible from a seed; a group's G samples are G requests (the server prefills the
prompt G times); weights cannot be pushed (``sync_weights`` raises).
"""
from __future__ import annotations

import time
from concurrent import futures
from typing import Optional, Sequence

import grpc

from stapo_jax.rollout import compat
from stapo_jax.rollout.driver import RolloutBatch, assemble_batch, check_generation_args, validate_prompts
from stapo_jax.rollout.sampling import SamplingParams
from stapo_jax.data.tokenizer import QWEN3_PAD_ID, QWEN3_STOP_IDS

compat.install()
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
_ANY_ID = 2**31 - 1  # token-id bound when the client does not know the vocabulary size


class RolloutServerError(RuntimeError):
    """The rollout server is unreachable, stopped answering, or rejected a request."""


class WeightSyncUnsupportedError(NotImplementedError):
    """``sync_weights`` over gRPC: JetStream 0.2.2's protocol cannot carry parameters."""


class GrpcRolloutClient:
    """Rollouts from a JetStream server (see the module docstring).

    Args:
      address: ``host:port`` of ``stapo-jax serve`` (default ``127.0.0.1:9000``).
      eos_token_ids: stop ids of the served model (finish reason ``eos`` iff a row ends with one).
      pad_token_id: fill value of ``responses`` after a row ends.
      max_prompt_length: longest prompt the server accepts (its ``data.max_prompt_length``).
      max_new_tokens_limit: the server's ``rollout.max_new_tokens``.
      vocab_size: if given, prompt ids are checked against it.
      sampling: the server's sampling settings (``generate(sampling=...)`` must equal them).
      prompt_truncation: ``error`` | ``left`` | ``right`` (as the driver).
      request_timeout_s: deadline of one Decode stream (> 0).
      max_retries: retries per request after a retryable failure (>= 0).
      connect_timeout_s: deadline of the health check before each batch (> 0).
      max_parallel: concurrent streams (>= 1).
    Raises:
      ValueError: a non-positive timeout, negative retries, or a malformed address.
    """

    def __init__(self, address: str = "127.0.0.1:9000", *, eos_token_ids: Sequence[int] = QWEN3_STOP_IDS,
                 pad_token_id: int = QWEN3_PAD_ID, max_prompt_length: int = 1024, max_new_tokens_limit: int = 15360,
                 vocab_size: Optional[int] = None, sampling: Optional[SamplingParams] = None,
                 prompt_truncation: str = "error", request_timeout_s: float = 600.0, max_retries: int = 3,
                 connect_timeout_s: float = 10.0, max_parallel: int = 64):
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"rollout server address must be host:port, got {address!r}")
        if not request_timeout_s > 0 or not connect_timeout_s > 0:
            raise ValueError(f"request_timeout_s={request_timeout_s} and connect_timeout_s={connect_timeout_s} "
                             f"must be > 0")
        if max_retries < 0 or max_parallel < 1:
            raise ValueError(f"max_retries={max_retries} must be >= 0 and max_parallel={max_parallel} >= 1")
        self.address = address
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.max_prompt_length = int(max_prompt_length)
        self.max_new_tokens_limit = int(max_new_tokens_limit)
        self.vocab_size = vocab_size
        self.sampling = sampling
        self.prompt_truncation = prompt_truncation
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = int(max_retries)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_parallel = int(max_parallel)
        self._channel = grpc.insecure_channel(address)
        self._stub = jetstream_pb2_grpc.OrchestratorStub(self._channel)

    def close(self) -> None:
        """Close the gRPC channel."""
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def check_health(self, timeout_s: Optional[float] = None) -> None:
        """One ``HealthCheck`` with a deadline.

        Raises:
          RolloutServerError: unreachable, no answer within the deadline, or the server reports not live.
        """
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        try:
            live = self._stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=timeout_s).is_live
        except grpc.RpcError as e:
            raise RolloutServerError(
                f"rollout server {self.address} is not reachable or did not answer a health check within "
                f"{timeout_s:g} s ({e.code().name}: {e.details()}); is `stapo-jax serve` running?") from e
        if not live:
            raise RolloutServerError(f"rollout server {self.address} reports it is not live")

    def wait_ready(self, timeout_s: float) -> None:
        """Poll :meth:`check_health` until it succeeds or ``timeout_s`` seconds have passed.

        Raises:
          RolloutServerError: still not ready after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.check_health(timeout_s=max(0.1, min(2.0, deadline - time.monotonic())))
            except RolloutServerError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.25)

    def sync_weights(self, params) -> float:
        """Unsupported: JetStream 0.2.2's gRPC protocol cannot carry parameters.

        Raises:
          WeightSyncUnsupportedError: always; use ``rollout.mode: inprocess`` for on-policy training, or
            restart the server on a new checkpoint.
        """
        raise WeightSyncUnsupportedError(
            "rollout.mode=grpc cannot push new weights to a JetStream 0.2.2 server (its protocol carries token "
            "ids only); use rollout.mode=inprocess for training, or restart `stapo-jax serve` on the new "
            "checkpoint")

    def _decode(self, index: int, prompt: list[int], max_new_tokens: int) -> list[int]:
        request = jetstream_pb2.DecodeRequest(
            max_tokens=max_new_tokens,
            token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt))
        last: Optional[grpc.RpcError] = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            tokens: list[int] = []
            try:
                for response in self._stub.Decode(request, timeout=self.request_timeout_s):
                    for sample in response.stream_content.samples:
                        tokens.extend(sample.token_ids)
            except grpc.RpcError as e:
                last = e
                if e.code() in RETRYABLE:
                    continue
                raise RolloutServerError(f"rollout server {self.address} failed prompt {index}: "
                                         f"{e.code().name}: {e.details()}") from e
            if not tokens:
                raise RolloutServerError(
                    f"rollout server {self.address} returned no tokens for prompt {index} ({len(prompt)} tokens): "
                    f"it rejected the request (longer than its max_prefill_length - 1, or ids outside its "
                    f"vocabulary)")
            return tokens[:max_new_tokens]
        raise RolloutServerError(
            f"rollout server {self.address} did not answer prompt {index}: {self.max_retries + 1} attempt(s) "
            f"failed, the last with {last.code().name} ({last.details()}); request_timeout_s="
            f"{self.request_timeout_s:g}") from last

    def generate(self, prompts: Sequence[Sequence[int]], *, num_samples: int = 1,
                 max_new_tokens: Optional[int] = None, seed: int = 0,
                 sampling: Optional[SamplingParams] = None) -> RolloutBatch:
        """Sample ``num_samples`` responses per prompt from the server (same contract as
        :meth:`stapo_jax.rollout.driver.RolloutDriver.generate`, with ``rollout_log_probs`` None).

        Args:
          prompts, num_samples, max_new_tokens: as the driver (``max_new_tokens`` <= ``max_new_tokens_limit``).
          seed: unused (server-side randomness); accepted for interface compatibility.
          sampling: must be None or equal the server's settings given at construction.
        Raises:
          RolloutInputError / PromptTooLongError: bad input (before contacting the server).
          ValueError: ``sampling`` differs from the server's. RolloutServerError: see the module docstring.
        """
        del seed
        if sampling is not None and self.sampling is not None and sampling != self.sampling:
            raise ValueError(f"sampling={sampling} differs from the server's {self.sampling}; sampling settings "
                             f"are fixed when `stapo-jax serve` starts")
        max_new_tokens = self.max_new_tokens_limit if max_new_tokens is None else max_new_tokens
        check_generation_args(num_samples, max_new_tokens, self.max_new_tokens_limit)
        prompts = validate_prompts(prompts, self.max_prompt_length, self.vocab_size or _ANY_ID,
                                   self.prompt_truncation)
        self.check_health()
        g = int(num_samples)
        n_rows = len(prompts) * g
        with futures.ThreadPoolExecutor(max_workers=min(self.max_parallel, n_rows)) as pool:
            jobs = [pool.submit(self._decode, r // g, prompts[r // g].tolist(), max_new_tokens)
                    for r in range(n_rows)]
            try:
                rows = [job.result() for job in jobs]
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise
        return assemble_batch(prompts, g, max_new_tokens, rows, None, self.eos_token_ids, self.pad_token_id)
