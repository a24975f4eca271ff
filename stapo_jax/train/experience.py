"""One rollout batch turned into training experience: rollouts -> rewards -> advantages -> packed arrays.

Also DAPO dynamic sampling (drop groups whose rewards are all equal and sample more prompts until the batch
is full, at most ``max_gen_batches`` generation rounds) and held-out accuracy for the trainer's before/after
report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from stapo_jax.algo.advantages import nonzero_variance_groups, overlong_reward_penalty, recipe_advantages
from stapo_jax.train.batching import pack_prompt_response, round_up
from stapo_jax.rollout.driver import FINISH_LENGTH, RolloutBatch
from stapo_jax.runtime.collectives import score_rows
from stapo_jax.runtime import watchdog


@dataclasses.dataclass
class Experience:
    """N = prompts x G rows, packed for the update (``stapo_jax.train.batching`` layout).

    ``arrays``: ``input_ids`` [N, P+R] int32, ``attention_mask`` [N, P+R] bool, ``response_mask`` [N, R] bool,
    ``advantages`` [N] float32, ``rollout_log_probs`` [N, R] float32 (absent for sources without them).
    ``rewards`` [N] float32 (after shaping), ``group_ids`` [N] int32, ``metrics``: scalars of this batch;
    ``filler_rows``: how many of the last rows are fillers (:func:`fill_mini_batches`), 0 for a full batch.
    """

    arrays: dict[str, np.ndarray]
    rewards: np.ndarray
    group_ids: np.ndarray
    metrics: dict[str, float]
    filler_rows: int = 0

    @property
    def num_rows(self) -> int:
        """N, the number of rows (prompts x G), from ``rewards`` [N]."""
        return int(self.rewards.shape[0])


def decode_responses(tokenizer: Any, rollout: RolloutBatch) -> list[str]:
    """Response texts (special tokens stripped), one per row.
    ``rollout.responses`` ``[N, R]`` int32 ids, ``response_lengths`` ``[N]``; returns N strings. Raises what the
    tokenizer's ``decode`` raises."""
    return [tokenizer.decode(rollout.responses[i, :n].tolist(), skip_special_tokens=True)
            for i, n in enumerate(rollout.response_lengths)]


def score_rollout(rollout: RolloutBatch, examples: Sequence[dict], tokenizer: Any, scorer) -> tuple[np.ndarray, dict]:
    """Verifier scores [N] float32 of each row against its prompt's gold, and the scorer's stats. In a
    multi-process job each process scores a share of whole groups and the scores are all-gathered
    (``stapo_jax.runtime.collectives.score_rows``): the result is the same on every process.
    Raises: IndexError / KeyError for a row whose prompt has no example or no ``gold``; the verifier's
    per-row failures are counted in the stats (``n_timeout``, ``n_error``), not raised."""
    watchdog.progress("reward")
    texts = decode_responses(tokenizer, rollout)
    golds = [examples[int(i)]["gold"] for i in rollout.prompt_index]
    return score_rows(texts, golds, scorer, max(rollout.group_size, 1))


def _concat(parts: Sequence[RolloutBatch], offsets: Sequence[int]) -> RolloutBatch:
    width = max(p.responses.shape[1] for p in parts)

    def pad(a, fill):
        return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)

    lps = [p.rollout_log_probs for p in parts]
    return RolloutBatch(
        prompt_index=np.concatenate([p.prompt_index + o for p, o in zip(parts, offsets)]).astype(np.int32),
        responses=np.concatenate([pad(p.responses, 0) for p in parts]),
        response_mask=np.concatenate([pad(p.response_mask, 0) for p in parts]),
        rollout_log_probs=None if any(x is None for x in lps) else np.concatenate([pad(x, 0.0) for x in lps]),
        response_lengths=np.concatenate([p.response_lengths for p in parts]),
        finish_reasons=[f for p in parts for f in p.finish_reasons],
        prompts=[q for p in parts for q in p.prompts])


def _select_groups(ro: RolloutBatch, keep_prompts: np.ndarray, g: int) -> RolloutBatch:
    rows = np.concatenate([np.arange(i * g, (i + 1) * g) for i in keep_prompts]) if len(keep_prompts) else \
        np.zeros((0,), np.int64)
    remap = {int(p): j for j, p in enumerate(keep_prompts)}
    return RolloutBatch(
        prompt_index=np.asarray([remap[int(ro.prompt_index[r])] for r in rows], np.int32),
        responses=ro.responses[rows], response_mask=ro.response_mask[rows],
        rollout_log_probs=None if ro.rollout_log_probs is None else ro.rollout_log_probs[rows],
        response_lengths=ro.response_lengths[rows], finish_reasons=[ro.finish_reasons[r] for r in rows],
        prompts=[ro.prompts[r] for r in rows])


