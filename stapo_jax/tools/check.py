"""``stapo-jax check``: recompute a dumped batch from a PyTorch (verl/TRL) run with our functions and compare.

The dump is a ``.safetensors`` (read with ``safetensors.numpy``) or ``.npz`` file with

* required: ``old_log_probs`` [B, T], ``log_probs`` [B, T], ``advantages`` [B] or [B, T], ``response_mask`` [B, T];
* optional inputs: ``entropy`` [B, T] (read by the ``s2t`` / ``top_entropy`` masks: without it such a
  recipe's token mask is not applied, and the output's last line says so), ``ref_log_probs``
  [B, T] (KL loss), ``rewards`` [B] + ``group_ids`` [B] (recomputes the GRPO advantages and compares them);
* optional reported values (scalars), with or without verl's ``actor/`` prefix: ``loss``, ``pg_loss``,
  ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``, ``entropy_mean``, ``kl_loss``, ``s2t/masked_frac``,
  ``s2t/tau_h``.

It prints ``name | ours | theirs | abs diff | rel diff | ok`` and exits 0 when every compared value is within
``atol + rtol * |theirs|``, 1 otherwise, 2 on a bad file (the message names the missing or misshaped field).
Loss settings, in order of precedence: the command-line flags (verl key names), the settings a dump carries in its
metadata (``stapo_jax.tools.dump``: verl's actor config, e.g. its dual-clip ``clip_ratio_c`` = 3.0 by default in
verl 0.9.1, where the project's recipes use 10), then the ``--recipe`` preset. The token mask's population is the
whole dump (one call: S2T's ``minibatch`` scope when the dump is one mini-batch); ``s2t/tau_h`` is the mask's own
threshold (its ``quantile_tokens`` population), for a recipe without S2T the entropy quantile of all valid tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax.numpy as jnp
import numpy as np

from stapo_jax.algo.advantages import grpo_advantages
from stapo_jax.algo.diagnostics import token_diagnostics
from stapo_jax.algo.masks import get_token_mask
from stapo_jax.algo.objectives import (LOSS_AGG_MODES, KL_TYPES, PolicyLossInputs, finalize_metrics,
                                       get_policy_loss_fn, safe_divide)
from stapo_jax.algo.recipes import compute_token_mask
from stapo_jax.config.recipes import RECIPES, get_recipe
from stapo_jax.train.mask_strategy import TAU_H_METRIC, DiagnosticThresholds, diagnostic_tau_h

__all__ = ["main", "load_dump", "load_dump_settings", "recompute", "compare", "mask_without_entropy",
           "DumpError"]

REQUIRED = ("old_log_probs", "log_probs", "advantages", "response_mask")
REPORTED = ("loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy_mean", "kl_loss",
            "s2t/masked_frac", TAU_H_METRIC)


class DumpError(ValueError):
    """A dump file that is missing, unreadable, or has a missing / misshaped field."""


def _need_file(path: str) -> None:
    if os.path.isdir(path):
        raise DumpError(f"dump {path} is a directory (expected a .safetensors or .npz file)")
    if not os.path.isfile(path):
        raise DumpError(f"dump file not found: {path}")


def load_dump(path: str) -> dict[str, np.ndarray]:
    """Read a ``.safetensors`` or ``.npz`` dump into ``{name: np.ndarray}``; strips verl's ``actor/`` prefix.

    Raises: DumpError for a missing file or an unknown extension.
    Arrays keep the file's dtypes (float32 statistics, float / bool masks, int group ids).
    """
    _need_file(path)
    try:
        if path.endswith(".safetensors"):
            from safetensors.numpy import load_file

            raw = load_file(path)
        elif path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                raw = {k: z[k] for k in z.files}
        else:
            raise DumpError(f"{path}: expected a .safetensors or .npz file")
    except DumpError:
        raise
    except Exception as e:  # safetensors' SafetensorError, zipfile/pickle errors of a corrupt .npz, ...
        raise DumpError(f"{path}: not a readable dump ({type(e).__name__}: {e})") from e
    return {k[len("actor/"):] if k.startswith("actor/") else k: np.asarray(v) for k, v in raw.items()}


def load_dump_settings(path: str) -> dict:
    """The loss settings a ``.safetensors`` dump carries in its metadata (``stapo_jax.tools.dump``:
    ``{verl actor key: value}``, floats / bools / strings / None); ``{}`` for an ``.npz`` or a dump without them.

    Raises: DumpError for a missing file or metadata that is not a JSON mapping of the known keys with values of
    the ``actor`` section's types (``PolicyLossConfig``; the message names the key). Source: verl
    0.9.1 ``actor.yaml`` key names."""
    from stapo_jax.tools.dump import LOSS_SETTING_KEYS, SETTINGS_METADATA_KEY

    _need_file(path)
    if not path.endswith(".safetensors"):
        return {}
    from safetensors import safe_open

    try:
        with safe_open(path, "np") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 (safetensors' own error type)
        raise DumpError(f"{path}: not a readable dump ({type(e).__name__}: {e})") from e
    if SETTINGS_METADATA_KEY not in meta:
        return {}
    try:
        settings = json.loads(meta[SETTINGS_METADATA_KEY])
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: metadata {SETTINGS_METADATA_KEY!r} is not JSON ({e})") from e
    unknown = sorted(set(settings) - set(LOSS_SETTING_KEYS)) if isinstance(settings, dict) else None
    if unknown is None or unknown:
        raise DumpError(f"{path}: metadata {SETTINGS_METADATA_KEY!r} must map {list(LOSS_SETTING_KEYS)} to values, "
                        f"got {settings!r}")
    from typing import get_type_hints

    from stapo_jax.algo.loss_settings import PolicyLossConfig
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.core.settings import coerce

    hints = get_type_hints(PolicyLossConfig)
    try:  # the value types of the actor section ("0.2" as a str, a list or a null float would fail later)
        return {k: coerce(v, hints[k], f"{SETTINGS_METADATA_KEY}.{k}") for k, v in settings.items()}
    except ConfigError as e:
        raise DumpError(f"{path}: metadata {e}") from e


def mask_without_entropy(recipe, d: dict):
    """``(recipe, note)``: the recipe as ``check`` applies it to dump ``d``. A token mask that reads ``entropy``
    (``s2t``, ``top_entropy``) is left out when the dump has no ``entropy`` (an optional field), and ``note`` says
    so (None otherwise): the loss rows then compare the unmasked loss, which is the dumped run's loss for a run
    without that mask (verl / TRL GRPO) or one that masked no token. ``d`` maps name -> np.ndarray; never
    raises. Source: the mask registry's ``needs`` (``stapo_jax.algo.masks.register_token_mask``)."""
    from stapo_jax.algo import masks

    if recipe.token_mask == "none" or "entropy" in d or "entropy" not in masks.get_token_mask(recipe.token_mask).needs:
        return recipe, None
    note = (f"token_mask={recipe.token_mask} not applied: the dump has no 'entropy' (the loss rows are the "
            f"unmasked loss)")
    return recipe.replace(token_mask="none"), note


