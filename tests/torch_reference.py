"""PyTorch reference implementations, written independently of stapo_jax, following verl's published semantics.

* ``logprobs_from_logits`` / ``entropy_from_logits``: verl ``verl/utils/torch_functional.py``.
* ``grpo_advantage`` / ``rloo_advantage``: verl ``compute_grpo_outcome_advantage`` /
  ``compute_rloo_outcome_advantage`` (python loops over prompt uids, ``torch.std`` unbiased).
* ``agg_loss``: verl ``agg_loss`` with the global values of one mini-batch on one rank (conventions.md §1.1).
* ``compute_policy_loss_vanilla``: verl's clipped surrogate with dual clip (conventions.md §1.2).
* ``kl_penalty``: verl ``kl_penalty`` (conventions.md §1.5).
* ``s2t_mask``: the STAPO paper's S2T rule with ``torch.quantile`` (stapo_spec.md §3).
* ``top_entropy_mask``: ``get_global_entropy_top_mask`` of the official 80/20 code (``torch.topk``).

Used only by tests and benches (parity, ``stapo-jax check`` dumps).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = F.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    z = logits / temperature
    pd = F.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - torch.sum(pd * z, dim=-1)


def grpo_advantage(scores: torch.Tensor, index, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True):
    scores = scores.clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, vals in id2score.items():
        if len(vals) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0, dtype=scores.dtype), torch.tensor(1.0, dtype=scores.dtype)
        else:
            t = torch.stack(vals)
            id2mean[idx], id2std[idx] = torch.mean(t), torch.std(t)
    for i in range(scores.shape[0]):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores


def rloo_advantage(scores: torch.Tensor, index):
    scores = scores.clone()
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, vals in id2score.items():
        id2mean[idx] = torch.tensor(0.0, dtype=scores.dtype) if len(vals) == 1 else torch.mean(torch.stack(vals))
    out = scores.clone()
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return out


def agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    """verl agg_loss, one rank (dp = 1), global values = this batch."""
    if loss_agg_mode == "token-mean":
        n = loss_mask.sum()
        return (loss_mat * loss_mask).sum() / n if n > 0 else (loss_mat * loss_mask).sum() * 0
    seq_sum = torch.sum(loss_mat * loss_mask, dim=-1)
    n_b = loss_mask.sum(-1)
    nonempty = (n_b > 0).to(loss_mat.dtype)
    s = nonempty.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        return (seq_sum * nonempty).sum() / s if s > 0 else seq_sum.sum() * 0
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sum / (n_b + 1e-8) * nonempty).sum() / s if s > 0 else seq_sum.sum() * 0
    if loss_agg_mode == "token-sum":
        return seq_sum.sum()
    factor = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    if loss_agg_mode == "seq-mean-token-sum-norm":  # verl 0.9.1 (PR #4510)
        return (seq_sum * nonempty).sum() / s / factor if s > 0 else seq_sum.sum() * 0
    if loss_agg_mode == "token-sum-norm":  # verl < 0.9.1's seq-mean-token-sum-norm
        return seq_sum.sum() / factor
    raise ValueError(loss_agg_mode)


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                                clip_ratio_c=3.0):
    """Returns the per-token loss matrix and the verl metrics (masked means over ``response_mask``)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    metrics = {
        "pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).to(log_prob.dtype), response_mask),
        "ppo_kl": masked_mean(-negative_approx_kl, response_mask),
        "ratio_mean": masked_mean(ratio, response_mask),
    }
    if clip_ratio_c is None:
        return clip_pg_losses1, metrics
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    metrics["pg_clipfrac_lower"] = masked_mean(
        (torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0)).to(log_prob.dtype), response_mask
    )
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), metrics


def kl_penalty(logprob, ref_logprob, kl_type):
    def forward(kind):
        if kind in ("kl", "k1"):
            return logprob - ref_logprob
        if kind == "abs":
            return (logprob - ref_logprob).abs()
        if kind in ("mse", "k2"):
            return 0.5 * (logprob - ref_logprob).square()
        if kind in ("low_var_kl", "k3"):
            kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
            return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
        raise ValueError(kind)

    if kl_type.endswith("+"):
        back = forward("k2")
        return back - back.detach() + forward(kl_type[:-1]).detach()
    return forward(kl_type)


