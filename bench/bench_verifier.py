"""Math verifiers: ``math_verify_strict`` (issue 13) vs ``math_verify_01`` (plain math-verify), same responses,
one process, both pools of ``--workers`` processes, rounds interleaved. Prints verdicts/s for each and the
ratio, and (``--corpus``) the false-accept / false-reject table of each kind on the adversarial corpus
``tests/data/reward_adversarial.jsonl``.

    taskset -c 0,1 .venv/bin/python bench/bench_verifier.py --n 2000 --workers 2 --corpus
    taskset -c 0,1 .venv/bin/python bench/bench_verifier.py --n 2000 --workers 2 --forms integer

"Ordinary answers": the kind of responses an RL batch holds: groups of 8 rollouts per prompt, each a short
worked solution with distractor numbers ending in a boxed answer, half right and half wrong, over typical
MATH / GSM8K gold forms (integers, fractions, radicals, decimals, tuples, intervals, sets, expressions,
percent, degrees), a different gold for every group.
"""

import argparse
import json
import os
import time

from benchutil import load_line, machine_line, median, ratio, use_cli_allocator
from stapo_jax.rewards import RewardScorer
from stapo_jax.rewards.corpus import verdict_rates

# gold / wrong-answer templates over a group index g (each RL prompt has its own gold; a group of rollouts
# shares it)
TEMPLATES = [
    ("{a}", "{b}"), ("\\frac{{{a}}}{{{p}}}", "\\frac{{{b}}}{{{p}}}"), ("{a}\\sqrt{{{p}}}", "{b}\\sqrt{{{p}}}"),
    ("{a}.25", "{b}.25"), ("({a}, {p})", "({b}, {p})"), ("[-{p}, {a}]", "[-{p}, {b}]"),
    ("\\frac{{\\pi}}{{{p}}}", "\\frac{{\\pi}}{{{q}}}"), ("{a},000", "{b},000"), ("x^2 + {a}", "x^2 - {a}"),
    ("-{a}", "{a}"), ("{a}\\%", "{b}\\%"), ("({a}, \\frac{{\\pi}}{{{p}}})", "({a}, \\frac{{\\pi}}{{{q}}})"),
    ("{p}, {a}", "{p}, {b}"), ("\\{{{p}, {a}\\}}", "\\{{{p}, {b}\\}}"), ("{a}^\\circ", "{b}^\\circ"),
]
GROUP = 8  # rollouts per prompt
CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                      "reward_adversarial.jsonl")


def solution(answer: str, i: int) -> str:
    return (f"Let the unknown be $x$. From the statement, {i % 17} + {i % 5} = {i % 17 + i % 5} and "
            f"$3 \\times {i % 9} = {3 * (i % 9)}$, which we keep for later.\n"
            "Substituting back and simplifying step by step gives the result.\n"
            f"Therefore the answer is $\\boxed{{{answer}}}$.")


def ordinary(n: int, forms: str = "mixed", first_group: int = 0) -> tuple[list[str], list[str]]:
    """``n`` responses in groups of ``GROUP`` sharing a gold; even rollouts right, odd ones wrong. ``forms``:
    ``mixed`` cycles through every template; ``integer`` uses integer golds only (DAPO-Math-17k, GSM8K).
    Group ``g`` (from ``first_group``) has its own numbers, so batches with different ``first_group`` share no
    answer (no verifier cache carries over between rounds)."""
    templates = TEMPLATES if forms == "mixed" else TEMPLATES[:1]
    responses, golds = [], []
    for i in range(n):
        g = first_group + i // GROUP
        right, wrong = templates[g % len(templates)]
        vals = dict(a=g + 2, b=g + 3, p=g % 7 + 2, q=g % 7 + 3)
        golds.append(right.format(**vals))
        responses.append(solution((right if i % 2 == 0 else wrong).format(**vals), i))
    return responses, golds


def corpus_table(kind: str, workers: int, timeout_s: float) -> str:
    rows = [json.loads(line) for line in open(CORPUS) if line.strip()]
    with RewardScorer(kind, timeout_s=timeout_s, num_workers=workers) as s:
        scores, stats = s.score([r["prediction"] for r in rows], [r["gold"] for r in rows])
    _, table = verdict_rates(rows, scores > 0)
    return (f"{kind}: {len(rows)} cases, {int(stats['n_timeout'])} timeouts, {int(stats['n_error'])} errors\n"
            + table)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000, help="responses per round")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--forms", choices=("mixed", "integer"), default="mixed", help="answer forms (see ordinary)")
    ap.add_argument("--corpus", action="store_true", help="also print the corpus table of both kinds")
    a = ap.parse_args()
    use_cli_allocator()
    print(machine_line())
    kinds = ("math_verify_01", "math_verify_strict")
    scorers = {k: RewardScorer(k, timeout_s=a.timeout, num_workers=a.workers) for k in kinds}
    try:
        warm_r, warm_g = ordinary(100, a.forms, first_group=10**6)
        for k in kinds:  # warm-up: workers started and imported
            scorers[k].score(warm_r, warm_g)
        times = {k: [] for k in kinds}
        acc = {}
        for rnd in range(a.rounds):
            # a fresh batch per round (nothing cached from an earlier round), the same one for both kinds (their
            # pools are separate processes, so neither warms the other's caches)
            responses, golds = ordinary(a.n, a.forms, first_group=rnd * (a.n // GROUP + 1))
            for k in kinds:
                t0 = time.perf_counter()
                scores, stats = scorers[k].score(responses, golds)
                times[k].append(time.perf_counter() - t0)
                acc[k] = (float((scores[0::2] > 0).mean()), float((scores[1::2] > 0).mean()), stats["n_timeout"])
    finally:
        for s in scorers.values():
            s.close()
    print(f"{a.n} ordinary responses ({a.forms} answer forms), {a.workers} workers, median of {a.rounds} "
          f"interleaved rounds [slowest..fastest round]")
    for k in kinds:
        right, wrong, to = acc[k]
        print(f"  {k:<20} {a.n / median(times[k]):8.1f} verdicts/s [{a.n / max(times[k]):.1f}..{a.n / min(times[k]):.1f}]"
              f"   right answers accepted {right:.1%}, wrong accepted {wrong:.1%}, timeouts {int(to)}")
    print(f"  ratio strict / plain throughput: {ratio(times['math_verify_01'], times['math_verify_strict'])}")
    print(load_line("at end"))
    if a.corpus:
        for k in kinds:
            print(corpus_table(k, a.workers, a.timeout))


if __name__ == "__main__":
    main()
