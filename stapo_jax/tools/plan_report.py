"""The report of ``stapo-jax plan --target``: every program of the run per phase, the memory resident beside it,
a verdict against the chip's HBM, and a predicted RL step time, labelled as the compiler's prediction.

Memory per phase (per device, the fullest device): the phase's largest program peak (XLA's arguments + outputs -
aliased + temporaries) plus what stays allocated while it runs and is not among its arguments:

* update: + the engine's parameter copy (the engine keeps it between rollouts);
* rollout / eval: + the trainer's parameters and optimizer state (engine parameters and KV cache are the decode
  step's arguments);
* sync: + the trainer's optimizer state and the engine's other layers.

Prediction: per program, the TPU compiler's ``optimal_seconds`` (its cost model of the scheduled program) or,
without it (GPU, or a TPU program it gives none for), the roofline ``max(FLOPs / peak, bytes / HBM bandwidth)``
of XLA's HLO cost analysis (cuDNN calls count no FLOPs there, so the model's analytic FLOPs are used where
larger). XLA's cost analysis counts a loop body once, so the run's own programs (layer scan, micro-batch map,
multi-step decode) are not timed; loop-free unit programs are (``plan_run.unit_programs``: one micro-batch at 1
and 2 unrolled layers, extrapolated to the depth; one decode step). An RL step is predicted as: old-log-prob
passes (x2 with a KL reference) and update steps of K micro-batches at the largest geometry (a full padded
micro-batch: an upper bound), prefill of every sequence at the largest prefill bucket, and decode at the largest
KV-cache length for ``ceil(sequences / slots)`` waves of ``R`` tokens. Not included: host work (rewards,
packing, data), collectives across hosts the compiler does not see (the multi-host weight gather), dispatch gaps,
and the gain of shorter KV buckets. These are compiler predictions, not measurements.
"""
from __future__ import annotations

import math
from typing import Optional

GB = 1000 ** 3
PHASES = ("update", "rollout", "sync", "eval")

__all__ = ["program_seconds", "phase_memory", "slots_that_fit", "unit_seconds", "run_compile_seconds", "predict", "fits_programs", "format_programs"]


def program_seconds(entry: dict, spec: dict, analytic_flops: float = 0.0) -> Optional[float]:
    """Predicted seconds of one compiled program (a ``plan_run.compile_program`` entry) on the spec's target:
    ``optimal_seconds`` when the compiler gives it, else the per-device roofline with ``max(XLA FLOPs,
    analytic_flops / devices)``. Returns a float, or None for a failed program. Never raises for a well-formed
    entry. Source: XLA's cost analysis; the roofline model (Williams et al., 2009)."""
    cost = entry.get("cost")
    if not cost:
        return None
    if cost.get("optimal_seconds"):
        return float(cost["optimal_seconds"])
    t = spec["target"]
    flops = max(cost["flops"], analytic_flops / max(spec["devices"], 1))
    return max(flops / t["peak_flops"], cost["bytes_accessed"] / t["hbm_bandwidth"])


def _roofline(flops: float, bytes_: float, spec: dict) -> float:
    t = spec["target"]
    return max(flops / t["peak_flops"], bytes_ / t["hbm_bandwidth"])


def phase_memory(result: dict) -> dict:
    """``{phase: {"program": name, "peak": bytes, "resident": bytes, "total": bytes}}`` per device for the phases
    present (module docstring). Int bytes; never raises for a ``plan_run.run_programs`` result. Source: XLA
    ``memory_analysis`` per program."""
    res = result["resident"]
    n_layers = result["spec"]["model"]["num_hidden_layers"]
    beside = {"update": res["engine_params"], "rollout": res["trainer_state"], "eval": res["trainer_state"],
              "sync": res["trainer_state"] - res["trainer_params"] + res["engine_params"] * (n_layers - 1) / n_layers}
    out = {}
    for phase in PHASES:
        ok = [e for e in result["programs"] if e["phase"] == phase and "memory" in e]
        if ok:
            top = max(ok, key=lambda e: e["memory"]["peak"])
            extra = int(beside[phase])
            out[phase] = {"program": top["name"], "peak": top["memory"]["peak"], "resident": extra,
                          "total": top["memory"]["peak"] + extra}
    return out


