"""`stapo-jax serve` (JetStream orchestrator + gRPC) in subprocesses on free localhost ports, and the gRPC
client: same greedy tokens as the in-process driver, bounded clear errors when the server hangs, is killed or
is gone, clean shutdown on SIGTERM. In process: JetStream's prefill and generate loops wait for the device after
every ``DISPATCH_WINDOW`` programs."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import portpicker
import pytest

from fixtures_rollout import RAGGED_PROMPTS, TOKENIZER_DIR, make_engine, tiny_model
from models.hf import load_hf_checkpoint, save_hf_checkpoint
from stapo_jax.rollout.client import GrpcRolloutClient, RolloutServerError, WeightSyncUnsupportedError
from stapo_jax.rollout.driver import PromptTooLongError, RolloutDriver, RolloutInputError
from stapo_jax.rollout.dispatch import DISPATCH_WINDOW
from stapo_jax.rollout.sampling import SamplingParams
from stapo_jax.rollout.server import serve
from xla_env import xla_flags

MAX_PROMPT, MAX_NEW = 15, 12
SAMPLING = SamplingParams(top_k=1)  # greedy, expressed through the run config (rollout.top_k=1)


class Server:
    def __init__(self, ckpt, tmp):
        self.port = portpicker.pick_unused_port()
        cfg = tmp / f"serve_{self.port}.yaml"
        cfg.write_text(
            f"model: {{path: {ckpt}, preset: null, dtype: float32}}\n"
            f"tokenizer: {{path: {os.path.abspath(TOKENIZER_DIR)}}}\n"
            f"data: {{max_prompt_length: {MAX_PROMPT}}}\n"
            f"rollout: {{max_new_tokens: {MAX_NEW}, max_concurrent_decodes: 3, top_k: 1}}\n")
        env = dict(os.environ, XLA_FLAGS=xla_flags())  # one CPU device
        env["JAX_PLATFORMS"] = "cpu"
        self.log = open(tmp / f"serve_{self.port}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "stapo_jax.tools.cli", "serve", "--config", str(cfg),
                                      "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=os.getcwd())
        self.address = f"127.0.0.1:{self.port}"

    def client(self, **kw):
        args = dict(eos_token_ids=(), pad_token_id=0, max_prompt_length=MAX_PROMPT, max_new_tokens_limit=MAX_NEW,
                    vocab_size=128, sampling=SAMPLING, request_timeout_s=30, max_retries=1, connect_timeout_s=5)
        args.update(kw)
        return GrpcRolloutClient(self.address, **args)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    model = tiny_model(0)
    save_hf_checkpoint(model, model.config, tmp / "ckpt")
    started = [Server(tmp / "ckpt", tmp), Server(tmp / "ckpt", tmp)]  # start both now: startups overlap
    try:
        for s in started:
            try:
                s.client().wait_ready(240)
            except RolloutServerError:
                pytest.fail(f"server did not start:\n{s.output()}")
        yield started, tmp / "ckpt"
    finally:
        for s in started:
            s.stop()


def test_grpc_greedy_equals_in_process_driver(servers):
    (server, _), ckpt = servers
    _, model = load_hf_checkpoint(ckpt)
    local = RolloutDriver(make_engine(model, max_prefill_length=16, max_decode_length=MAX_NEW, sampling=SAMPLING,
                                      eos_token_ids=()))
    expected = local.generate(RAGGED_PROMPTS, num_samples=2, max_new_tokens=MAX_NEW)
    with server.client() as client:
        got = client.generate(RAGGED_PROMPTS, num_samples=2, max_new_tokens=MAX_NEW)
        np.testing.assert_array_equal(got.responses, expected.responses)
        np.testing.assert_array_equal(got.response_mask, expected.response_mask)
        assert got.finish_reasons == expected.finish_reasons and got.rollout_log_probs is None
        short = client.generate([RAGGED_PROMPTS[0]], max_new_tokens=5)  # per-request max_tokens
        assert short.responses[0].tolist() == expected.responses[0, :5].tolist()
        with pytest.raises(PromptTooLongError, match="prompt 1 has 16 tokens"):
            client.generate([[1], list(range(16))])
        with pytest.raises(RolloutInputError, match="max_new_tokens"):
            client.generate([[1]], max_new_tokens=0)
        with pytest.raises(ValueError, match="differs from the server's"):
            client.generate([[1]], sampling=SamplingParams(temperature=0.5))
        with pytest.raises(WeightSyncUnsupportedError):
            client.sync_weights(None)


def test_unresponsive_server_errors_then_clean_shutdown(servers):
    (server, _), _ = servers
    with server.client(request_timeout_s=2, max_retries=1, connect_timeout_s=2) as client:
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RolloutServerError, match=f"{server.address}.*(did not answer|not reachable)"):
                client.generate([RAGGED_PROMPTS[0]], max_new_tokens=4)
            assert time.monotonic() - t0 < 20
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        client.wait_ready(30)  # it recovers once it runs again
        assert client.generate([RAGGED_PROMPTS[1]], max_new_tokens=4).response_lengths.tolist() == [4]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=90) == 0, server.output()
        assert "stapo-jax serve: stopped" in server.output()
        t0 = time.monotonic()
        with pytest.raises(RolloutServerError, match="not reachable"):
            client.generate([RAGGED_PROMPTS[0]], max_new_tokens=4)
        assert time.monotonic() - t0 < 10


def test_killed_server_gives_clear_error(servers):
    (_, server), _ = servers
    with server.client(request_timeout_s=5, max_retries=2, connect_timeout_s=2) as client:
        assert client.generate([RAGGED_PROMPTS[2]], max_new_tokens=3).response_lengths.tolist() == [3]
        server.proc.kill()
        assert server.proc.wait(timeout=30) == -signal.SIGKILL
        t0 = time.monotonic()
        with pytest.raises(RolloutServerError, match=f"rollout server {server.address} is not reachable"):
            client.generate(RAGGED_PROMPTS, num_samples=2, max_new_tokens=4)
        assert time.monotonic() - t0 < 10


def test_server_loops_wait_every_dispatch_window(monkeypatch):
    """The server's engine in this process, 32 slots, 64 requests: JetStream's generate thread inserts one
    prefix per free slot and steps, its prefill thread prefills, neither ever waiting for the device. A spy logs,
    per thread, each engine call that dispatches a program (prefill, insert, generate) and each
    ``jax.block_until_ready``: no thread dispatches more than ``DISPATCH_WINDOW`` programs between two waits
    (without the window, the generate thread dispatched all its ~100 programs without one), and the tokens are
    the greedy ones."""
    import jax

    engine = make_engine(tiny_model(0), slots=32, max_prefill_length=16, max_decode_length=MAX_NEW,
                         sampling=SAMPLING, eos_token_ids=(), tokenizer=TOKENIZER_DIR)
    events: list[tuple[str, int]] = []
    block = jax.block_until_ready

    def spy(name, fn):
        def call(*a, **k):
            events.append((name, threading.get_ident()))
            return fn(*a, **k)
        return call

    for name in ("prefill", "insert", "generate"):
        monkeypatch.setattr(engine, name, spy(name, getattr(engine, name)))
    monkeypatch.setattr(jax, "block_until_ready", spy("wait", block))
    port = portpicker.pick_unused_port()
    server = serve(engine, port)
    try:
        prompts = [[1 + i % 100, 2, 3 + i % 7][: 1 + i % 3] for i in range(64)]
        with GrpcRolloutClient(f"127.0.0.1:{port}", eos_token_ids=(), pad_token_id=0, max_prompt_length=MAX_PROMPT,
                               max_new_tokens_limit=MAX_NEW, vocab_size=128, sampling=SAMPLING,
                               request_timeout_s=120, max_retries=0, connect_timeout_s=5, max_parallel=64) as c:
            c.wait_ready(60)
            got = c.generate(prompts, max_new_tokens=MAX_NEW)
    finally:
        server.stop()
    assert got.response_lengths.tolist() == [MAX_NEW] * 64
    runs: dict[tuple[int, str], list[int]] = {}
    current: dict[int, int] = {}
    for name, tid in events:
        if name == "wait":
            current[tid] = 0
            continue
        current[tid] = current.get(tid, 0) + 1
        runs.setdefault((tid, name), []).append(current[tid])
    longest = {name: max(max(v) for (_, n), v in runs.items() if n == name) for name in ("prefill", "insert",
                                                                                         "generate")}
    counts = {name: sum(1 for n, _ in events if n == name) for name in ("prefill", "insert", "generate", "wait")}
    print("dispatches", counts, "longest run between waits", longest)
    assert counts["insert"] == 64 and counts["prefill"] == 64 and counts["generate"] >= 2 * MAX_NEW, counts
    assert max(longest.values()) <= DISPATCH_WINDOW, longest
    assert counts["wait"] >= (counts["insert"] + counts["generate"]) // DISPATCH_WINDOW, counts