def collect_experience(rollout_source, batches: Iterator[list[dict]], scorer, tokenizer, recipe, *,
                       group_size: int, max_new_tokens: int, seed: int, pad_id: int, sampling=None,
                       max_prompt_length: Optional[int] = None, fixed_response_length: bool = False,
                       compile_phase=None) -> Experience:
    """Sample G responses per prompt, score, shape rewards, compute advantages and pack the batch.

    With ``recipe.sampling.dynamic`` (DAPO), groups whose rewards are all equal are dropped and further
    prompt batches are drawn from ``batches`` until the original number of prompts is reached or
    ``recipe.sampling.max_gen_batches`` rounds have run (then the batch is trimmed to whole prompts that survived;
    the ``sampling/*`` metrics record it).

    Args:
      rollout_source: ``RolloutDriver`` or ``GrpcRolloutClient`` (``generate``).
      batches: the data iterator (lists of example dicts from ``stapo_jax.data.prompts``).
      scorer: ``stapo_jax.rewards.RewardScorer``; recipe: ``stapo_jax.algo.recipes.Recipe``.
      group_size: G; max_new_tokens: response limit (tokens); seed: sampling seed of this step;
      pad_id: padding id; sampling: optional ``SamplingParams`` override;
      max_prompt_length: fixed prompt width P (default: longest prompt rounded up to 64).
      fixed_response_length: R = ``max_new_tokens`` rounded up to 8 for every batch (``build_experience``).
      compile_phase: ``name -> context manager`` (``runtime.compile_stats.CompileStats.phase``): the sampling
        calls run inside ``compile_phase("rollout")``, so their compile time can be told apart (the trainer takes
        it out of ``time/rollout``; ``rollout/tokens_per_s`` leaves out the seconds the context's ``compile_s``
        reports); None: nothing.
    Returns:
      :class:`Experience`.
    Raises:
      RuntimeError: dynamic sampling found no group with non-zero reward variance in ``max_gen_batches`` rounds.
    Dtypes: the Experience's ``input_ids`` int32, masks bool, ``rewards`` float32 [N], ``advantages`` float32 [N,
    R].
    """
    t0 = time.perf_counter()
    examples, parts, offsets, scores_parts, stats_all = [], [], [], [], []
    target, rounds, t_rollout, t_reward, t_compile = None, 0, 0.0, 0.0, 0.0
    while True:
        batch = next(batches)
        target = len(batch) if target is None else target
        t1 = time.perf_counter()
        watchdog.progress("rollout")
        with compile_phase("rollout") if compile_phase is not None else contextlib.nullcontext() as compiled:
            ro = rollout_source.generate([ex["prompt_ids"] for ex in batch], num_samples=group_size,
                                         max_new_tokens=max_new_tokens, seed=seed + 7919 * rounds, sampling=sampling)
        t2 = time.perf_counter()
        t_compile += getattr(compiled, "compile_s", 0.0)  # seconds of this call spent compiling
        scores, stats = score_rollout(ro, batch, tokenizer, scorer)
        t_rollout, t_reward, rounds = t_rollout + t2 - t1, t_reward + time.perf_counter() - t2, rounds + 1
        stats_all.append(stats)
        if recipe.sampling.dynamic:
            gid = ro.prompt_index.astype(np.int32)
            keep_rows = np.asarray(nonzero_variance_groups(scores, gid, num_groups=len(batch)))
            keep_prompts = np.unique(gid[keep_rows])
            ro, scores = _select_groups(ro, keep_prompts, group_size), scores[keep_rows]
            batch = [batch[i] for i in keep_prompts]
        if len(batch):
            offsets.append(len(examples))
            examples.extend(batch)
            parts.append(ro)
            scores_parts.append(scores)
        if not recipe.sampling.dynamic or len(examples) >= target or rounds >= recipe.sampling.max_gen_batches:
            break
    if not examples:
        raise RuntimeError(f"dynamic sampling: every group had equal rewards in {rounds} generation rounds "
                           f"(sampling.max_gen_batches={recipe.sampling.max_gen_batches})")
    ro = _concat(parts, offsets)
    scores = np.concatenate(scores_parts).astype(np.float32)
    if recipe.sampling.dynamic and len(examples) > target:
        ro, scores = _select_groups(ro, np.arange(target), group_size), scores[:target * group_size]
        examples = examples[:target]
    exp = build_experience(ro, scores, recipe, group_size=group_size, max_new_tokens=max_new_tokens,
                           pad_id=pad_id, max_prompt_length=max_prompt_length,
                           fixed_response_length=fixed_response_length)
    n = sum(s["n"] for s in stats_all)
    exp.metrics.update({
        "acc/mean": sum(s["n_correct"] for s in stats_all) / max(n, 1.0),
        "reward/n_timeout": sum(s["n_timeout"] for s in stats_all),
        "reward/n_error": sum(s["n_error"] for s in stats_all),
        "reward/n_unparsed": sum(s.get("n_unparsed", 0.0) for s in stats_all),
        "reward/n_pool_restarts": sum(s.get("n_pool_restarts", 0.0) for s in stats_all),
        "sampling/gen_rounds": float(rounds), "sampling/prompts": float(len(examples)),
        "time/rollout": t_rollout, "time/reward": t_reward, "time/experience": time.perf_counter() - t0,
        # generated tokens per second of sampling, compile time left out (as the trainer's time/rollout)
        "rollout/tokens_per_s": float(ro.response_lengths.sum()) / max(t_rollout - t_compile, 1e-9),
    })
    return exp


