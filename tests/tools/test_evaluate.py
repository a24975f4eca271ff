"""Benchmark evaluation: data loading, the Table 2 report, graders with injected generators, and the
``stapo-jax eval`` CLI end to end on a tiny random Qwen3 through the rollout engine."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from stapo_jax.tools import evaluate as ev
from stapo_jax.assets import benchmark_dir, qwen3_tokenizer_dir
from stapo_jax.tools.passk import pass_at_k

REPO = Path(__file__).resolve().parents[2]
DATA = benchmark_dir()
TOKENIZER = qwen3_tokenizer_dir()
SPEC = REPO / "tests" / "data" / "paper_table2.md"     # stapo_spec.md §9, copied
SIX = list(ev.BENCHMARKS)
HEADER = "| model | method | AIME24 | AIME25 | AMC23 | MATH500 | Minerva | Olympiad | **Avg** |"


@pytest.fixture(scope="module")
def graders():
    g = ev.make_graders(["math_verify", "boxed_exact"], num_workers=2)
    yield g
    for x in g.values():
        x.close()


def slices(limit=5):
    return {b: ev.load_problems(b, data_dir=str(DATA), limit=limit) for b in SIX}


def test_load_problems_counts_and_sources(tmp_path):
    for b, spec in ev.BENCHMARKS.items():
        ps = ev.load_problems(b, data_dir=str(DATA))
        assert len(ps) == spec.num_problems, b
        assert all(p.problem.strip() and p.answer.strip() for p in ps)
    five = ev.load_problems("math500", data_dir=str(DATA), limit=5)
    assert [p.index for p in five] == list(range(5)) and five[2].answer == "\\frac{14}{3}"
    # any path: JSONL with custom keys, numeric answers, JSON list, parquet
    rows = [{"q": "1+1?", "a": 2}, {"q": "half of 3?", "a": 1.5}]
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = ev.load_problems(str(tmp_path / "x.jsonl"), prompt_key="q", answer_key="a")
    assert [(p.problem, p.answer) for p in got] == [("1+1?", "2"), ("half of 3?", "1.5")]
    (tmp_path / "x.json").write_text(json.dumps(rows))
    assert ev.load_problems(str(tmp_path / "x.json"), prompt_key="q", answer_key="a") == got
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"problem": "p", "answer": "7"}]), tmp_path / "x.parquet")
    assert ev.load_problems(str(tmp_path / "x.parquet"))[0].answer == "7"


def test_load_problems_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        ev.load_problems(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="aime24.jsonl") as e:
        ev.load_problems("aime24", data_dir=str(tmp_path))
    # the message says how to choose benchmarks and which ones are shipped
    assert "--benchmarks" in str(e.value) and all(b in str(e.value) for b in SIX)
    (tmp_path / "bad.jsonl").write_text('{"problem": "p", "answer": "1"}\n{"problem": "p2"}\n')
    with pytest.raises(ev.EvalDataError, match=r"row 1 has no field 'answer'"):
        ev.load_problems(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.jsonl").write_text('{"problem": "", "answer": "1"}\n')
    with pytest.raises(ev.EvalDataError, match="'problem' is not a non-empty string"):
        ev.load_problems(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ev.EvalDataError, match="not an HF dataset id"):
        ev.load_problems("no_such_benchmark")
    with pytest.raises(ev.EvalDataError, match="could not be loaded"):  # offline in tests (HF_HUB_OFFLINE=1)
        ev.load_problems("someone/not-a-real-dataset-xyz")


def test_paper_table_matches_spec():
    """PAPER_TABLE2 equals stapo_spec.md §9 cell by cell, and each row's Avg is the mean of its six cells
    except the one the spec flags (14B STAPO, setting a)."""
    text = SPEC.read_text()
    sec = text[text.index("## 9."):text.index("## 10.")]
    rows = re.findall(r"^\| (1\.7B|8B|14B) \| ([\w-]+) \|(.*)\|$", sec, flags=re.M)
    methods = {"GRPO": "grpo", "20-Entropy": "entropy20", "JustRL": "justrl", "STAPO": "stapo"}
    assert len(rows) == 12
    for size, method, cells in rows:
        vals = re.findall(r"([\d.]+) \(([\d.]+)\)", cells)
        assert len(vals) == 7
        row = ev.PAPER_TABLE2[(size, methods[method])]
        assert row["a"] == tuple(float(a) for a, _ in vals) and row["b"] == tuple(float(b) for _, b in vals)
        for s in "ab":
            gap = abs(np.mean(row[s][:6]) - row[s][6])
            assert (gap > 0.5) == ((size, method, s) == ("14B", "STAPO", "a")), (size, method, s, gap)


def gold_generator(problems_by_prompt, calls, correct_fn=lambda q, j: True):
    """Fake generator: sample j of problem q answers gold when correct_fn(q, j), else a wrong number."""
    def generate(prompts, *, num_samples, setting, max_new_tokens, seed):
        calls.append((len(prompts), num_samples, setting.temperature, setting.top_p, max_new_tokens, seed))
        out = []
        for p in prompts:
            prob = problems_by_prompt[p]
            out.append([ev.Completion(f"Some reasoning.\nThe answer is $\\boxed{{{prob.answer}}}$.", 12, False)
                        if correct_fn(prob.index, j) else
                        ev.Completion("So the answer is \\boxed{-123456789}.", 9, True)
                        for j in range(num_samples)])
        return out
    return generate


def test_gold_answers_score_100_percent_table_written(tmp_path, graders):
    probs = slices(5)
    benches = {b: (ps, [f"<{b}:{p.index}> {p.problem}" for p in ps]) for b, ps in probs.items()}
    lookup = {pr: p for ps, prs in benches.values() for p, pr in zip(ps, prs)}
    calls = []
    report = ev.evaluate(benches, gold_generator(lookup, calls), graders, max_new_tokens=64, label="gold",
                         out_dir=tmp_path, paper_rows=[("1.7B", "stapo"), ("1.7B", "grpo")], save_samples=True)
    # paper protocol: N = 32 for AIME/AMC, 4 otherwise; both decoding settings
    assert sorted({(c[1], c[2], c[3]) for c in calls}) == [(4, 0.7, 0.9), (4, 1.0, 1.0), (32, 0.7, 0.9),
                                                           (32, 1.0, 1.0)]
    assert len(calls) == 12 and len({c[5] for c in calls}) == 12  # distinct seed per (benchmark, setting)
    assert len(report.results) == 12
    for r in report.results:
        assert r.num_problems == 5 and r.n_samples == ev.BENCHMARKS[r.benchmark].n_samples
        assert r.avg_at_n == 100.0 and r.correct == [r.n_samples] * 5, (r.benchmark, r.setting)
        assert set(r.pass_at_k.values()) == {100.0} and list(r.pass_at_k) == ev.default_ks(r.n_samples)
        assert r.grader == "math_verify" and r.other_graders == {"boxed_exact": 100.0}
        assert r.grader_stats["math_verify"]["n_timeout"] == 0 and r.mean_response_tokens == 12
    assert report.average("a") == report.average("b") == 100.0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["average"]["a"] == {"avg": 100.0, "benchmarks": SIX, "complete": True}
    assert len(data["results"]) == 12 and data["meta"]["graders"] == ["math_verify", "boxed_exact"]
    md = (tmp_path / "results.md").read_text()
    lines = md.splitlines()
    i = lines.index(HEADER)
    assert lines[i + 2] == "| ours | **gold** (ours) | " + " | ".join(["100.00 (100.00)"] * 6) + " | **100.00 (100.00)** |"
    assert lines[i + 3].startswith("| 1.7B | STAPO (paper) | 17.40 (16.04) | 15.42 (14.27) |")
    assert lines[i + 3].endswith("| **38.18 (36.72)** |")
    assert lines[i + 4].startswith("| 1.7B | GRPO (paper) | 6.88 (10.83) |")
    assert "## Setting a: T=1.0, top-p=1.0" in md and "## Setting b: T=0.7, top-p=0.9" in md
    assert md.count("| math_verify |") == 12
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 5 * (3 * 32 + 3 * 4)
    assert all(s["scores"] == {"math_verify": 1.0, "boxed_exact": 1.0} for s in samples)
    m = report.metrics()
    assert m["eval/a/aime24/avg@32"] == 100.0 and m["eval/b/math500/pass@4"] == 100.0 and m["eval/a/avg"] == 100.0


def test_partial_correctness_avg_and_pass_at_k(graders):
    """Problem q has exactly q correct samples out of 4: avg@4 and pass@k equal the hand-computed values."""
    ps = ev.load_problems("math500", data_dir=str(DATA), limit=5)
    prompts = [p.problem for p in ps]
    lookup = dict(zip(prompts, ps))
    counts = [0, 1, 2, 3, 4]
    gen = gold_generator(lookup, [], correct_fn=lambda q, j: j < counts[q])
    r = ev.evaluate_benchmark("math500", ps, prompts, gen, graders, setting=ev.SETTINGS["b"], n_samples=4,
                              max_new_tokens=8)
    assert r.correct == counts and r.other_graders["boxed_exact"] == pytest.approx(50.0)
    assert r.avg_at_n == pytest.approx(100 * 10 / 20)
    assert r.pass_at_k[2] == pytest.approx(100 * np.mean([pass_at_k(4, c, 2) for c in counts]))
    assert r.pass_at_k[2] == pytest.approx(100 * (0 + 0.5 + 5 / 6 + 1 + 1) / 5)
    assert r.truncated_frac == pytest.approx(10 / 20) and r.mean_response_tokens == pytest.approx(10.5)


def test_generator_contract_errors(graders):
    ps = ev.load_problems("aime24", data_dir=str(DATA), limit=2)

    def short(prompts, *, num_samples, **kw):
        return [["x"] * (num_samples - 1) for _ in prompts]

    with pytest.raises(ValueError, match="returned 1 samples for prompt 0, expected 2"):
        ev.evaluate_benchmark("aime24", ps, ["a", "b"], short, graders, setting=ev.SETTINGS["a"], n_samples=2,
                              max_new_tokens=4)
    with pytest.raises(ValueError, match="2 problems but 1 prompts"):
        ev.evaluate_benchmark("aime24", ps, ["a"], short, graders, setting=ev.SETTINGS["a"], n_samples=2,
                              max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown grader 'llm'"):
        ev.make_graders(["llm"])
    with pytest.raises(ValueError, match="paper row"):
        ev.evaluate({}, short, graders, paper_rows=[("4B", "stapo")])


def test_format_prompts_uses_chat_template_and_suffix():
    from stapo_jax.config.schema import JUSTRL_PROMPT_SUFFIX, DataConfig
    from stapo_jax.data.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    p = ev.load_problems("aime25", data_dir=str(DATA), limit=1)
    [text] = ev.format_prompts(p, tok, DataConfig())
    assert text == f"<|im_start|>user\n{p[0].problem}{JUSTRL_PROMPT_SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
    assert ev.format_prompts(p, None, DataConfig(prompt_suffix="!", apply_chat_template=False)) == [p[0].problem + "!"]


TINY_CONFIG = """
model: {{preset: null, vocab_size: 151936, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
        num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, max_position_embeddings: 1024,
        tie_word_embeddings: true, rope_theta: 1000000.0, dtype: float32, param_dtype: float32}}
