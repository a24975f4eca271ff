"""Compiler-independent counts of ``stapo-jax plan``: parameters, ideal per-device bytes, matmul FLOPs, and the
worst-case slot layout of a packed update chosen by tokens (``stapo_jax.train.packing.token_budget_slots``).

Everything here works on the JSON-able plan spec of ``stapo_jax.tools.plan.make_spec``.
"""
from __future__ import annotations

from models.flops import decode_token_flops, layer_matmul_params, sequence_forward_flops

__all__ = ["spec_recipe", "spec_optimizer", "spec_policy_update", "packed_slot_bound", "analytic"]


def spec_recipe(spec: dict):
    """The :class:`~stapo_jax.algo.recipes.Recipe` a plan spec describes (name plus the run's token mask,
    ``actor.token_mask``, the S2T / 20-Entropy scopes, the S2T mini-batch method and, where the spec sets
    ``s2t_stats_policy``, the S2T stats policy). Takes a dict of int / str, returns a Recipe; raises KeyError
    for a spec not from ``make_spec``, ValueError for an unknown recipe name. Source: ``stapo_jax.config.recipes.get_recipe``."""
    from stapo_jax.algo.mask_settings import QUANTILE_SCOPES
    from stapo_jax.config.recipes import get_recipe

    changes = {"token_mask": spec["token_mask"]} if spec.get("token_mask") else {}
    if spec["s2t_scope"] in QUANTILE_SCOPES:
        changes["s2t"] = {"quantile_scope": spec["s2t_scope"],
                          "minibatch_method": spec.get("s2t_minibatch_method", "correction")}
    if spec.get("s2t_stats_policy"):  # plan_run.unit_programs: the correction's usual path
        changes["s2t"] = {**changes.get("s2t", {}), "stats_policy": spec["s2t_stats_policy"]}
    if spec["top_entropy_scope"] in QUANTILE_SCOPES:
        changes["top_entropy"] = {"scope": spec["top_entropy_scope"]}
    return get_recipe(spec["recipe"], **changes)


def spec_optimizer(spec: dict):
    """The run's optimizer from the spec's ``optim`` entry (``train.optim.make_optimizer``, as the trainer's
    ``build_optimizer``). Raises KeyError for a spec not from ``plan.make_spec``."""
    from stapo_jax.train.optim import make_optimizer

    return make_optimizer(**spec["optim"])  # the fields of actor.optim are make_optimizer's keywords


def spec_policy_update(spec: dict, qcfg, mesh, shardings, **chunks):
    """The run's ``train.policy_update.PolicyUpdate`` for the spec, on ``mesh`` with the abstract state's
    ``shardings``; ``chunks``: ``seq_chunk`` / ``vocab_chunk`` overrides (the unit programs'). Its ``programs(k)``
    are the run's jitted update programs (what the planner compiles); its call is not the trainer's (built
    without the run's ``bounded`` / ``long_rows``, which the trainer reads from the run's attention). Raises
    KeyError for a spec not from ``plan.make_spec``. Source: the trainer's ``start_rl``."""
    from stapo_jax.train.policy_update import PolicyUpdate

    chunk = {"seq_chunk": spec["seq_chunk"], "vocab_chunk": spec["vocab_chunk"], **chunks}
    return PolicyUpdate(spec_recipe(spec), spec_optimizer(spec), mesh, temperature=spec["temperature"],
                        vocab_size=qcfg.vocab_size, state_shardings=shardings,
                        mini_rows=spec["mini_batch_sequences"], num_micro_batches=spec["num_micro_batches"],
                        ppo_epochs=spec["ppo_epochs"], packed=spec["use_remove_padding"],
                        sequences_cap=spec["max_sequences"], **chunk)


