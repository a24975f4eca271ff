"""``stapo-jax serve``: JetStream 0.2.2's orchestrator and gRPC server with our Qwen3Engine, on 127.0.0.1.

Serving follows conventions.md §7 "Serving on CPU": a ``config_lib.ServerConfig`` subclass with one
interleaved slice (``"<platform>=<n devices>"``) whose engine-create function returns our engine, passed to
``server_lib.run``. The compat shim (:mod:`stapo_jax.rollout.compat`) is installed first and binds the server
to ``127.0.0.1`` unless ``--host`` says otherwise.

Clients send ``DecodeRequest(token_content=TokenContent(token_ids=prompt), max_tokens=N)`` (client-side
tokenization; :mod:`stapo_jax.rollout.client`) or ``text_content`` (needs a tokenizer). One request = one
sample; the stream returns the sampled ids, the EOS id included. SIGTERM / SIGINT stop the server cleanly
(orchestrator threads joined, gRPC stopped with JetStream's 10 s grace) and ``main`` returns 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Optional, Sequence

import jax

from stapo_jax.rollout import compat
from stapo_jax.rollout.engine import PREFILL_BUCKETS, EngineConfigError, Qwen3Engine

log = logging.getLogger(__name__)


def serving_prefill_length(max_prompt_length: int) -> int:
    """Engine ``max_prefill_length`` for serving prompts of up to ``max_prompt_length`` tokens: the smallest
    JetStream padding bucket >= ``max_prompt_length + 1`` (JetStream prepends a BOS marker to token requests).

    Raises:
      EngineConfigError: ``max_prompt_length`` < 1 or larger than the biggest bucket (32767).

    Int in, int out. Source: JetStream ``token_utils`` padding buckets (``DEFAULT_PREFILL_BUCKETS``) and
    its BOS-marker convention for token requests.
    """
    need = int(max_prompt_length) + 1
    if max_prompt_length < 1 or need > PREFILL_BUCKETS[-1]:
        raise EngineConfigError(f"max_prompt_length={max_prompt_length} must be in [1, {PREFILL_BUCKETS[-1] - 1}] "
                                f"for JetStream serving")
    return next(b for b in PREFILL_BUCKETS if b >= need)


def serve(engine: Qwen3Engine, port: int, host: str = compat.DEFAULT_HOST, threads: Optional[int] = None):
    """Start JetStream's orchestrator + gRPC server with ``engine`` (non-blocking).

    Args:
      engine: the engine; its ``max_prefill_length`` must be a JetStream bucket (``PREFILL_BUCKETS``).
      port: TCP port (1..65535).
      host: interface to bind, default ``127.0.0.1``.
      threads: gRPC handler threads; default JetStream's max(max_concurrent_decodes, 64).
    Returns:
      ``jetstream.core.server_lib.JetStreamServer`` (call ``.stop()``).
    Raises:
      EngineConfigError: ``max_prefill_length`` not a bucket; ValueError: bad port.

    ``port`` / ``threads`` ints, ``host`` a str. Source: JetStream ``server_lib.run`` (orchestrator +
    gRPC ``Decode`` service).
    """
    if engine.max_prefill_length not in PREFILL_BUCKETS:
        raise EngineConfigError(f"max_prefill_length={engine.max_prefill_length} must be one of JetStream's "
                                f"padding buckets {PREFILL_BUCKETS} for serving")
    if not 0 < int(port) < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    server_lib = compat.import_server_lib(host)
    import grpc
    from jetstream.core import config_lib

    devices = list(engine.mesh.devices.flat)

    class _Config(config_lib.ServerConfig):
        interleaved_slices = (f"{devices[0].platform}={len(devices)}",)
        interleaved_engine_create_fns = (lambda _devices: engine,)

    return server_lib.run(port=int(port), config=_Config, devices=devices,
                          credentials=grpc.insecure_server_credentials(), threads=threads, jax_padding=True,
                          metrics_server_config=None, enable_jax_profiler=False)


def build_parser() -> argparse.ArgumentParser:
    """The ``stapo-jax serve`` argument parser: positional ``key.sub=value`` overrides, ``--config``,
    ``--host``, ``--port`` (int), ``--seed`` (int). Parsing bad arguments exits 2 (argparse's SystemExit).

    Returns an ``argparse.ArgumentParser`` (str / int options). Building it never raises. Source: the
    project CLI convention (``stapo-jax <command>``, verl-style dotted ``key.sub=value`` overrides).
    """
    p = argparse.ArgumentParser(prog="stapo-jax serve",
                                description="Serve rollouts of a Qwen3 policy with JetStream's gRPC orchestrator.")
    p.add_argument("overrides", nargs="*", help="dotted config overrides key.sub=value (e.g. model.path=DIR)")
    p.add_argument("--config", help="run config YAML (model, tokenizer, mesh, rollout.*, data.max_prompt_length)")
    p.add_argument("--host", help="interface to bind (default: host of rollout.server_address, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: port of rollout.server_address)")
    p.add_argument("--seed", type=int, help="sampling seed and random-init seed (default trainer.seed)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stapo-jax serve``: build the policy and engine from the config, serve until SIGTERM/SIGINT.

    Engine settings: ``rollout.max_concurrent_decodes`` slots, ``rollout.max_new_tokens`` per request,
    prompts up to ``data.max_prompt_length`` tokens, ``rollout.temperature/top_p/top_k``, stop ids from the
    tokenizer. Prints ``stapo-jax serve: listening on HOST:PORT`` once requests are accepted.

    Returns:
      0 after a clean shutdown, 2 on a configuration error.

    ``argv`` a sequence of str; returns an int exit code. Configuration errors (ConfigError,
    EngineConfigError, ValueError, FileNotFoundError) are printed and give 2, not raised; argparse errors exit 2
    (SystemExit). Source: JetStream's server process convention (serve until a signal).
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.rollout import engine_config

    try:
        cfg = load_config(args.config, list(args.overrides))
        default_host, _, default_port = cfg.rollout.server_address.rpartition(":")
        host = args.host or default_host or compat.DEFAULT_HOST
        port = args.port if args.port is not None else int(default_port)
        seed = cfg.trainer.seed if args.seed is None else args.seed
        from stapo_jax.runtime.build import build_mesh, build_model, build_tokenizer

        tokenizer = build_tokenizer(cfg)
        mesh = build_mesh(cfg)
        model = build_model(cfg, mesh, tokenizer, seed=seed)
        econf = engine_config(cfg, tokenizer, max_prefill_length=serving_prefill_length(cfg.data.max_prompt_length),
                              seed=seed)
        engine = Qwen3Engine(model, econf, mesh=mesh, tokenizer=tokenizer)
        server = serve(engine, port, host)
    except (ConfigError, EngineConfigError, ValueError, FileNotFoundError) as e:
        print(f"stapo-jax serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"stapo-jax serve: listening on {host}:{port} ({len(jax.devices())} device(s), "
          f"{engine.max_concurrent_decodes} slots)", flush=True)
    while not stop.wait(0.5):
        pass
    print("stapo-jax serve: stopping", flush=True)
    server.stop()
    print("stapo-jax serve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
