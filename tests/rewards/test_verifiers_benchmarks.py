"""Three verifiers on every shipped benchmark file (stapo_jax/assets; issue 5, item 9; issue 13) and the GSM8K
test slice.

Each gold answer is written as a model would write it: a short solution with distractor numbers that ends
"... so the answer is \\boxed{GOLD}.". It must be scored correct by math-verify (``math_verify_01``, gold
first, process pool with 2 workers), by the hardened math-verify of issue 13 (``math_verify_strict``) and by
JustRL's strict-box string match (``boxed_exact_pm1``); a perturbed answer (:func:`perturb`) must not be.
MATH-500 and GSM8K must score 100 % / 0 %; for the other files the
thresholds below are set just under the measured rates, which are printed as a table
(``pytest -s tests/rewards/test_verifiers_benchmarks.py``).

All rows of all seven files run (about 5,700 calls per math-verify kind, 1-4 min on 2 shared cores).

Known verifier limits this reports (they are not bugs of ours): the string match misses golds longer than
91 characters, whose ``\boxed{`` then starts before the final 100 characters (JustRL's window); math-verify
accepts two perturbed answers because it mis-parses the gold (``\frac{1}{3} E_{1}+\frac{2}{3} E_{2}`` parses
as 2/3; ``N=n`` folds case and becomes ``n = n``). ``math_verify_strict`` refuses both: a parse that drops a
subscripted symbol falls back to the normalised string, and two equations with the same left side are
compared by their right sides (``n`` vs ``n + 1``).
"""
from __future__ import annotations

import json
import re

import pytest

from stapo_jax.assets import BENCHMARK_NAMES, asset_path
from stapo_jax.rewards import RewardScorer

SHIPPED = {**{b: asset_path("benchmarks", f"{b}.jsonl") for b in BENCHMARK_NAMES},
           "gsm8k_test": asset_path("samples", "gsm8k_test.jsonl")}
FILES = ("math500", "gsm8k_test", "aime24", "aime25", "amc23", "minerva_math", "olympiadbench")
TIMEOUT_S = 5.0  # gold items take < 1 s; one perturbed Minerva ODE takes ~11 s and times out (scores 0)

# minimum correct-rate on gold / maximum correct-rate on perturbed answers, per file and verifier;
# exact 100 % / 0 % where the issue demands it, else just under the measured rates (see module docstring).
# math_verify_strict must score 100 % / 0 % on every file (measured so; its policy and normalisation fix the two
# math-verify false accepts below).
STRICT = (1.0, 0.0)
THRESHOLDS = {
    "math500": {"math_verify": (1.0, 0.0), "math_verify_strict": STRICT, "string_match": (1.0, 0.0)},
    "gsm8k_test": {"math_verify": (1.0, 0.0), "math_verify_strict": STRICT, "string_match": (1.0, 0.0)},
    "aime24": {"math_verify": (1.0, 0.0), "math_verify_strict": STRICT, "string_match": (1.0, 0.0)},
    "aime25": {"math_verify": (1.0, 0.0), "math_verify_strict": STRICT, "string_match": (1.0, 0.0)},
    "amc23": {"math_verify": (1.0, 0.0), "math_verify_strict": STRICT, "string_match": (1.0, 0.0)},
    # measured: math-verify 100 % / 0.37 % (1 false accept), string match 99.63 % / 0 %
    "minerva_math": {"math_verify": (0.99, 0.01), "math_verify_strict": STRICT, "string_match": (0.99, 0.0)},
    # measured: math-verify 100 % / 0.15 % (1 false accept), string match 99.11 % / 0 %
    "olympiadbench": {"math_verify": (0.99, 0.01), "math_verify_strict": STRICT, "string_match": (0.99, 0.0)},
}
VERIFIERS = ("math_verify", "math_verify_strict", "string_match")


def model_style_solution(answer: str) -> str:
    """A short solution ending in ``\\boxed{answer}``, with other numbers earlier in the text."""
    return ("We start from the given conditions. First, 2 + 3 = 5 and 7 \\times 6 = 42, which we keep for later.\n"
            "Combining these facts and simplifying step by step gives the result, "
            f"so the answer is \\boxed{{{answer}}}.")


_NUMBER = re.compile(r"-?(\d[\d,]*)?(\.\d+)?")
_CHOICE = re.compile(r"\(([A-E])\)")