def packed_slot_bound(mini_rows: int, num_micro_batches: int, num_shards: int, width: int, max_sequences: int,
                      min_tokens: int = 2) -> dict:
    """The largest slot layout ``stapo_jax.train.packing.token_budget_slots`` can return for a mini-batch of
    ``mini_rows`` sequences, whatever their lengths: the ``(K', n_max)`` whose ``S * K' * n_max`` slot rows are
    the most, so the ``[slots, P + R]`` / ``[slots, R]`` batch arrays of any update the trainer runs are at most
    those of this one (and its micro-batches hold the most sequences, ``n_max``, where the cap binds).

    Derivation, for each K' = 1 .. K (S = ``num_shards``, per = ``mini_rows / S``, budget = ``per / K x width``
    tokens, cap = ``max(max_sequences, per / K)``): the S x K' groups of ``packing.lightest_first_groups`` each take one
    of the first S x K' sequences (load 0 comes first), so a group holds at most ``mini_rows - S x K' + 1``; it
    holds at most ``cap`` (skipped when ``S x K' x cap < mini_rows``); its tokens fit the budget (the accepted
    geometry ``M x L`` holds the fullest group), each sequence having >= ``min_tokens`` (a prompt token and the
    first sampled token), so at most ``budget // min_tokens``; and K' is feasible only if
    ``S x K' x budget >= mini_rows x min_tokens``. K' = K is always possible (the equal-count fallback, ``per /
    K`` each). n_max(K') = the least of those; the bound is the K' with the most ``K' x n_max(K')`` (ties: the
    larger n_max).

    Args: mini_rows (sequences per mini-batch), num_micro_batches (the configured K), num_shards (S), width
    (P + R tokens), max_sequences (``actor.sequences_cap()``), min_tokens (fewest tokens of a sequence), ints.
    Returns: ``{"micro_batches": K', "n_max": n_max, "slots": S * K' * n_max, "budget_tokens": budget,
    "sequences_per_padded_micro_batch": per / K}`` (ints).
    Raises: ValueError when K x S does not divide ``mini_rows`` or a size is < 1.
    Source: this project's ``token_budget_slots`` (verl ``use_dynamic_bsz`` in fixed shapes).
    """
    s, k = int(num_shards), int(num_micro_batches)
    if min(mini_rows, k, s, width, max_sequences, min_tokens) < 1 or mini_rows % (k * s):
        raise ValueError(f"packed_slot_bound: mini_rows={mini_rows} must split into num_shards={s} x "
                         f"num_micro_batches={k} (all sizes >= 1)")
    per = mini_rows // s
    m_b = per // k
    budget = m_b * int(width)
    cap = max(int(max_sequences), m_b)
    best = (k * m_b, m_b, -k)  # the equal-count fallback
    for kk in range(1, k + 1):
        if kk < k and (s * kk * cap < mini_rows or s * kk * budget < mini_rows * min_tokens):
            continue
        n = min(cap, mini_rows - s * kk + 1, budget // min_tokens)
        if kk == k:
            n = max(n, m_b)
        best = max(best, (kk * n, n, -kk))
    rows, n_max, kk = best
    kk = abs(kk)
    return {"micro_batches": kk, "n_max": n_max, "slots": s * kk * n_max, "budget_tokens": budget,
            "sequences_per_padded_micro_batch": m_b}


def analytic(spec: dict, qcfg) -> dict:
    """Compiler-independent counts: parameters, ideal per-device bytes (everything divided evenly over the
    shards that hold it) and matmul FLOPs of one update and of one decode step.

    FLOPs (dense, padding included, attention over the full T x T score matrix as the XLA kernel computes it):
    forward per sequence = 2 x (matmul params x T) + 4 x L x T^2 x Nh x H + 2 x D x V x R (LM head on the
    response positions only); an update = forward x (1 pre-pass if any + 1) + 2 x forward (backward) + the
    remat recompute (``full``: the decoder forward again; ``dots_no_batch``: the attention score/value
    matmuls, which have batch dimensions; ``dots``/``none``: none). S2T's ``correction`` method: ``train_flops_per_update`` counts no corrections (its usual
    case), ``train_flops_per_update_max`` every micro-batch redone (+ 1 + remat + 2 forwards). These are the FLOPs the
    hardware runs (HFU's); MFU's model FLOPs are 3 x ``forward_flops_per_sequence`` per sequence
    (``plan_report.predict``).
    Int / float counts; raises KeyError for a spec not from ``make_spec``. Source: Kaplan et al. 2020
    (forward = 2 x params x tokens, backward = 2 x forward)."""
    d, layers = qcfg.hidden_size, qcfg.num_hidden_layers
    nh, nkv, h, v = qcfg.num_attention_heads, qcfg.num_key_value_heads, qcfg.head_dim, qcfg.vocab_size
    layer = layer_matmul_params(qcfg)
    n_params = layers * (layer + 2 * d + 2 * h) + v * d + d + (0 if qcfg.tie_word_embeddings else d * v)
    mesh = spec["mesh"]
    shards = mesh["fsdp"] * mesh["tensor"]
    itemsize = 2 if qcfg.param_dtype in ("bfloat16", "float16") else 4
    p, r = spec["prompt_length"], spec["response_length"]
    t = p + r
    fwd = sequence_forward_flops(qcfg, t, r)
    from stapo_jax.algo.s2t import minibatch_stats_mode

    mode = minibatch_stats_mode(spec_recipe(spec), spec["old_stats"])
    recompute = {"full": 2 * layers * layer * t + 4 * layers * t * t * nh * h,
                 "dots_no_batch": 4 * layers * t * t * nh * h}.get(qcfg.remat, 0)  # remat, per sequence
    grad_passes = 1 + recompute / fwd + 2  # forward (+ recompute) + backward, in forwards
    passes = (1 if mode == "prepass" else 0) + grad_passes
    # S2T correction: XLA counts the compiled conditional, in which every micro-batch is redone (the worst case)
    correction = mode == "correction"
    b = spec["mini_batch_sequences"]
    cache_item = 2 if qcfg.dtype in ("bfloat16", "float16") else 4
    slot_shards = min(spec["decode_slots"], mesh["data"] * mesh["fsdp"])
    kv_shards = slot_shards * (mesh["tensor"] if nkv % mesh["tensor"] == 0 else 1)
    kv = 2 * layers * spec["decode_slots"] * t * nkv * h * cache_item
    decode_fwd = decode_token_flops(qcfg, t)
    return {
        "params": n_params, "params_bytes_ideal": n_params * itemsize / shards,
        "opt_state_bytes_ideal": 2 * n_params * itemsize / shards,
        "kv_cache_bytes_ideal": kv / kv_shards, "kv_cache_total_bytes": kv,
        "train_flops_per_update": float(b * fwd * passes),
        "train_flops_per_update_max": float(b * fwd * (passes + (grad_passes if correction else 0))),
        "forward_flops_per_sequence": float(fwd),
        "decode_flops_per_step": float(spec["decode_slots"] * decode_fwd),
        # one layer's attention scores of one sequence in float32, [heads / tensor shards, T, T]
        "attention_scores_bytes": (nh / (mesh["tensor"] if nh % mesh["tensor"] == 0 else 1)) * t * t * 4,
    }
