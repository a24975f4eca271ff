"""Benchmark evaluation (``stapo-jax eval``): avg@N and unbiased pass@k on the paper's six maths benchmarks in
both decoding settings, with a results table laid out like the paper's Table 2 (stapo_spec §8-9).

Protocol (stapo_spec §8): AIME24, AIME25, AMC23 at avg@32; MATH-500, Minerva, OlympiadBench at avg@4; setting
(a) T=1.0 / top-p=1.0 and setting (b) T=0.7 / top-p=0.9; at most ``eval.max_new_tokens`` (31,744) new tokens;
**Avg** is the unweighted mean of the benchmarks. Every number records the grader that produced it
(``math_verify``: math-verify, gold first; ``boxed_exact``: JustRL's strict-box string match). The paper
additionally used CompassVerifier-3B, so our scores may come out slightly lower.

The pieces are separable so tests and the trainer can use them without a model:

* :func:`load_problems` reads a benchmark (a name in :data:`BENCHMARKS`, looked up in ``eval.data_dir``; a
  JSONL/JSON/parquet path; or an HF dataset id ``owner/name[:split]``);
* :func:`format_prompts` applies the training prompt format (chat template + JustRL suffix, ``data.*``);
* a *generator* ``generate(prompts, *, num_samples, setting, max_new_tokens, seed)`` returns, per prompt,
  ``num_samples`` completions (``str`` or :class:`Completion`). :func:`engine_generator` builds one over the
  rollout driver (``stapo_jax.rollout.driver.RolloutDriver``); tests inject fakes;
* :func:`evaluate` runs benchmarks x settings and returns an :class:`EvalReport`, which writes
  ``results.json`` and ``results.md`` (:meth:`EvalReport.write`).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from stapo_jax.tools.eval_problems import HF_BENCHMARK_IDS, format_prompts, load_problems
from stapo_jax.tools.eval_protocol import (BENCHMARKS, COLUMNS, METHOD_NAMES, PAPER_TABLE2, SETTINGS, BenchmarkSpec,
                                     Completion, DecodingSetting, EvalDataError, Generator, Grader, Problem)
from stapo_jax.tools.eval_report import BenchmarkResult, EvalReport
from stapo_jax.tools.passk import avg_at_n, default_ks, mean_pass_at_k

log = logging.getLogger(__name__)

__all__ = ["BenchmarkSpec", "BENCHMARKS", "DecodingSetting", "SETTINGS", "COLUMNS", "PAPER_TABLE2",
           "METHOD_NAMES", "HF_BENCHMARK_IDS", "EvalDataError", "Problem", "Completion", "Generator", "Grader",
           "BenchmarkResult", "EvalReport", "load_problems", "format_prompts", "evaluate", "evaluate_benchmark",
           "engine_generator", "make_graders", "main"]


def _seed(base: int, benchmark: str, setting: str) -> int:
    """A per-(benchmark, setting) seed, stable across runs and Python versions."""
    return (int(base) * 1_000_003 + zlib.crc32(f"{benchmark}/{setting}".encode())) % (2 ** 31)


def evaluate_benchmark(name: str, problems: Sequence[Problem], prompts: Sequence[str], generate: Generator,
                       graders: Mapping[str, Grader], *, setting: DecodingSetting, n_samples: int,
                       max_new_tokens: int, seed: int = 0, column: Optional[str] = None,
                       samples_out: Optional[Any] = None) -> BenchmarkResult:
    """Sample ``n_samples`` responses per problem, grade them and compute avg@N and pass@k.

    Args:
      name: benchmark name; column: its table column (default: the registry's, else ``name``).
      problems, prompts: P problems and their formatted prompts (same order).
      generate: the generator (see :class:`Generator`).
      graders: ordered ``{name: grader}``; the first produces the reported numbers, the others are recorded
        in ``other_graders``. A grader maps (responses, golds) to N scores (0/1 or -1/+1), or to
        ``(scores, stats)`` as :class:`stapo_jax.rewards.RewardScorer` does; a sample is correct when its
        score is > 0.
      setting, n_samples, max_new_tokens, seed: decoding.
      samples_out: optional text file; one JSON line per sample (benchmark, setting, problem, sample,
        response, scores) is written to it.
    Returns:
      :class:`BenchmarkResult`.
    Raises:
      ValueError: mismatched problems/prompts, ``n_samples`` < 1, no grader, or a generator that returned the
        wrong number of prompts/samples (named).

    Shapes / dtypes: P prompts (str) and P problems; the generator returns P groups of ``n_samples`` completions;
    each grader gives N = P * n_samples float scores (stored as float64 [N]); ``avg_at_n`` and ``pass_at_k`` are
    float percentages (0..100); ``correct`` is P int counts. Source: the paper's avg@N protocol (Table 2) and the
    unbiased pass@k estimator of Chen et al. 2021 (:func:`stapo_jax.tools.passk.mean_pass_at_k`).
    """
    if len(problems) != len(prompts):
        raise ValueError(f"{name}: {len(problems)} problems but {len(prompts)} prompts")
    if n_samples < 1:
        raise ValueError(f"{name}: n_samples={n_samples} must be >= 1")
    if not graders:
        raise ValueError(f"{name}: no grader given")
    t0 = time.perf_counter()
    outs = generate(list(prompts), num_samples=n_samples, setting=setting, max_new_tokens=max_new_tokens,
                    seed=seed)
    if len(outs) != len(problems):
        raise ValueError(f"{name}: the generator returned {len(outs)} prompt results for {len(problems)} prompts")
    comps: list[Completion] = []
    for i, group in enumerate(outs):
        if len(group) != n_samples:
            raise ValueError(f"{name}: the generator returned {len(group)} samples for prompt {i}, "
                             f"expected {n_samples}")
        comps.extend(c if isinstance(c, Completion) else Completion(str(c)) for c in group)
    texts = [c.text for c in comps]
    golds = [p.answer for p in problems for _ in range(n_samples)]
    scores, grader_stats = {}, {}
    for g, fn in graders.items():
        out = fn(texts, golds)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
            out, grader_stats[g] = out[0], {k: float(v) for k, v in out[1].items()
                                            if k in ("n_timeout", "n_error", "n_unparsed", "time_s")}
        scores[g] = np.asarray(out, np.float64)
    for g, s in scores.items():
        if s.shape != (len(texts),):
            raise ValueError(f"{name}: grader {g} returned {s.shape} scores for {len(texts)} responses")
    correct = {g: (s > 0).reshape(len(problems), n_samples) for g, s in scores.items()}
    primary = next(iter(graders))
    counts = correct[primary].sum(axis=1).astype(int).tolist()
    toks = [c.num_tokens for c in comps if c.num_tokens is not None]
    trunc = [c.truncated for c in comps if c.truncated is not None]
    if samples_out is not None:
        for j, c in enumerate(comps):
            q, n = divmod(j, n_samples)
            samples_out.write(json.dumps({
                "benchmark": name, "setting": setting.name, "problem": problems[q].index, "sample": n,
                "answer": problems[q].answer, "response": c.text, "num_tokens": c.num_tokens,
                "truncated": c.truncated, "scores": {g: float(s[j]) for g, s in scores.items()}}) + "\n")
    return BenchmarkResult(
        benchmark=name, column=column or (BENCHMARKS[name].column if name in BENCHMARKS else name),
        setting=setting.name, temperature=setting.temperature, top_p=setting.top_p,
        num_problems=len(problems), n_samples=n_samples, max_new_tokens=max_new_tokens, grader=primary,
        avg_at_n=avg_at_n(correct[primary]),
        pass_at_k={k: mean_pass_at_k(n_samples, counts, k) for k in default_ks(n_samples)},
        correct=counts,
        mean_response_tokens=float(np.mean(toks)) if toks else None,
        truncated_frac=float(np.mean(trunc)) if trunc else None,
        seconds=time.perf_counter() - t0,
        other_graders={g: avg_at_n(c) for g, c in correct.items() if g != primary},
        grader_stats=grader_stats)


def evaluate(benchmarks: Mapping[str, tuple[Sequence[Problem], Sequence[str]]], generate: Generator,
             graders: Mapping[str, Grader], *, settings: Sequence[DecodingSetting] = tuple(SETTINGS.values()),
             n_samples: Union[int, Mapping[str, int], None] = None, max_new_tokens: int = 31744, seed: int = 0,
             label: str = "ours", meta: Optional[dict] = None, out_dir: Optional[Union[str, os.PathLike]] = None,
             paper_rows: Sequence[tuple[str, str]] = (), save_samples: bool = False,
             progress: Optional[Any] = None) -> EvalReport:
    """Evaluate every benchmark in every decoding setting.

    Args:
      benchmarks: ``{name: (problems, prompts)}`` in column order.
      generate, graders: see :func:`evaluate_benchmark`.
      settings: decoding settings (default (a) and (b)).
      n_samples: samples per problem: one int for all, a ``{name: N}`` mapping (missing names fall back to
        the registry), or None = the paper's N (32 / 4; 4 for unknown benchmarks).
      max_new_tokens, seed: decoding; each (benchmark, setting) gets its own seed derived from ``seed``.
      label, meta, paper_rows: see :class:`EvalReport`.
      out_dir: if set, ``results.json``/``results.md`` are rewritten after every benchmark (a long run that
        dies keeps what it finished), and ``samples.jsonl`` holds every response with ``save_samples``.
      progress: an optional progress bar (:func:`stapo_jax.train.metrics.progress_bar`); its postfix shows the
        benchmark being evaluated and the last avg@N (the generator advances it, see :func:`engine_generator`).
    Returns:
      The :class:`EvalReport`.
    Raises:
      ValueError: see :func:`evaluate_benchmark`; an unknown paper row.
    """
    for key in paper_rows:
        if tuple(key) not in PAPER_TABLE2:
            raise ValueError(f"paper row {key!r} not in PAPER_TABLE2 (models 1.7B/8B/14B x {list(METHOD_NAMES)})")
    report = EvalReport(label=label, meta=dict(meta or {}), paper_rows=[tuple(k) for k in paper_rows])
    report.meta.setdefault("graders", list(graders))
    sample_file = None
    if out_dir is not None and save_samples:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        sample_file = open(Path(out_dir) / "samples.jsonl", "w")
    try:
        for setting in settings:
            for name, (problems, prompts) in benchmarks.items():
                n = _n_for(name, n_samples)
                log.debug("eval %s setting %s (%s): %d problems x %d samples", name, setting.name, setting.label,
                         len(problems), n)
                if progress is not None:
                    progress.set_description(f"eval {name} ({setting.name})")
                res = evaluate_benchmark(name, problems, prompts, generate, graders, setting=setting,
                                         n_samples=n, max_new_tokens=max_new_tokens,
                                         seed=_seed(seed, name, setting.name), samples_out=sample_file)
                report.results.append(res)
                # the progress bar shows it; with progress=None (e.g. from the trainer) the log line does
                (log.debug if progress is not None else log.info)(
                    "eval %s setting %s: avg@%d = %.2f (%s)", name, setting.name, n, res.avg_at_n, res.grader)
                if progress is not None:
                    progress.set_postfix({f"last done: {name}/{setting.name} avg@{n}": f"{res.avg_at_n:.2f}"})
                if out_dir is not None:
                    report.write(out_dir)
    finally:
        if sample_file is not None:
            sample_file.close()
    return report


def _n_for(name: str, n_samples: Union[int, Mapping[str, int], None]) -> int:
    if isinstance(n_samples, int):
        return n_samples
    if isinstance(n_samples, Mapping) and name in n_samples:
        return int(n_samples[name])
    return BENCHMARKS[name].n_samples if name in BENCHMARKS else 4


# ------------------------------------------------------------------------------------------- graders


def make_graders(names: Sequence[str], *, timeout_s: float = 10.0, num_workers: int = 4) -> dict[str, Grader]:
    """Graders by name, each over a :class:`stapo_jax.rewards.RewardScorer` scoring 0/1 and returning
    ``(scores, stats)`` (call ``.close()`` when done: pooled graders own worker processes).

    ``math_verify``: math-verify with the gold answer first behind the final-answer policy and magnitude-safe
    comparison of ``reward.kind: math_verify_strict`` (issue 13), in a process pool with a per-item timeout (a
    timeout or crash scores 0 and is counted in the stats). ``boxed_exact``: JustRL's strict-box exact string
    match (the last ``\\boxed{}`` in the final 100 of the last 300 characters; stapo_spec §2).

    Raises:
      ValueError: an unknown grader name.

    Names are str, ``timeout_s`` float seconds, ``num_workers`` an int; each grader returns
    ``(scores [N] float32, stats)``. Source: math-verify (gold first) and JustRL / verl ``math_dapo`` strict-box
    match.
    """
    from stapo_jax.rewards import RewardScorer

    out: dict[str, Grader] = {}
    for name in names:
        if name not in GRADER_KINDS:
            raise ValueError(f"unknown grader {name!r}; expected one of {sorted(GRADER_KINDS)}")
        out[name] = _ScorerGrader(RewardScorer(GRADER_KINDS[name], timeout_s=timeout_s, num_workers=num_workers))
    return out


GRADER_KINDS = {"math_verify": "math_verify_strict", "boxed_exact": "boxed_exact_01"}


class _ScorerGrader:
    """``(responses, golds) -> (scores, stats)`` over a RewardScorer. With N JAX processes each grades a
    contiguous share of the rows and the scores are all-gathered (``runtime.collectives.score_rows``; a collective:
    every process calls it on the same rows); ``time_s`` is then not reported."""

    def __init__(self, scorer):
        self.scorer = scorer

    def __call__(self, responses, golds):
        from stapo_jax.runtime.collectives import score_rows

        return score_rows(list(responses), list(golds), self.scorer)

    def close(self):
        self.scorer.close()


# ---------------------------------------------------------------------------------------- generation


def engine_generator(driver: Any, tokenizer: Any, *, batch_prompts: Optional[int] = None,
                     on_progress: Optional[Callable[[int], Any]] = None) -> Generator:
    """A :class:`Generator` over the in-process rollout driver (``stapo_jax.rollout.driver.RolloutDriver``).

    Prompts are tokenized without special tokens (the chat template already holds them), sampled with
    ``SamplingParams(temperature, top_p)`` of the setting (full-vocabulary log-probs, top-k off), and
    decoded with special tokens removed.

    Args:
      driver: the rollout driver (its engine's ``max_decode_length`` must be >= ``max_new_tokens``).
      tokenizer: the transformers tokenizer of the model.
      batch_prompts: prompts per ``driver.generate`` call (None = all at once); smaller bounds host memory.
      on_progress: called with the number of prompts finished after every ``driver.generate`` call (e.g. a
        progress bar's ``update``).
    Returns:
      The generator function.

    The generator returns P lists (str prompts in) of ``num_samples`` :class:`Completion`
    (str text, int num_tokens, bool truncated); it reads the driver's int32 ``responses`` [P*G, T] and
    ``response_lengths`` [P*G]. Building it never raises; the generator raises ``RolloutInputError`` (ValueError)
    from the driver for a bad ``num_samples`` / ``max_new_tokens``. Source: HF transformers ``generate`` sampling
    (temperature, top_p) and ``decode(skip_special_tokens=True)``.
    """
    from stapo_jax.rollout.sampling import SamplingParams

    def generate(prompts, *, num_samples, setting, max_new_tokens, seed):
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        sampling = SamplingParams(temperature=setting.temperature, top_p=setting.top_p)
        step = batch_prompts or len(ids)
        out = []
        for start in range(0, len(ids), step):
            chunk = ids[start:start + step]
            batch = driver.generate(chunk, num_samples=num_samples, max_new_tokens=max_new_tokens,
                                    seed=seed + start, sampling=sampling)
            for i in range(len(chunk)):
                group = []
                for r in range(i * num_samples, (i + 1) * num_samples):
                    n = int(batch.response_lengths[r])
                    text = tokenizer.decode(batch.responses[r, :n].tolist(), skip_special_tokens=True)
                    group.append(Completion(text, n, batch.finish_reasons[r] == "length"))
                out.append(group)
            if on_progress is not None:
                on_progress(len(chunk))
        return out

    return generate


# ------------------------------------------------------------------------------------------------ CLI


def body_overrides(cfg) -> dict:
    """The ``model.*`` size fields set explicitly next to ``model.preset`` (e.g. a toy body under Qwen3-0.6B's
    vocabulary, ``configs/gsm8k_tiny.yaml``), vocabulary and RoPE fields excluded: {key: int}. Never
    raises. Source: ``stapo_jax.config.schema.MODEL_SIZE_KEYS``."""
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim")
    return {k: getattr(cfg.model, k) for k in keys if getattr(cfg.model, k) is not None}


def random_init_label(cfg) -> str:
    """How results of a model with no ``model.path`` are labelled: ``"Qwen3-0.6B (random init)"``, or with an
    overridden body ``"Qwen3-0.6B vocabulary, 1 layer(s) x hidden_size 32 (random init)"`` so that a toy model is
    never reported under the preset's name. Returns a str; never raises. Source: this project's eval
    report."""
    m, body = cfg.model, body_overrides(cfg)
    if not body:
        return f"{m.preset or 'from-scratch'} (random init)"
    layers = body.get("num_hidden_layers", "?")
    size = body.get("hidden_size", "?")
    base = f"{m.preset} vocabulary, " if m.preset else "from-scratch, "
    return f"{base}{layers} layer(s) x hidden_size {size} (random init)"


def _paper_size(cfg) -> Optional[str]:
    """"1.7B" / "8B" / "14B" when ``model.path`` or ``model.preset`` names one of the paper's sizes, else None."""
    import re

    if not cfg.model.path and body_overrides(cfg):
        return None  # a preset's name with a body of other sizes is not that model
    name = f"{cfg.model.path or ''} {cfg.model.preset or ''}".lower()
    m = re.search(r"(?<![\d.])(1\.7|8|14)b(?![a-z0-9])", name)
    return f"{m.group(1)}B" if m else None


def build_parser() -> argparse.ArgumentParser:
    """The command's ``argparse`` parser (see the module docstring for the options).

    Returns an ``argparse.ArgumentParser`` (str / int / bool options); building it never raises
    (parsing bad arguments exits 2). Source: the project CLI convention (verl-style dotted overrides).
    """
    p = argparse.ArgumentParser(
        prog="stapo-jax eval",
        description="Evaluate a Qwen3 checkpoint on AIME24/AIME25/AMC23 (avg@32) and MATH-500/Minerva/"
                    "OlympiadBench (avg@4) in both decoding settings; writes results.json and results.md "
                    "(Table 2 layout).")
    p.add_argument("overrides", nargs="*", help="dotted config overrides key.sub=value (e.g. model.path=DIR)")
    p.add_argument("--config", help="run config YAML (default: schema defaults)")
    p.add_argument("--model", help="HF checkpoint directory or hub id (sets model.path, clears model.preset)")
    p.add_argument("--benchmarks", help="comma-separated names, paths or HF ids (default eval.benchmarks)")
    p.add_argument("--limit", type=int, help="first N problems of each benchmark (smoke test)")
    p.add_argument("--settings", default="a,b",
                   help="decoding settings: a (T 1.0/top-p 1.0), b (T 0.7/top-p 0.9), config "
                        "(eval.temperature/top_p); comma-separated; default a,b")
    p.add_argument("--n-samples", type=int, help="samples per problem for every benchmark (default eval.n_samples)")
    p.add_argument("--max-new-tokens", type=int, help="default eval.max_new_tokens (31744)")
    p.add_argument("--graders", help="comma-separated: math_verify, boxed_exact; the first is reported "
                                     "(default eval.grader, plus the other one recorded)")
    p.add_argument("--out", help="output directory (default <trainer.run_dir>/eval)")
    p.add_argument("--label", help="row label in the table (default: the model path or preset)")
    p.add_argument("--paper", default="auto",
                   help="paper rows to print beside ours: 1.7B, 8B, 14B, none, or auto (from the model name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-prompts", type=int, help="prompts per rollout call (default: all of a benchmark)")
    p.add_argument("--save-samples", action="store_true", help="also write every response to samples.jsonl")
    return p


def _parse_settings(spec: str, eval_cfg) -> list[DecodingSetting]:
    """The ``--settings`` list (``a``, ``b``, ``config``) as decoding settings; raises ConfigError on another name."""
    from stapo_jax.core.errors import ConfigError

    settings = []
    for s in (x.strip() for x in spec.split(",") if x.strip()):
        if s == "config":
            settings.append(DecodingSetting("config", eval_cfg.temperature, eval_cfg.top_p))
        elif s in SETTINGS:
            settings.append(SETTINGS[s])
        else:
            raise ConfigError(f"--settings: unknown setting {s!r} (expected a, b or config)")
    return settings


def _model_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides of the command line, plus ``--model``'s (its config.json defines the model)."""
    overrides = list(args.overrides)
    if args.model:  # the checkpoint's config.json defines the model: drop the config's preset / size fields
        from stapo_jax.config.schema import MODEL_SIZE_KEYS

        overrides += [f"model.path={args.model}", "model.preset=null"] + [f"model.{k}=null" for k in MODEL_SIZE_KEYS]
    return overrides


def _load_inputs(args: argparse.Namespace, overrides: list[str]):
    """(config, settings, grader names, problems per benchmark); raises ConfigError / DataError / EvalDataError /
    FileNotFoundError."""
    from stapo_jax.config.schema import load_config

    cfg = load_config(args.config, overrides)
    settings = _parse_settings(args.settings, cfg.eval)
    grader_names = ([g.strip() for g in args.graders.split(",") if g.strip()] if args.graders else
                    [cfg.eval.grader] + [g for g in ("math_verify", "boxed_exact") if g != cfg.eval.grader])
    names = ([b.strip() for b in args.benchmarks.split(",") if b.strip()] if args.benchmarks
             else list(cfg.eval.benchmarks))
    problems = {b: load_problems(b, data_dir=cfg.eval.data_dir, prompt_key=cfg.data.prompt_key,
                                 answer_key=cfg.data.answer_key, limit=args.limit) for b in names}
    return cfg, settings, grader_names, problems


def _length_error(longest: int, max_new: int, limit: int) -> Optional[str]:
    """Why prompts of ``longest`` tokens + ``max_new`` new tokens do not fit ``limit`` positions, or None."""
    if longest >= limit:
        return (f"the longest prompt ({longest} tokens) alone reaches the model's max_position_embeddings "
                f"({limit}); this model cannot read these benchmarks' prompts: choose other --benchmarks or a model "
                f"with a longer context")
    if longest + max_new > limit:
        return (f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                f"max_position_embeddings ({limit}); lower --max-new-tokens to at most {limit - longest}")
    return None


def _run_meta(cfg, args: argparse.Namespace, overrides: list[str], label: str, max_new: int) -> dict:
    """The ``meta`` block of ``results.json``: model, config, decoding length, devices, versions, date."""
    from importlib.metadata import version

    import jax

    return {"model_path": cfg.model.path, "model_preset": cfg.model.preset,
            "model_name": _paper_size(cfg) or Path(str(label)).name,
            "config_file": args.config, "overrides": overrides, "recipe": cfg.algorithm.recipe,
            "max_new_tokens": max_new, "limit": args.limit, "seed": args.seed,
            "prompt_suffix": cfg.data.prompt_suffix, "apply_chat_template": cfg.data.apply_chat_template,
            "enable_thinking": cfg.data.enable_thinking, "devices": [str(x) for x in jax.devices()],
            "versions": {p: version(p) for p in ("jax", "flax", "math-verify")},
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _close_graders(graders: Mapping[str, Grader]) -> None:
    """Close the graders that hold a worker pool."""
    for g in graders.values():
        close = getattr(g, "close", None)
        if close:
            close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stapo-jax eval``; returns the exit code (0 on success, 2 on a configuration or data error).

    ``argv`` a sequence of str; returns an int exit code. ConfigError / DataError / EvalDataError /
    FileNotFoundError and too-long prompts are printed (exit 2), not raised; argparse errors exit 2.
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.data.prompts import DataError

    overrides = _model_overrides(args)
    try:
        cfg, settings, grader_names, problems = _load_inputs(args, overrides)
    except (ConfigError, DataError, EvalDataError, FileNotFoundError) as e:
        print(f"stapo-jax eval: {e}", file=sys.stderr)
        return 2
    max_new = cfg.eval.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    if max_new < 1:
        print(f"stapo-jax eval: --max-new-tokens={max_new} must be >= 1", file=sys.stderr)
        return 2
    n_samples = args.n_samples if args.n_samples is not None else cfg.eval.n_samples
    size = _paper_size(cfg) if args.paper == "auto" else (None if args.paper == "none" else args.paper)
    if size is not None and size not in {k[0] for k in PAPER_TABLE2}:
        print(f"stapo-jax eval: --paper {size!r}: expected 1.7B, 8B, 14B, none or auto", file=sys.stderr)
        return 2
    paper_rows = [(size, m) for m in METHOD_NAMES] if size else []

    import jax

    from stapo_jax.runtime.build import build_mesh, build_model, build_tokenizer
    from stapo_jax.runtime.distributed import check_same_config, initialize
    from stapo_jax.rollout import engine_config, inprocess_rollout

    initialize()  # N processes (pod / SLURM): one sampler replica each, results identical everywhere
    check_same_config(cfg)

    tokenizer = build_tokenizer(cfg)
    benches = {b: (ps, format_prompts(ps, tokenizer, cfg.data)) for b, ps in problems.items()}
    longest = max(len(tokenizer.encode(p, add_special_tokens=False)) for _, ps in benches.values() for p in ps)
    mesh = build_mesh(cfg)
    if cfg.model.path is None:
        log.warning("model.path is unset: evaluating a RANDOMLY INITIALISED %s model (smoke test only)",
                    cfg.model.preset or "from-scratch")
    model = build_model(cfg, mesh, tokenizer, seed=cfg.trainer.seed)
    error = _length_error(longest, max_new, model.config.max_position_embeddings)
    if error is not None:
        print(f"stapo-jax eval: {error}", file=sys.stderr)
        return 2
    # the same sampler as training (stapo_jax.rollout): sampling settings come with each generate call
    engine_cfg = engine_config(cfg, tokenizer, max_prefill_length=longest, max_decode_length=max_new, seed=args.seed)
    driver = inprocess_rollout(cfg, model, engine_cfg, mesh, tokenizer)
    from stapo_jax.train.metrics import progress_bar

    bar = progress_bar(len(settings) * sum(len(ps) for ps, _ in benches.values()), "eval", unit="problem")
    generate = engine_generator(driver, tokenizer, batch_prompts=args.batch_prompts, on_progress=bar.update)
    graders = make_graders(grader_names, timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)
    label = args.label or cfg.model.path or random_init_label(cfg)
    out_dir = args.out or os.path.join(cfg.trainer.run_dir, "eval")
    writer = jax.process_index() == 0  # every process evaluates (same results); process 0 writes them
    report = evaluate(benches, generate, graders, settings=settings, n_samples=n_samples,
                      max_new_tokens=max_new, seed=args.seed, label=str(label),
                      meta=_run_meta(cfg, args, overrides, label, max_new), out_dir=out_dir if writer else None,
                      paper_rows=paper_rows, save_samples=args.save_samples, progress=bar)
    bar.close()
    _close_graders(graders)
    if writer:
        print(report.markdown())
        print(f"wrote {Path(out_dir) / 'results.json'} and {Path(out_dir) / 'results.md'}")
    return 0