def build_experience(ro: RolloutBatch, scores: np.ndarray, recipe, *, group_size: int, max_new_tokens: int,
                     pad_id: int, max_prompt_length: Optional[int] = None,
                     fixed_response_length: bool = False) -> Experience:
    """Rewards (+ DAPO overlong shaping) -> advantages -> packed arrays for :class:`Experience`.

    Truncated rows (finish reason ``length``) get an all-zero response mask when ``recipe.drop_truncated``.
    R is the longest response rounded up to 64 (at most ``max_new_tokens`` rounded up to 8), or with
    ``fixed_response_length`` always the latter (one shape for every batch); P is ``max_prompt_length`` when given.
    Raises:
      ValueError: see ``stapo_jax.train.batching.pack_prompt_response``.
    scores: [N] float32 verifier scores; the arrays are int32 ids, bool masks, float32 advantages [N, R]. Source:
    stapo_spec.md §2, §5 (DAPO overlong shaping), verl's batch layout.
    """
    lengths = ro.response_lengths.astype(np.int32)
    rewards = scores + np.asarray(overlong_reward_penalty(
        lengths, max_response_length=max_new_tokens, overlong_buffer_len=recipe.overlong.overlong_buffer_len,
        penalty_factor=recipe.overlong.overlong_penalty))
    gid = ro.prompt_index.astype(np.int32)
    num_groups = int(gid.max()) + 1
    adv = np.asarray(recipe_advantages(recipe.advantage, rewards, gid, num_groups=num_groups,
                                       extensions=recipe.extensions), np.float32)
    responses = [ro.responses[i, :n].tolist() for i, n in enumerate(lengths)]
    R = round_up(max_new_tokens, 8)  # fixed_response_length: one R for every batch (trainer.precompile)
    if not fixed_response_length:
        R = min(round_up(int(lengths.max()), 64), R)
    P = max_prompt_length or round_up(max(len(p) for p in ro.prompts), 64)
    arrays = pack_prompt_response([np.asarray(p).tolist() for p in ro.prompts], responses, pad_id=pad_id,
                                  prompt_length=P, response_length=R)
    truncated = np.asarray([f == FINISH_LENGTH for f in ro.finish_reasons])
    if recipe.drop_truncated:
        arrays["response_mask"][truncated] = False
    out = {k: arrays[k] for k in ("input_ids", "attention_mask", "response_mask")}
    out["advantages"] = adv
    if ro.rollout_log_probs is not None:
        lp = np.zeros(arrays["response_mask"].shape, np.float32)
        w = min(R, ro.rollout_log_probs.shape[1])
        lp[:, :w] = ro.rollout_log_probs[:, :w]
        out["rollout_log_probs"] = lp * arrays["response_mask"]
    metrics = {
        "reward/mean": float(rewards.mean()), "reward/score_mean": float(scores.mean()),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/clip_frac": float(truncated.mean()),
        "advantages/mean": float(adv.mean()), "advantages/abs_mean": float(np.abs(adv).mean()),
        "advantages/zero_group_frac": float((np.abs(adv) == 0).mean()),
    }
    return Experience(arrays=out, rewards=rewards.astype(np.float32), group_ids=gid, metrics=metrics)