def slots_that_fit(result: dict) -> Optional[int]:
    """The most ``rollout.max_concurrent_decodes`` whose rollout phase fits the target's HBM, from the largest
    decode program: its arguments are the engine's parameters plus a KV cache linear in the slots, so per slot =
    (arguments - engine parameters) / slots, and what is left of HBM after the engine's parameters, the
    program's temporaries and the resident trainer state holds ``left / per slot`` slots (a multiple of the
    engine's data-parallel devices is the caller's to round to). Int, or None without a decode program or HBM.
    Never raises for a ``run_programs`` result. Source: XLA ``memory_analysis`` of the decode step."""
    spec, hbm = result["spec"], result["spec"].get("hbm_gb")
    dec = [e for e in result["programs"] if e["phase"] == "rollout" and e["name"].startswith("decode")
           and "memory" in e]
    if not dec or not hbm:
        return None
    top = max(dec, key=lambda e: e["memory"]["argument"])
    params = result["resident"]["engine_params"]
    per_slot = max(top["memory"]["argument"] - params, 1) / spec["decode_slots"]
    left = hbm * GB - params - top["memory"]["temp"] - result["resident"]["trainer_state"]
    return max(int(left // per_slot), 0)


def run_compile_seconds(result: dict) -> float:
    """Compile seconds of the programs a run compiles (every phase but the prediction units), float. Never raises
    for a ``run_programs`` result. Source: the entries' ``compile_s`` (``plan_run.compile_program``)."""
    return float(sum(e["compile_s"] for e in result["programs"] if e["phase"] != "unit"))


def _named(result: dict, prefix: str) -> Optional[dict]:
    ok = [e for e in result["programs"] if e["name"].startswith(prefix) and "cost" in e]
    return max(ok, key=lambda e: e["memory"]["argument"] + e["memory"]["temp"]) if ok else None


def unit_seconds(result: dict, what: str, analytic_flops_per_layer: float = 0.0,
                 analytic_flops_rest: float = 0.0) -> Optional[float]:
    """Predicted seconds of one micro-batch's ``what`` (``"old log-probs"`` / ``"update step"``) at the run's
    depth from the 1- and 2-layer unit programs: ``t1 + (L - 1) (t2 - t1)`` (``plan_run.unit_programs``). The
    analytic FLOPs (per layer, and of the rest: embedding, LM head) floor the roofline where the compiler gives no
    ``optimal_seconds``, and each layer's increment is at least its analytic FLOPs at the chip's peak (so MFU stays
    at most 1). Float or None (a unit missing or failed); never raises. Source: XLA cost analysis."""
    spec = result["spec"]
    e1, e2 = _named(result, f"unit: {what}, 1 layer"), _named(result, f"unit: {what}, 2 layers")
    if e1 is None or e2 is None:
        return None
    t1 = program_seconds(e1, spec, analytic_flops_rest + analytic_flops_per_layer)
    t2 = program_seconds(e2, spec, analytic_flops_rest + 2 * analytic_flops_per_layer)
    layers = spec["model"]["num_hidden_layers"]
    # a layer costs at least its analytic FLOPs at peak (cuDNN calls count no FLOPs in XLA's GPU analysis)
    floor = analytic_flops_per_layer / max(spec["devices"], 1) / spec["target"]["peak_flops"]
    return max(t1, floor) + (layers - 1) * max(t2 - t1, floor)


def predict(result: dict) -> dict:
    """The predicted RL step (module docstring), from the unit programs: seconds of the old-log-prob passes, the
    update steps, prefill and decode, their sum, update MFU (analytic model FLOPs of an update, forward + backward
    only, over its predicted seconds x chips x bf16 peak), update HFU (the same with every FLOP the update runs:
    S2T's forward pre-pass and the remat recompute too) and decode tokens/s at full slots with its ratio to the
    HBM roofline (engine parameters + KV cache read once per token). Floats; a part whose programs failed is left out. Never raises
    for a ``run_programs`` result. Source: XLA cost analysis; MFU as PaLM (Chowdhery et al., 2022)."""
    spec, a = result["spec"], result["analytic"]
    t = spec["target"]
    k, layers = spec["num_micro_batches"], spec["model"]["num_hidden_layers"]
    out: dict = {}
    mini_batches = spec["rollout_sequences_per_step"] // max(spec["mini_batch_sequences"], 1)
    per_layer = a["forward_flops_per_sequence"] * spec["mini_batch_sequences"] / k / layers
    lp = unit_seconds(result, "old log-probs", per_layer)
    st = unit_seconds(result, "update step", a["train_flops_per_update"] / k / layers)
    if lp is not None and st is not None:
        out["old_log_probs_s"] = lp * k * mini_batches * (2 if spec["use_kl"] else 1)
        out["update_s"] = st * k * spec["updates_per_step"]
        # MFU's model FLOPs: forward + backward = 3 forwards per sequence, no pre-pass or remat recompute (PaLM,
        # Chowdhery et al. 2022, appendix B; as the trainer's perf/update_flops)
        model_flops = 3 * a["forward_flops_per_sequence"] * spec["mini_batch_sequences"]
        out["update_mfu"] = model_flops / (st * k * t["chips"] * t["peak_flops"])
        out["update_hfu"] = a["train_flops_per_update"] / (st * k * t["chips"] * t["peak_flops"])
    dec, pre = _named(result, "unit: decode step x1"), _named(result, "prefill")
    if dec and pre:
        hosts = max(t["hosts"], 1)
        slots = spec["decode_slots"] * hosts
        dec_s = program_seconds(dec, spec, a["decode_flops_per_step"])
        rows = int(pre["name"].split()[1].split("x")[0])
        out["prefill_s"] = program_seconds(pre, spec) * math.ceil(spec["rollout_sequences_per_step"] / (rows * hosts))
        out["decode_s"] = dec_s * math.ceil(spec["rollout_sequences_per_step"] / slots) * spec["response_length"]
        out["decode_tokens_per_s"] = slots / dec_s
        out["decode_roofline_s"] = dec["memory"]["argument"] / t["hbm_bandwidth"]  # weights + KV state, per device
        out["decode_vs_roofline"] = dec_s / out["decode_roofline_s"]
    if all(x in out for x in ("old_log_probs_s", "update_s", "prefill_s", "decode_s")):
        out["step_s"] = out["old_log_probs_s"] + out["update_s"] + out["prefill_s"] + out["decode_s"]
    out["source"] = "TPU compiler optimal_seconds" if t["platform"] == "tpu" else \
        "roofline of XLA GPU cost analysis (flops, bytes) at the chip's peak and HBM bandwidth"
    return out


def fits_programs(result: dict) -> Optional[bool]:
    """True when every phase's total (:func:`phase_memory`) fits the target's HBM and every program compiled;
    False otherwise; None without a known HBM. Never raises for a ``run_programs`` result. Source: XLA
    ``memory_analysis``."""
    hbm = result["spec"].get("hbm_gb")
    if not hbm:
        return None
    if any("error" in e for e in result["programs"]):
        return False
    return all(p["total"] <= hbm * GB for p in phase_memory(result).values())


def _g(x) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def _prediction_lines(result: dict) -> list[str]:
    """The report's predicted-step lines for a ``run_programs`` result (see :func:`predict`)."""
    p = predict(result)
    lines = [""]
    lines.append(f"predicted (compiler prediction, not a measurement; {p['source']}):")
    for key, label in (("old_log_probs_s", "old log-prob passes"), ("update_s", "update steps"),
                       ("prefill_s", "prefill"), ("decode_s", "decode"), ("step_s", "RL step")):
        if key in p:
            lines.append(f"  {label:<22} {p[key]:>10.2f} s")
    if "update_mfu" in p:
        lines.append(f"  update MFU             {100 * p['update_mfu']:>10.1f} % of bf16 peak (model FLOPs: forward + "
                     f"backward; HFU {100 * p['update_hfu']:.1f} % with the pre-pass and remat recompute)")
    if "decode_tokens_per_s" in p:
        lines.append(f"  decode                 {p['decode_tokens_per_s']:>10.0f} tokens/s at full slots, "
                     f"{p['decode_vs_roofline']:.2f}x the HBM roofline (weights + KV once per token)")
    return lines


def format_programs(result: dict) -> str:
    """The human-readable report of a ``plan --target`` result: header (model, mesh, target, compiler), one table
    per phase (compile seconds, argument / temp / peak GB per device, predicted ms, kernels), phase memory with
    the verdict against HBM, the predicted step and the total compile time. Str out; KeyError for a foreign result.
    Source: this module's docstring."""
    spec, a = result["spec"], result["analytic"]
    m, t = spec["model"], spec["target"]
    lines = [
        f"target: {t['name']} ({t['chips']} x {t['chip']}, {t['hbm_gb']:g} GB HBM each, {t['hosts']} host(s)); "
        f"compiler: {result['compiler']}",
        f"model: L={m['num_hidden_layers']} D={m['hidden_size']} params={a['params'] / 1e9:.4g}B dtype={m['dtype']} "
        f"param_dtype={m['param_dtype']} attention={m['attention']} remat={m['remat']}; mesh {spec['mesh']}; "
        f"engine on {result['engine_devices']} device(s) per host",
        f"recipe: {spec['recipe']}; mini-batch {spec['mini_batch_sequences']} x {spec['prompt_length']}+"
        f"{spec['response_length']} tokens, K={spec['num_micro_batches']}, {spec['updates_per_step']} updates per step",
        ""]
    for phase in PHASES + ("unit",):
        rows = [e for e in result["programs"] if e["phase"] == phase]
        if not rows:
            continue
        title = "prediction units (not run)" if phase == "unit" else f"{phase}: {len(rows)} program(s)"
        lines.append(f"{title:<45} compile s   args GB  temp GB  peak GB"
                     f"  predicted ms  kernels")
        for e in rows:
            if "error" in e:
                lines.append(f"  {e['name'][:44]:<44} FAILED: {e['error']}")
                continue
            mem, sec = e["memory"], program_seconds(e, spec)
            kern = ",".join(f"{k}x{v}" for k, v in e["kernels"].items()) or "-"
            lines.append(f"  {e['name'][:44]:<44} {e['compile_s']:>8.1f} {_g(mem['argument']):>9} "
                         f"{_g(mem['temp']):>8} {_g(mem['peak']):>8} {sec * 1e3 if sec else 0:>12.3f}  {kern}"
                         + ("  (cached)" if e.get("cached") else ""))
    lines.append("")
    hbm = spec.get("hbm_gb")
    for phase, pm in phase_memory(result).items():
        verdict = "" if not hbm else (" -> FITS" if pm["total"] <= hbm * GB else " -> DOES NOT FIT") + \
            f" ({100 * pm['total'] / (hbm * GB):.0f}% of {hbm:g} GB)"
        failed_here = sum("error" in e for e in result["programs"] if e["phase"] == phase)
        if failed_here:  # the failed program may be the phase's largest: no verdict from the others
            verdict = f" -> UNKNOWN: {failed_here} program(s) of this phase failed to compile"
        lines.append(f"{phase} phase per device: {_g(pm['total'])} GB = {pm['program']} peak {_g(pm['peak'])} + "
                     f"resident {_g(pm['resident'])}{verdict}")
    fit = slots_that_fit(result)
    if fit is not None:
        lines.append(f"rollout.max_concurrent_decodes that fits the rollout phase: at most {fit} per engine "
                     f"(configured {spec['decode_slots']})")
    failed = [e["name"] for e in result["programs"] if "error" in e]
    if failed:
        lines.append(f"{len(failed)} program(s) failed to compile: {', '.join(failed)}")
    lines += _prediction_lines(result)
    total = sum(e["compile_s"] for e in result["programs"])
    cached = sum(bool(e.get("cached")) for e in result["programs"])
    lines.append(f"compile: {len(result['programs'])} programs, {total:.0f} s in all on this host, of which the run's "
                 f"own programs {run_compile_seconds(result):.0f} s (the rest: prediction units)"
                 + (f"; {cached} taken from --program-cache with their first compile's seconds" if cached else ""))
    return "\n".join(lines)
