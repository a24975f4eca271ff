"""Loss + gradient w.r.t. logits: stapo_jax (jit) vs a tuned PyTorch token-level policy-gradient loss, same
inputs, one process, sides interleaved, median [min..max] of ``--reps`` rounds.

Sides (each returns the loss and leaves the gradient w.r.t. the ``[B, T, V]`` float32 logits):

* ``jax <recipe>`` (default stapo): ``logits_to_log_probs_and_entropy`` + ``compute_token_mask`` (S2T) +
  ``compute_policy_loss``, ``jax.jit(jax.value_and_grad(...))``.
* ``jax justrl``: the same without a token mask (the function the torch side computes).
* ``torch PG``: one ``log_softmax``, ``gather``, the verl dual-clip PPO surrogate, token-mean; ``backward()``.
  The logits tensor is created once (``torch.from_numpy``, no copy) and its ``.grad`` reset each call, so no
  host copy is timed.
* ``torch PG + entropy``: the same plus the entropy as a no-grad diagnostic (what ours also computes).
* ``torch.compile PG`` (``--torch-compile``): the PG side through ``torch.compile``.

Correctness, untimed: ``jax justrl`` equals ``torch PG``; ``jax <recipe>`` equals the eager reference
``tests/torch_reference.py:recipe_loss``. Printed: the machine, the load before/after, every side's median and
spread, and the ratios torch / jax (> 1: jax faster).

    .venv/bin/python bench/bench_loss.py --B 16 --T 512 --V 4096 --reps 5
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import torch_reference as ref  # noqa: E402
from benchutil import (interleaved, load_line, machine_line, pick_torch_threads, ratio, summary,  # noqa: E402
                       use_cli_allocator)

from stapo_jax.algo.logprobs import logits_to_log_probs_and_entropy  # noqa: E402
from stapo_jax.algo.objectives import PolicyLossInputs, compute_policy_loss, safe_divide  # noqa: E402
from stapo_jax.algo.recipes import compute_token_mask  # noqa: E402
from stapo_jax.config.recipes import get_recipe  # noqa: E402


def torch_pg_loss(z, ids, old, adv, resp, c, with_entropy: bool):
    """Token-level PPO dual-clip surrogate (verl ``compute_policy_loss_vanilla``, ``token-mean``) from logits
    ``z`` [B, T, V] float32; ``adv`` [B]; ``resp`` [B, T] float 0/1. Returns the scalar loss (and computes the
    token entropy without gradient when ``with_entropy``)."""
    logp_all = torch.log_softmax(z, dim=-1)
    lp = torch.gather(logp_all, -1, ids.unsqueeze(-1)).squeeze(-1)
    if with_entropy:
        with torch.no_grad():
            _ = -(logp_all.exp() * logp_all).sum(-1)
    a = adv.unsqueeze(-1)
    r = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    l1 = torch.maximum(-a * r, -a * torch.clamp(r, 1 - c.clip_ratio_low, 1 + c.clip_ratio_high))
    l = torch.where(a < 0, torch.minimum(-a * c.clip_ratio_c, l1), l1)
    return (l * resp).sum() / resp.sum().clamp_min(1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--V", type=int, default=4096)
    ap.add_argument("--recipe", default="stapo")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch-compile", action="store_true", help="add a torch.compile side (slow to compile)")
    a = ap.parse_args()
    if a.reps < 3:
        raise SystemExit(f"--reps must be >= 3 for a median with spread (got {a.reps})")
    use_cli_allocator()
    print(machine_line(), flush=True)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(a.B, a.T, a.V)).astype(np.float32) * 3
    ids = rng.integers(0, a.V, (a.B, a.T))
    resp = (np.arange(a.T)[None] < rng.integers(1, a.T + 1, a.B)[:, None]).astype(np.float32)
    adv = rng.normal(size=a.B).astype(np.float32)
    old = (rng.normal(size=(a.B, a.T)) * 0.1 - 8).astype(np.float32)

    def jax_side(recipe):
        c = recipe.loss

        def jloss(z, ids, old, adv, resp):
            lp, ent = logits_to_log_probs_and_entropy(z, ids)
            keep, _ = compute_token_mask(recipe, log_probs=lp, entropy=ent, advantages=adv, response_mask=resp)
            s, d, _ = compute_policy_loss(PolicyLossInputs(old, lp, adv, resp, keep, entropy=ent,
                                                           renormalize=recipe.renormalize), c)
            return safe_divide(s, d)

        return jax.jit(jax.value_and_grad(jloss))

    recipe, justrl = get_recipe(a.recipe), get_recipe("justrl")
    jargs = tuple(map(jnp.asarray, (logits, ids, old, adv, resp)))
    f_rec, f_just = jax_side(recipe), jax_side(justrl)

    z = torch.from_numpy(logits).requires_grad_(True)  # shares memory: no host copy in the timed calls
    t_ids, t_old, t_adv, t_resp = (torch.from_numpy(x) for x in (ids, old, adv, resp))

    def torch_side(fn, with_entropy):
        def run():
            z.grad = None
            loss = fn(z, t_ids, t_old, t_adv, t_resp, justrl.loss, with_entropy)
            loss.backward()
            return loss.item()

        return run

    sides = {
        f"jax {a.recipe}": lambda: jax.block_until_ready(f_rec(*jargs)),
        "jax justrl": lambda: jax.block_until_ready(f_just(*jargs)),
        "torch PG": torch_side(torch_pg_loss, False),
        "torch PG + entropy": torch_side(torch_pg_loss, True),
    }
    if a.torch_compile:
        sides["torch.compile PG"] = torch_side(torch.compile(torch_pg_loss, static_argnums=()), False)

    threads = pick_torch_threads(sides["torch PG"])
    print(f"torch threads: {threads} (the faster of 1 and all cores)")
    # correctness, untimed
    jv_just = float(f_just(*jargs)[0])
    tv_pg = sides["torch PG"]()
    jv_rec = float(f_rec(*jargs)[0])
    c = recipe.loss
    tv_ref = ref.recipe_loss(torch.from_numpy(logits), t_ids, t_old, t_adv, t_resp,
                             clip_ratio_low=c.clip_ratio_low, clip_ratio_high=c.clip_ratio_high,
                             clip_ratio_c=c.clip_ratio_c, loss_agg_mode=c.loss_agg_mode,
                             token_mask=recipe.token_mask, tau_p=recipe.s2t.tau_p,
                             entropy_quantile=recipe.s2t.entropy_quantile,
                             top_ratio=recipe.top_entropy.ratio)[0].item()
    print(f"backend={jax.default_backend()} recipe={a.recipe} B={a.B} T={a.T} V={a.V} fp32; losses: jax justrl "
          f"{jv_just:.6f} vs torch PG {tv_pg:.6f}; jax {a.recipe} {jv_rec:.6f} vs torch reference {tv_ref:.6f}")

    times = interleaved(sides, a.reps)
    for label, ts in times.items():
        print(f"{label:22s} loss+grad {summary(ts)}")
    for j in (f"jax {a.recipe}", "jax justrl"):
        for t in [k for k in times if k.startswith("torch")]:
            print(f"ratio {t} / {j} = {ratio(times[t], times[j])} (median [per-round min..max]; > 1: jax faster)")
    print(load_line("at end"))


if __name__ == "__main__":
    main()