def _validate(d: dict, need_entropy: bool, need_ref: bool) -> None:
    for name in REQUIRED:
        if name not in d:
            raise DumpError(f"missing field {name!r} (have: {sorted(d)})")
    shape = d["log_probs"].shape
    if len(shape) != 2 or 0 in shape:
        raise DumpError(f"field 'log_probs' must be a non-empty [B, T], got shape {shape}")
    for name in ("old_log_probs", "response_mask", "entropy", "ref_log_probs"):
        if name in d and d[name].shape != shape:
            raise DumpError(f"field {name!r} has shape {d[name].shape}, expected {shape} (as log_probs)")
    if d["advantages"].shape not in ((shape[0],), shape):
        raise DumpError(f"field 'advantages' has shape {d['advantages'].shape}, expected ({shape[0]},) or {shape}")
    if need_entropy and "entropy" not in d:
        raise DumpError("missing field 'entropy' (needed by the recipe's token mask)")
    if need_ref and "ref_log_probs" not in d:
        raise DumpError("missing field 'ref_log_probs' (needed by use_kl_loss)")
    for name in ("rewards", "group_ids"):
        if name in d and d[name].shape != (shape[0],):
            raise DumpError(f"field {name!r} has shape {d[name].shape}, expected ({shape[0]},)")
    if "group_ids" in d and not np.array_equal(d["group_ids"], np.round(d["group_ids"])):
        raise DumpError(f"field 'group_ids' must hold integer group indices, got {d['group_ids'][:8].tolist()}")
    for name in REPORTED:
        if name in d and d[name].size != 1:
            raise DumpError(f"field {name!r} must be a scalar, got shape {d[name].shape}")
    valid = d["response_mask"].astype(bool)
    for name in ("log_probs", "old_log_probs", "entropy", "ref_log_probs", "advantages"):
        if name in d:
            x = d[name] if d[name].shape == shape else d[name][:, None] * np.ones(shape)
            bad = ~np.isfinite(x) & valid
            if bad.any():
                raise DumpError(f"field {name!r} has non-finite values at valid positions, first at "
                                f"{tuple(int(i) for i in np.argwhere(bad)[0])}")


