"""Which process layouts compute bitwise the same SFT gradient (the measurement behind DESIGN.md,
"Multi-process runs", layout independence of the SFT warm-up).

``python bench/sft_grad_layouts.py [--batch sharded|replicated] [--layouts 1x4:inproc,1x4,2x2,4x1]`` runs, for
each layout N processes x D CPU devices, N local JAX processes (``stapo_jax.runtime.launch.process_env``, so
``jax.distributed`` is started also for N = 1 and the CPU collectives are gloo's; ``:inproc`` runs the layout
(N = 1 only) without ``jax.distributed``, i.e. with XLA:CPU's in-process collectives, as a plain one-process run has). Each
builds the tiny config's model (``configs/tiny_cpu.yaml``, seed 0) on the global mesh and takes ``jax.grad``
under ``jax.jit`` of the SFT loss (summed response-token NLL, as in ``stapo_jax.train.sft``) on the gold
responses of the first 16 training examples, the rows over the data axes (``train_step.place_rows``, default) or
replicated on every device; process 0 saves the gradient leaves. It prints, for every pair of layouts, the
number of differing elements, the largest absolute difference and which leaves differ, plus the collectives of
the compiled step.

Measured on the 2-core CPU VM (sharded batch, one all-reduce): 1x4 with gloo, 2x2 and 4x1 are bitwise equal;
1x4:inproc differs from them in 128,673 elements of every leaf (max 1.9e-6), so the in-process all-reduce sums
in another order than gloo's. With the replicated batch (the SFT step before it was data-parallel; no
collectives) 1x4 differed from 1x1 in the k/v-projection gradients already without ``jax.distributed``.
"""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = "1x4:inproc,1x4,2x2,4x1"


def child(out: str, mode: str) -> None:
    """One process of a layout: save the gradient leaves (process 0) to ``out`` (.npz); ``mode`` is
    ``replicated`` (every device gets the whole batch) or ``sharded`` (rows over the data axes)."""
    from stapo_jax.runtime.distributed import initialize

    initialize()
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import multihost_utils

    from stapo_jax.runtime import build
    from stapo_jax.config.schema import load_config
    from stapo_jax.data.prompts import load_prompt_dataset
    from stapo_jax.data.tokenizer import pad_token_id
    from stapo_jax.train.batching import pack_prompt_response
    from stapo_jax.train.policy import response_log_probs_and_entropy
    from stapo_jax.train.sft import gold_response_ids

    cfg = load_config(os.path.join(REPO, "configs", "tiny_cpu.yaml"),
                      ["data.gym.size=64", "data.gym.val_size=6", "reward.num_workers=1"])
    mesh, tok = build.build_mesh(cfg), build.build_tokenizer(cfg)
    model = build.build_model(cfg, mesh, tok, seed=0)
    ex = load_prompt_dataset(cfg, tok, "train").examples[:16]
    b = pack_prompt_response([list(e["prompt_ids"]) for e in ex], [gold_response_ids(e, tok, cfg) for e in ex],
                             pad_id=pad_token_id(tok), vocab_size=model.config.vocab_size)
    graphdef, params = nnx.split(model)
    r = b["response_mask"].shape[1]

    def loss_fn(p, ids, am, rm):
        lp, _ = response_log_probs_and_entropy(nnx.merge(graphdef, p), ids, am, r, seq_chunk=64)
        return -(lp * rm.astype(jnp.float32)).sum()

    from stapo_jax.train.train_step import place_rows

    put = jnp.asarray if mode == "replicated" else (lambda x: place_rows(x, mesh))
    args = (params, *(put(b[k]) for k in ("input_ids", "attention_mask", "response_mask")))
    fn = jax.jit(jax.grad(loss_fn))
    grads = fn(*args)
    leaves = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(grads)]
    hlo = fn.lower(*args).compile().as_text()
    if jax.process_index() == 0:
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)]
        np.savez(out, *leaves, names=np.array(names))
        found = sorted(set(re.findall(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all)\(", hlo)))
        print(f"collectives in the compiled step: {found or 'none'}")


def main() -> int:
    import argparse

    import portpicker

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", choices=("replicated", "sharded"), default="sharded")
    ap.add_argument("--layouts", default=LAYOUTS, help=f"comma-separated NxD[:inproc] (default {LAYOUTS})")
    a = ap.parse_args()

    from stapo_jax.runtime.launch import process_env

    tmp = tempfile.mkdtemp(prefix="sft_grad_layouts_")
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    grads = {}
    for name in a.layouts.split(","):
        shape, _, inproc = name.partition(":")
        n, d = (int(v) for v in shape.split("x"))
        if inproc and n != 1:
            raise SystemExit(f"--layouts {name}: ':inproc' needs one process (N processes need jax.distributed)")
        out = os.path.join(tmp, f"{name.replace(':', '_')}.npz")
        port = portpicker.pick_unused_port()
        envs = [process_env(i, n, port, d, env) for i in range(n)]
        for e in envs:
            e["STAPO_DISTRIBUTED"] = "off" if inproc else "on"
        procs = [subprocess.Popen([sys.executable, __file__, "--child", out, a.batch], env=e) for e in envs]
        if any(p.wait(timeout=900) for p in procs):
            print(f"layout {name} failed")
            return 1
        grads[name] = np.load(out)
    for a, b in itertools.combinations(grads, 2):
        ga, gb = grads[a], grads[b]
        keys = [k for k in ga.files if k != "names"]
        diff = {str(ga["names"][i]): (int((ga[k] != gb[k]).sum()), float(np.abs(ga[k] - gb[k]).max()))
                for i, k in enumerate(keys)}
        bad = {k: v for k, v in diff.items() if v[0]}
        print(f"{a} vs {b}: {sum(v[0] for v in diff.values())} elements differ, max |diff| "
              f"{max(v[1] for v in diff.values()):.3g}" + (f"; leaves {bad}" if bad else ""))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