def heldout_accuracy(rollout_source, examples: Sequence[dict], tokenizer, scorer, *, max_new_tokens: int,
                     batch_size: int = 256, seed: int = 0, progress: bool = False, desc: str = "held-out") -> float:
    """Greedy-decoding accuracy (fraction of verifier-correct answers) on ``examples``.

    Args:
      examples: prompts with ``prompt_ids`` and the verifier's fields; batch_size: prompts per generate call.
      progress: show a tqdm bar ``desc`` on stderr (problems scored, running accuracy, ETA), on JAX process 0
        only (``stapo_jax.train.metrics.progress_bar``); off by default, so tests stay quiet.
    Returns:
      accuracy in [0, 1] (float).
    Raises:
      ValueError: no examples.
    """
    from stapo_jax.rollout.sampling import SamplingParams
    from stapo_jax.train.metrics import progress_bar

    if not examples:
        raise ValueError("held-out accuracy needs at least one example (data.val_files / data.gym.val_size)")
    correct, done = 0.0, 0
    with progress_bar(len(examples), desc, unit="problem", enabled=progress) as bar:
        for start in range(0, len(examples), batch_size):
            chunk = list(examples[start:start + batch_size])
            ro = rollout_source.generate([ex["prompt_ids"] for ex in chunk], num_samples=1,
                                         max_new_tokens=max_new_tokens, seed=seed,
                                         sampling=SamplingParams(greedy=True))
            _, stats = score_rollout(ro, chunk, tokenizer, scorer)
            correct += stats["n_correct"]
            done += len(chunk)
            bar.set_postfix(acc=f"{correct / done:.4f}", refresh=False)
            bar.update(len(chunk))
    return correct / len(examples)


def fill_mini_batches(exp: Experience, mini_rows: int) -> Experience:
    """``exp`` with filler rows appended until its row count is a multiple of ``mini_rows``: DAPO dynamic
    sampling that reaches ``sampling.max_gen_batches`` keeps only the groups it found, which may not fill the last
    (or only) mini-batch, while the update's shapes need whole mini-batches (K micro-batches x data-parallel
    shards). A filler is a copy of a real row (a real attention pattern, so the forward stays finite) with an
    all-zero ``response_mask``, zero ``advantages``, zero ``rollout_log_probs`` and reward 0, in group -1: it adds
    nothing to any loss sum, denominator (token counts and the seq-mean modes' non-empty rows), mask threshold
    population or metric of the update, so the step equals an update on the real rows alone.

    Args: exp: rows N (``arrays`` [N, ...] numpy); mini_rows: global rows per mini-batch (>= 1).
    Returns: a new :class:`Experience` with ``N + f`` rows, ``f = (-N) mod mini_rows`` (the same arrays when
    ``f == 0``), ``metrics["sampling/filler_rows"] = f`` and ``filler_rows = f`` (the trainer's token counts leave
    them out). Dtypes kept (int32 ids, bool masks, float32 advantages / rewards, int32 group ids).
    Raises: ValueError for ``mini_rows < 1`` or an experience without rows.
    Source: this project's reading of DAPO dynamic sampling (docs/stapo_spec.md item 8); verl instead stops the
    run when ``max_num_gen_batches`` is reached without a full batch."""
    if mini_rows < 1:
        raise ValueError(f"fill_mini_batches: mini_rows={mini_rows} must be >= 1")
    n = exp.num_rows
    if n < 1:
        raise ValueError("fill_mini_batches: the experience has no rows to copy")
    f = (-n) % mini_rows
    if f == 0:
        return dataclasses.replace(exp, metrics={**exp.metrics, "sampling/filler_rows": 0.0})
    src = np.arange(f) % n
    zeroed = ("response_mask", "advantages", "rollout_log_probs")
    arrays = {}
    for key, v in exp.arrays.items():
        if getattr(v, "shape", ())[:1] != (n,):
            arrays[key] = v
            continue
        extra = np.zeros_like(v[src]) if key in zeroed else v[src]
        arrays[key] = np.concatenate([v, extra])
    return dataclasses.replace(
        exp, arrays=arrays, rewards=np.concatenate([exp.rewards, np.zeros(f, exp.rewards.dtype)]),
        group_ids=np.concatenate([exp.group_ids, np.full(f, -1, exp.group_ids.dtype)]),
        metrics={**exp.metrics, "sampling/filler_rows": float(f)}, filler_rows=exp.filler_rows + f)