tokenizer: {{kind: hf, path: {tok}}}
mesh: {{data: -1}}
rollout: {{max_concurrent_decodes: 8, max_new_tokens: 8}}
data: {{max_prompt_length: 512}}
reward: {{num_workers: 2}}
trainer: {{run_dir: {run}}}
"""


def test_eval_cli_tiny_model_end_to_end(tmp_path):
    """``stapo-jax eval`` on a random 2-layer Qwen3 with the real Qwen3 tokenizer: 2 problems of each of the
    six shipped benchmarks (no eval.data_dir: the package's files), both settings, through the JetStream engine and the rollout driver; the table is written.
    A random model scores ~0, so this checks structure and counts."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_CONFIG.format(tok=TOKENIZER, run=tmp_path / "run"))
    rc = ev.main(["--config", str(cfg), "--limit", "2", "--n-samples", "2", "--max-new-tokens", "6",
                  "--paper", "14B", "--label", "tiny", "--save-samples"])
    assert rc == 0
    out = tmp_path / "run" / "eval"
    data = json.loads((out / "results.json").read_text())
    assert [(r["benchmark"], r["setting"]) for r in data["results"]] == [(b, s) for s in "ab" for b in SIX]
    for r in data["results"]:
        assert r["num_problems"] == 2 and r["n_samples"] == 2 and len(r["correct"]) == 2
        assert all(0 <= c <= 2 for c in r["correct"]) and 0 <= r["avg_at_n"] <= 100
        assert 1 <= r["mean_response_tokens"] <= 6 and 0 <= r["truncated_frac"] <= 1
        assert r["grader"] == "math_verify" and "boxed_exact" in r["other_graders"]
        assert (r["temperature"], r["top_p"]) == ((1.0, 1.0) if r["setting"] == "a" else (0.7, 0.9))
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 6 * 2 * 2
    assert all(1 <= s["num_tokens"] <= 6 for s in samples)
    md = (out / "results.md").read_text().splitlines()
    i = md.index(HEADER)
    assert md[i + 2].startswith("| tiny | **ours** |") and md[i + 3].startswith("| 14B | GRPO (paper) |")
    assert len([x for x in md if x.startswith("| 14B |")]) == 4
    assert ev.main(["--config", str(cfg), "--benchmarks", "nope"]) == 2


def test_eval_names_a_prompt_longer_than_the_models_context(capsys):
    """tiny_cpu's model has 512 positions; the shipped benchmarks have longer prompts: the error says the prompt
    alone is too long (lowering --max-new-tokens cannot help), not to lower --max-new-tokens."""
    from stapo_jax.tools.evaluate import main as eval_main

    config = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")
    assert eval_main(["--config", config, "--limit", "2", "--n-samples", "1",
                      "--max-new-tokens", "16"]) == 2
    err = capsys.readouterr().err
    assert "alone reaches the model's max_position_embeddings (512)" in err and "--benchmarks" in err


def test_a_toy_body_under_a_presets_vocabulary_is_not_labelled_as_the_preset():
    """configs/gsm8k_tiny.yaml is Qwen3-0.6B's vocabulary over a 1-layer D=32 body: its eval label says so (the
    report used to call it "Qwen3-0.6B (random init)"); a plain preset keeps its name."""
    from stapo_jax.config.schema import load_config
    from stapo_jax.tools.evaluate import body_overrides, random_init_label

    toy = load_config("configs/gsm8k_tiny.yaml", [])
    assert body_overrides(toy)["num_hidden_layers"] == 1 and body_overrides(toy)["hidden_size"] == 32
    assert random_init_label(toy) == "Qwen3-0.6B vocabulary, 1 layer(s) x hidden_size 32 (random init)"
    plain = load_config(None, ["model.preset=Qwen3-1.7B"])
    assert body_overrides(plain) == {} and random_init_label(plain) == "Qwen3-1.7B (random init)"