def recompute(d: dict, recipe) -> dict[str, np.ndarray]:
    """Our values for every comparable field of the dump (float64 numpy; x64 is not needed: float32 math).
    Raises: DumpError for a missing / misshaped / non-finite field; ValueError from the loss or mask settings.
    Source: verl ``compute_policy_loss_vanilla`` / ``agg_loss`` names (conventions.md §1)."""
    needs_entropy = recipe.token_mask != "none" and "entropy" in get_token_mask(recipe.token_mask).needs
    _validate(d, needs_entropy, recipe.loss.use_kl_loss)
    f = lambda k: jnp.asarray(d[k], jnp.float32) if k in d else None  # noqa: E731
    lp, old, adv, resp, ent = f("log_probs"), f("old_log_probs"), f("advantages"), f("response_mask"), f("entropy")
    keep, mask_stats = compute_token_mask(recipe, log_probs=lp, entropy=ent, advantages=adv, response_mask=resp,
                                          old_log_probs=old)
    inputs = PolicyLossInputs(old, lp, adv, resp, keep, entropy=ent, ref_log_probs=f("ref_log_probs"),
                              renormalize=recipe.renormalize)
    s, den, m = get_policy_loss_fn(recipe.policy_loss, recipe.extensions)(inputs, recipe.loss)
    fm = finalize_metrics(m, den)
    ours = {"loss": safe_divide(s, den), "pg_loss": fm["pg_loss"], "pg_clipfrac": fm["pg_clipfrac"],
            "ppo_kl": fm["ppo_kl"]}
    for name in ("pg_clipfrac_lower", "kl_loss"):
        if name in fm:
            ours[name] = fm[name]
    if ent is not None:
        ours["entropy_mean"] = fm["entropy"]
        tau = diagnostic_tau_h(recipe, mask_stats, ent, resp)  # S2T's own population, else all valid tokens
        ours[TAU_H_METRIC] = tau
        diag = token_diagnostics(lp, ent, adv, old, resp, keep, tau_p=DiagnosticThresholds.of(recipe).tau_p,
                                 tau_h=tau, clip_ratio_low=recipe.loss.clip_ratio_low,
                                 clip_ratio_high=recipe.loss.clip_ratio_high)
        ours["s2t/masked_frac"] = finalize_metrics({"x": diag["s2t/masked_frac"]})["x"]
    if "rewards" in d and "group_ids" in d:
        a = recipe.advantage
        adv_ours = grpo_advantages(jnp.asarray(d["rewards"], jnp.float32),
                                   jnp.asarray(d["group_ids"]).astype(jnp.int32), epsilon=a.adv_eps, ddof=a.std_ddof,
                                   norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
                                   single_sample="verl")  # the dump comes from verl
        ours["advantages"] = adv_ours if d["advantages"].ndim == 1 else adv_ours[:, None] * resp
    return {k: np.asarray(v, np.float64) for k, v in ours.items()}