def quantile(values: torch.Tensor, q: float, method: str) -> torch.Tensor:
    if method in ("linear", "nearest"):
        return torch.quantile(values, q, interpolation=method)
    k = max(1, int(values.numel() * (1 - q) + 0.9999))
    return torch.topk(values, k).values[-1]


def s2t_mask(log_prob, entropy, advantages, response_mask, tau_p=0.002, entropy_quantile=0.8, method="linear",
             quantile_tokens="valid"):
    """Keep mask (valid and not silenced) and tau_h. advantages broadcast to [B, T]."""
    valid = response_mask.bool()
    pop = valid & (advantages > 0) if quantile_tokens in ("positive_adv", "candidates") else valid
    if quantile_tokens == "candidates":  # stapo_spec.md §10 row 3: A > 0 and p < tau_p only
        pop = pop & (torch.exp(log_prob.detach()) < tau_p)
    ent = entropy.detach()
    tau_h = quantile(ent[pop], entropy_quantile, method) if pop.any() else torch.tensor(0.0, dtype=ent.dtype)
    silenced = valid & (advantages > 0) & (torch.exp(log_prob.detach()) < tau_p) & (ent < tau_h)
    return valid & ~silenced, tau_h


def top_entropy_mask(entropy, response_mask, top_ratio=0.2):
    flat_entropy = entropy.detach().flatten()
    flat_mask = response_mask.flatten().bool()
    response_entropy = flat_entropy[flat_mask]
    if response_entropy.numel() == 0:
        return torch.zeros_like(response_mask, dtype=torch.bool)
    top_k = max(1, int(len(response_entropy) * top_ratio + 0.9999))
    _, topk_idx = torch.topk(response_entropy, k=top_k)
    positions = flat_mask.nonzero(as_tuple=False).squeeze(1)[topk_idx]
    out = torch.zeros_like(flat_mask)
    out[positions] = True
    return out.view_as(response_mask)


def recipe_loss(logits, token_ids, old_log_prob, advantages, response_mask, *, temperature=1.0, clip_ratio_low,
                clip_ratio_high, clip_ratio_c, loss_agg_mode, token_mask="none", tau_p=0.002, entropy_quantile=0.8,
                quantile_method="linear", top_ratio=0.2, renormalize=True, entropy_coeff=0.0, ref_log_prob=None,
                kl_loss_coef=0.0, kl_loss_type="low_var_kl", loss_scale_factor=None):
    """The full loss of one mini-batch from logits, verl style: pg - entropy_coeff * H + kl_coef * KL (KL over every
    valid token, as verl's actor ``agg_loss(kld, response_mask)``).

    advantages [B] are broadcast over tokens (verl's ``scores.unsqueeze(-1) * response_mask``).
    Returns (loss, keep_mask, metrics).
    """
    log_prob = logprobs_from_logits(logits, token_ids, temperature)
    entropy = entropy_from_logits(logits, temperature)
    adv = advantages.unsqueeze(-1) * response_mask
    if token_mask == "s2t":
        keep, _ = s2t_mask(log_prob, entropy, adv, response_mask, tau_p, entropy_quantile, quantile_method)
    elif token_mask == "top_entropy":
        keep = top_entropy_mask(entropy, response_mask, top_ratio)
    else:
        keep = response_mask.bool()
    k = keep.to(logits.dtype)
    pg, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, adv, k, clip_ratio_low, clip_ratio_high,
                                              clip_ratio_c)
    if renormalize:
        mat, mask = pg, k
    else:  # masked tokens multiply the loss by 0 but stay in the denominator
        mat, mask = pg * k, response_mask
    loss = agg_loss(mat, mask, loss_agg_mode, loss_scale_factor)
    if entropy_coeff:
        loss = loss - entropy_coeff * agg_loss(entropy * (k if not renormalize else 1), mask, loss_agg_mode,
                                               loss_scale_factor)
    if kl_loss_coef:  # verl's actor: the KL term over every valid token, its own aggregation (the mask is pg-only)
        kl = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
        loss = loss + kl_loss_coef * agg_loss(kl, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, keep, metrics


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
