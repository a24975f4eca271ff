"""Loss + gradient w.r.t. logits: stapo_jax (jit) vs the PyTorch reference (tests/torch_reference.py, eager), same
inputs, one process. Prints the time ratio.

    .venv/bin/python bench/bench_loss.py --B 16 --T 512 --V 4096
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import torch_reference as ref  # noqa: E402

from stapo_jax.logprobs import logits_to_log_probs_and_entropy  # noqa: E402
from stapo_jax.objectives import compute_policy_loss, safe_divide  # noqa: E402
from stapo_jax.recipes import compute_token_mask, get_recipe  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--V", type=int, default=4096)
    ap.add_argument("--recipe", default="stapo")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(a.B, a.T, a.V)).astype(np.float32) * 3
    ids = rng.integers(0, a.V, (a.B, a.T))
    resp = (np.arange(a.T)[None] < rng.integers(1, a.T + 1, a.B)[:, None]).astype(np.float32)
    adv = rng.normal(size=a.B).astype(np.float32)
    old = (rng.normal(size=(a.B, a.T)) * 0.1 - 8).astype(np.float32)
    recipe = get_recipe(a.recipe)
    c = recipe.loss

    def jloss(z, ids, old, adv, resp):
        lp, ent = logits_to_log_probs_and_entropy(z, ids)
        keep, _ = compute_token_mask(recipe, log_probs=lp, entropy=ent, advantages=adv, response_mask=resp)
        s, d, _ = compute_policy_loss(lp, old, adv, resp, keep, c, entropy=ent, renormalize=recipe.renormalize)
        return safe_divide(s, d)

    f = jax.jit(jax.value_and_grad(jloss))
    jargs = tuple(map(jnp.asarray, (logits, ids, old, adv, resp)))
    jax.block_until_ready(f(*jargs))
    t0 = time.perf_counter()
    for _ in range(a.reps):
        jv, _ = jax.block_until_ready(f(*jargs))
    tj = (time.perf_counter() - t0) / a.reps

    def tstep():
        z = torch.tensor(logits, requires_grad=True)
        loss, _, _ = ref.recipe_loss(z, torch.tensor(ids), torch.tensor(old), torch.tensor(adv), torch.tensor(resp),
                                     clip_ratio_low=c.clip_ratio_low, clip_ratio_high=c.clip_ratio_high,
                                     clip_ratio_c=c.clip_ratio_c, loss_agg_mode=c.loss_agg_mode,
                                     token_mask=recipe.token_mask, tau_p=recipe.s2t.tau_p,
                                     entropy_quantile=recipe.s2t.entropy_quantile, top_ratio=recipe.top_entropy.ratio)
        loss.backward()
        return loss.item()

    tv = tstep()
    t0 = time.perf_counter()
    for _ in range(a.reps):
        tstep()
    tt = (time.perf_counter() - t0) / a.reps
    print(f"backend={jax.default_backend()} recipe={a.recipe} B={a.B} T={a.T} V={a.V}: loss jax {float(jv):.6f} "
          f"torch {tv:.6f}; loss+grad time jax {tj * 1e3:.1f} ms, torch {tt * 1e3:.1f} ms, ratio jax/torch "
          f"= {tj / tt:.2f}")


if __name__ == "__main__":
    main()