def compare(ours: dict, theirs: dict, atol: float, rtol: float) -> tuple[list[tuple], bool]:
    """Rows ``(name, ours, theirs, abs diff, rel diff, ok)`` for names present on both sides (arrays: max diff).
    ours / theirs: ``{name: float64 array}`` (scalars or ``[B]`` / ``[B, T]``). Never raises for matching shapes
    (ValueError from numpy otherwise). Source: ``numpy.isclose``'s ``atol + rtol * |b|`` rule."""
    rows, all_ok = [], True
    for name in [n for n in ("advantages",) + REPORTED if n in ours and n in theirs]:
        a, b = ours[name], np.asarray(theirs[name], np.float64)
        diff = np.abs(a - b)
        ok = bool(np.all(diff <= atol + rtol * np.abs(b)))
        i = int(np.argmax(diff)) if diff.size > 1 else 0
        av, bv = float(a.reshape(-1)[i]), float(b.reshape(-1)[i])
        rel = float(diff.reshape(-1)[i]) / abs(bv) if bv != 0 else (0.0 if av == 0 else float("inf"))
        rows.append((name, av, bv, float(diff.max()), rel, ok))
        all_ok &= ok
    return rows, all_ok


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stapo-jax check", description=__doc__.split("\n\n")[0])
    p.add_argument("dump", help=".safetensors or .npz file")
    p.add_argument("--recipe", default="stapo", choices=sorted(RECIPES))
    p.add_argument("--loss-agg-mode", choices=LOSS_AGG_MODES)
    p.add_argument("--clip-ratio-low", type=float)
    p.add_argument("--clip-ratio-high", type=float)
    p.add_argument("--clip-ratio-c", type=lambda s: None if s.lower() in ("none", "null", "off") else float(s),
                   default=argparse.SUPPRESS, help="dual-clip constant, or 'none'")
    p.add_argument("--loss-scale-factor", type=float)
    p.add_argument("--kl-loss-coef", type=float, help="enables use_kl_loss when > 0")
    p.add_argument("--kl-loss-type", choices=KL_TYPES)
    p.add_argument("--tau-p", type=float)
    p.add_argument("--entropy-quantile", type=float)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--rtol", type=float, default=1e-5)
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry (dispatched by ``stapo-jax check``). Returns 0 (all within tolerance), 1 (beyond), 2 (bad input).
    argv: str arguments; returns the int exit status. Never raises for bad input (prints the error, returns 2).
    Source: the dump layout of ``stapo_jax.tools.dump`` (verl / TRL field names)."""
    args = _parser().parse_args(argv)
    for name in ("atol", "rtol"):
        value = getattr(args, name)
        if not (np.isfinite(value) and value >= 0):  # nan / negative: every row would fail
            print(f"stapo-jax check: error: --{name}={value} must be a finite number >= 0", file=sys.stderr)
            return 2
    try:
        from_dump = load_dump_settings(args.dump)
    except DumpError as e:
        print(f"stapo-jax check: error: {e}", file=sys.stderr)
        return 2
    loss = {k: v for k, v in dict(loss_agg_mode=args.loss_agg_mode, clip_ratio_low=args.clip_ratio_low,
                                  clip_ratio_high=args.clip_ratio_high, loss_scale_factor=args.loss_scale_factor,
                                  kl_loss_type=args.kl_loss_type).items() if v is not None}
    if hasattr(args, "clip_ratio_c"):
        loss["clip_ratio_c"] = args.clip_ratio_c
    if args.kl_loss_coef:
        loss.update(use_kl_loss=True, kl_loss_coef=args.kl_loss_coef)
    loss = {**from_dump, **loss}  # the flags win over the dump's settings, both over the recipe's
    s2t = {k: v for k, v in dict(tau_p=args.tau_p, entropy_quantile=args.entropy_quantile).items() if v is not None}
    try:
        recipe = get_recipe(args.recipe, loss=loss, s2t=s2t)
        dump = load_dump(args.dump)
        recipe, note = mask_without_entropy(recipe, dump)
        ours = recompute(dump, recipe)
    except ValueError as e:
        origin = f" (loss settings from the dump's metadata: {from_dump})" if from_dump else ""
        print(f"stapo-jax check: error: {e}{origin}", file=sys.stderr)
        return 2
    rows, ok = compare(ours, dump, args.atol, args.rtol)
    if not rows:
        print("stapo-jax check: error: nothing to compare: the dump holds none of the reported values "
              f"{REPORTED} (with or without 'actor/'), and no 'rewards' + 'group_ids' to recompute its "
              f"'advantages' from (it holds: {sorted(dump)})", file=sys.stderr)
        return 2
    print(f"{'name':<20} {'ours':>16} {'theirs':>16} {'abs diff':>11} {'rel diff':>11}  ok")
    for name, a, b, ad, rd, good in rows:
        print(f"{name:<20} {a:>16.9g} {b:>16.9g} {ad:>11.3e} {rd:>11.3e}  {'yes' if good else 'NO'}")
    c = recipe.loss
    print(f"recipe={recipe.name} loss_agg_mode={c.loss_agg_mode} clip_ratio_low={c.clip_ratio_low} "
          f"clip_ratio_high={c.clip_ratio_high} clip_ratio_c={c.clip_ratio_c} "
          f"(from the dump: {sorted(from_dump) or 'none'}) atol={args.atol} rtol={args.rtol}: "
          f"{'PASS' if ok else 'FAIL'}")
    if note:
        print(note)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
