"""The real-data path (issue 5 item 9): ``configs/gsm8k_tiny.yaml`` (real Qwen3 tokenizer and chat template,
GSM8K training prompts (the slice shipped in stapo_jax/assets/samples), math-verify rewards, a tiny random Qwen3 with the real 151,936-entry
vocabulary) runs 2 RL steps from the repository root, with four bad rows appended to the training files.

Independent checks: the prompt-length filter's counts against transformers' own chat-template tokenization of
the JSONL; the trainer's reward path (decode -> math-verify pool) on real GSM8K gold answers written as a model
would, and on perturbed ones.
"""
from __future__ import annotations

import json
import re
from decimal import Decimal

import numpy as np
import pytest

from fixtures_trainer import REPO, committed_steps, metric_rows, run_cli

CONFIG = REPO / "configs" / "gsm8k_tiny.yaml"
GSM8K = "stapo_jax/assets/samples/gsm8k_train.jsonl"
BAD_ROWS = [json.dumps({"problem": "What is 2 + 2?"}),                 # missing:answer
            json.dumps({"problem": "What is 3 + 3?", "answer": 6}),    # not_str:answer
            json.dumps({"problem": "   ", "answer": "1"}),             # empty:problem
            "{this is not json"]                                        # invalid_json


@pytest.fixture(scope="module")
def cfg():
    from stapo_jax.config.schema import load_config

    return load_config(CONFIG)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gsm8k")
    bad = tmp / "bad_rows.jsonl"
    bad.write_text("\n".join(BAD_ROWS) + "\n")
    run_dir = tmp / "run"
    r = run_cli("train", "--config", "configs/gsm8k_tiny.yaml", f"trainer.run_dir={run_dir}",
                f"data.train_files=[{GSM8K}, {bad}]", cwd=REPO)
    return {"rc": r.returncode, "out": r.stdout + r.stderr, "run_dir": run_dir, "bad": bad}


def test_config_is_the_real_setup(cfg):
    from stapo_jax.runtime.build import model_config
    from stapo_jax.data.tokenizer import load_tokenizer

    assert cfg.data.train_files == [GSM8K] and (REPO / GSM8K).is_file()
    assert cfg.tokenizer.path == "stapo_jax/assets/qwen3_tokenizer" and cfg.reward.kind == "math_verify_01"
    assert cfg.data.apply_chat_template and cfg.s2t.enabled
    tok = load_tokenizer(cfg)
    mc = model_config(cfg, tok)
    assert mc.vocab_size == 151936 >= len(tok) == 151669
    assert mc.tie_word_embeddings and mc.rope_theta == 1e6 and mc.hidden_size == 32 and mc.num_hidden_layers == 1
    assert tuple(mc.eos_token_id) == (151645, 151643)        # <|im_end|>, <|endoftext|>


def test_two_steps_run_with_metrics(run, cfg):
    assert run["rc"] == 0, run["out"][-4000:]
    rows = metric_rows(run["run_dir"])
    assert [r["step"] for r in rows] == [1, 2]
    G, B = cfg.rollout.n, cfg.trainer.train_batch_size
    for r in rows:
        assert r["sampling/prompts"] == B
        # math-verify scored every response (a crash or timeout in the pool would be counted here)
        assert r["reward/n_error"] == 0 and r["reward/n_timeout"] == 0
        assert r["reward/mean"] == r["acc/mean"]               # 0/1 rewards, no overlong shaping
        assert 1 <= r["response_length/mean"] <= cfg.rollout.max_new_tokens
        # a random model over the real vocabulary: near-uniform entropy, ln(151936) = 11.93 nats
        assert abs(r["entropy"] - np.log(151936)) < 0.1
        assert r["sampler_trainer/logp_diff_mean"] <= 1e-4
        assert r["time/rollout"] > 0 and r["time/reward"] > 0 and r["time/update"] > 0
        assert r["loss_denominator"] <= G * B * cfg.rollout.max_new_tokens
    assert committed_steps(run["run_dir"] / "checkpoints") == [1, 2]
    hf = run["run_dir"] / "hf"
    assert json.loads((hf / "config.json").read_text())["vocab_size"] == 151936
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(hf)) == 151669    # the real tokenizer travels with the export


def test_bad_rows_and_length_filter_reported(run, cfg):
    from transformers import AutoTokenizer

    assert run["rc"] == 0, run["out"][-4000:]
    # the reference count: transformers' chat template + tokenizer over the JSONL, no stapo_jax code
    tok = AutoTokenizer.from_pretrained(REPO / cfg.tokenizer.path)
    problems = [json.loads(line)["problem"] for line in (REPO / GSM8K).read_text().split("\n") if line.strip()]
    texts = [tok.apply_chat_template([{"role": "user", "content": p + cfg.data.prompt_suffix}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=True) for p in problems]
    lengths = np.asarray([len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]])
    kept = int((lengths <= cfg.data.max_prompt_length).sum())
    assert 0 < kept < len(problems)
    line = re.search(r"data\[train\] jsonl .*", run["out"]).group(0)
    assert (f"{len(problems) + len(BAD_ROWS)} rows, 4 bad (empty:problem: 1, invalid_json: 1, missing:answer: 1, "
            f"not_str:answer: 1), {len(problems) - kept} longer than max_prompt_length dropped, {kept} kept") in line


def test_trainer_reward_path_scores_real_gold_answers(cfg):
    """The trainer's scoring (token ids -> decode -> math-verify pool) on GSM8K gold answers written as a model
    would: every one correct; the same answers plus one: none correct."""
    from stapo_jax.train.experience import score_rollout
    from stapo_jax.rewards import make_scorer
    from stapo_jax.rollout.driver import RolloutBatch
    from stapo_jax.data.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg)
    rows = [json.loads(line) for line in (REPO / GSM8K).read_text().split("\n")[:24]]
    examples = [{"gold": r["answer"]} for r in rows]

    def batch(answers):
        ids = [tok.encode(f"Adding it all up gives {a}. The answer is $\\boxed{{{a}}}$.", add_special_tokens=False)
               + [tok.eos_token_id] for a in answers]
        M = max(map(len, ids))
        resp = np.full((len(ids), M), tok.pad_token_id, np.int32)
        mask = np.zeros((len(ids), M), np.int32)
        for i, x in enumerate(ids):
            resp[i, :len(x)], mask[i, :len(x)] = x, 1
        return RolloutBatch(prompt_index=np.arange(len(ids), dtype=np.int32), responses=resp, response_mask=mask,
                            rollout_log_probs=None, response_lengths=mask.sum(1).astype(np.int32),
                            finish_reasons=["eos"] * len(ids), prompts=[np.ones(1, np.int32)] * len(ids))

    golds = [r["answer"] for r in rows]
    assert all(re.fullmatch(r"-?[\d,]+(\.\d+)?", g) for g in golds), golds
    wrong = [str(Decimal(g.replace(",", "")) + 1) for g in golds]
    with make_scorer(cfg.reward, gym_task=cfg.data.gym.task, extensions=cfg.extensions) as scorer:
        s_ok, st_ok = score_rollout(batch(golds), examples, tok, scorer)
        s_bad, st_bad = score_rollout(batch(wrong), examples, tok, scorer)
    assert st_ok["n"] == st_bad["n"] == len(rows)
    assert st_ok["n_correct"] == len(rows) and s_ok.tolist() == [1.0] * len(rows)
    assert st_bad["n_correct"] == 0 and s_bad.tolist() == [0.0] * len(rows)
    assert st_ok["n_timeout"] == st_ok["n_error"] == st_bad["n_timeout"] == st_bad["n_error"] == 0