def perturb(gold: str) -> str:
    """A wrong answer close to ``gold``: a number plus one; else the next multiple-choice letter; else
    ``\\text{...}`` answers negated; else the first digit increased by one (mod 10); else ``gold + 1``."""
    s = gold.strip()
    if _NUMBER.fullmatch(s) and any(c.isdigit() for c in s):
        plain = s.replace(",", "")
        if "." in plain:
            decimals = len(plain.split(".")[1])
            return f"{float(plain) + 1:.{decimals}f}"
        return str(int(plain) + 1)
    m = _CHOICE.search(s)
    if m:
        nxt = "ABCDE"[("ABCDE".index(m.group(1)) + 1) % 5]
        return s[:m.start(1)] + nxt + s[m.end(1):]
    if "\\text{" in s and not any(c.isdigit() for c in s):
        return s.replace("\\text{", "\\text{not ", 1)
    for i, c in enumerate(s):
        if c.isdigit():
            return s[:i] + str((int(c) + 1) % 10) + s[i + 1:]
    return s + "+1"


def _load(name: str) -> list[str]:
    return [json.loads(line)["answer"] for line in SHIPPED[name].read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def results():
    """{file: {verifier: {"gold": rate, "perturbed": rate, "n": int, "misses": [...], "false_accepts": [...],
    "timeouts": int, "errors": int}}}"""
    out = {}
    with RewardScorer("math_verify_01", timeout_s=TIMEOUT_S, num_workers=2) as mv, \
            RewardScorer("math_verify_strict", timeout_s=TIMEOUT_S, num_workers=2) as mvs, \
            RewardScorer("boxed_exact_pm1") as sm:
        for name in FILES:
            golds = _load(name)
            wrong = [perturb(g) for g in golds]
            assert all(w != g for w, g in zip(wrong, golds))
            responses = [model_style_solution(g) for g in golds] + [model_style_solution(w) for w in wrong]
            out[name] = {}
            for verifier, scorer in (("math_verify", mv), ("math_verify_strict", mvs), ("string_match", sm)):
                scores, stats = scorer.score(responses, golds + golds)
                ok = scores > 0
                n = len(golds)
                out[name][verifier] = {
                    "n": n, "gold": float(ok[:n].mean()), "perturbed": float(ok[n:].mean()),
                    "misses": [golds[i] for i in range(n) if not ok[i]],
                    "false_accepts": [(golds[i], wrong[i]) for i in range(n) if ok[n + i]],
                    "timeouts": int(stats["n_timeout"]), "errors": int(stats["n_error"]),
                    "time_s": stats["time_s"]}
    return out


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("verifier", VERIFIERS)
def test_gold_correct_and_perturbed_wrong(results, name, verifier):
    r = results[name][verifier]
    min_gold, max_perturbed = THRESHOLDS[name][verifier]
    assert r["gold"] >= min_gold, f"{name}/{verifier}: gold rate {r['gold']:.4f}; misses {r['misses'][:10]}"
    assert r["perturbed"] <= max_perturbed, (
        f"{name}/{verifier}: perturbed rate {r['perturbed']:.4f}; false accepts {r['false_accepts'][:10]}")
    assert r["errors"] == 0
    if verifier == "string_match":  # every miss is a gold too long for the 100-character box window
        window = 100 - len("\\boxed{") - len("}.")
        assert all(len(g) > window for g in r["misses"]), r["misses"]


def test_print_rates_table(results):
    """The rates table, printed only under ``pytest -s`` (captured otherwise, so the suite's output stays quiet)."""
    lines = ["", f"{'file':<15}{'n':>6}  {'math-verify gold':>17}{'perturbed':>11}  {'strict gold':>12}{'perturbed':>11}"
             f"  {'string-match gold':>18}{'perturbed':>11}  {'timeouts mv/strict':>19}"]
    for name in FILES:
        mv, st, sm = (results[name][v] for v in VERIFIERS)
        lines.append(f"{name:<15}{mv['n']:>6}  {mv['gold']:>16.2%} {mv['perturbed']:>10.2%}  {st['gold']:>11.2%} "
                     f"{st['perturbed']:>10.2%}  {sm['gold']:>17.2%} {sm['perturbed']:>10.2%}  "
                     f"{mv['timeouts']:>12}/{st['timeouts']}")
    for name in FILES:
        for verifier in VERIFIERS:
            r = results[name][verifier]
            if r["misses"] or r["false_accepts"]:
                lines.append(f"  {name}/{verifier}: misses {r['misses']}; false accepts {r['false_accepts']}")
    print("\n".join(lines))
    assert set(results) == set(FILES) and [x.split()[0] for x in lines[2:2 + len(FILES)]] == list(FILES)


@pytest.mark.parametrize("gold,expected", [
    ("18", "19"), ("1,000", "1001"), ("-3", "-2"), ("0.25", "1.25"), ("\\text{(C)}", "\\text{(D)}"),
    ("\\text{Evelyn}", "\\text{not Evelyn}"), ("\\frac{1}{2}", "\\frac{2}{2}"), ("\\pi", "\\pi+1"),
])
def test_perturb(gold, expected):
    assert perturb(gold) == expected
