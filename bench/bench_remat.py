"""Remat policies of the Qwen3 decoder layers (``model.remat``) side by side: wall time of a decoder forward +
backward (interleaved, median [min..max]) and the compiled temporaries (XLA memory analysis) and FLOPs (XLA cost
analysis) of each policy, at the Qwen3-0.6B widths, fp32, random weights. The measurement behind the default
``model.remat`` of ``configs/base.yaml``.

    .venv/bin/python bench/bench_remat.py --layers 2 --B 2 --T 256 --repeats 3
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchutil import interleaved, load_line, machine_line, ratio, summary, use_cli_allocator  # noqa: E402
from flax import nnx  # noqa: E402

from models.presets import from_hf_config  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from stapo_jax.assets import qwen3_config_dir  # noqa: E402

POLICIES = ("none", "dots_no_batch", "dots", "full")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024, help="embedding rows (the head is not in this bench)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    use_cli_allocator()
    print(machine_line(), flush=True)
    base = from_hf_config(str(qwen3_config_dir() / "Qwen3-0.6B.json"), dtype="float32", param_dtype="float32")
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, a.vocab, (a.B, a.T)), jnp.int32)
    att = jnp.ones((a.B, a.T), bool)
    g = jnp.asarray(rng.standard_normal((a.B, a.T, base.hidden_size)), jnp.float32)
    print(f"Qwen3-0.6B widths, {a.layers} layers, B={a.B} T={a.T}, fp32; decoder forward + backward (grad of "
          f"sum(h * g) w.r.t. all parameters)", flush=True)
    fns, stats = {}, {}
    for pol in POLICIES:
        cfg = dataclasses.replace(base, num_hidden_layers=a.layers, vocab_size=a.vocab, remat=pol)
        model = Qwen3(cfg, rngs=nnx.Rngs(0))
        gd, params = nnx.split(model)

        def fb(p, gd=gd):
            return jax.grad(lambda p: jnp.sum(nnx.merge(gd, p)(ids, att)[0] * g))(p)

        c = jax.jit(fb).lower(params).compile()
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        stats[pol] = (float(ca.get("flops", 0.0)), float(c.memory_analysis().temp_size_in_bytes))
        fns[pol] = (lambda c=c, p=params: jax.block_until_ready(c(p)))
    times = interleaved(fns, a.repeats)
    print("| remat | fwd+bwd time | vs none | compiled GFLOP | temporaries MiB |")
    print("|---|---|---|---|---|")
    for pol in POLICIES:
        fl, tmp = stats[pol]
        print(f"| {pol} | {summary(times[pol], 's')} | {ratio(times[pol], times['none'])} | {fl / 1e9:.1f} "
              f"({fl / stats['none'][0]:.3f}x) | {tmp / 2**20:.1f} |")
    print(load_line("after"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
