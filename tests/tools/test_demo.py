"""stapo_jax/tools/demo.py with the real Qwen3 tokenizer (shipped in stapo_jax/assets): the greedy continuation of
an HF checkpoint equals transformers' ``generate`` on the same tokens, and the printed text is the tokenizer's
decoding of the printed ids."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from fixtures_hf import make_hf_model
from stapo_jax.assets import qwen3_tokenizer_dir
from stapo_jax.tools.demo import main
from xla_env import xla_flags

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = qwen3_tokenizer_dir()


def _parse(out: str) -> dict:
    rec = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        rec[key.strip()] = value.strip()
    return rec


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope="module")
def full_vocab_checkpoint(tmp_path_factory):
    """Tiny HF Qwen3 with the real 151,936-entry vocabulary and Qwen3's special ids."""
    model = make_hf_model(tied=True, seed=11, vocab_size=151936, hidden_size=32, intermediate_size=64,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    path = tmp_path_factory.mktemp("demo_ckpt")
    model.save_pretrained(path)
    return model, path


def test_demo_on_hf_checkpoint_equals_hf_generate(full_vocab_checkpoint, tokenizer, capsys, caplog):
    """A checkpoint without tokenizer files: the shipped Qwen3 tokenizer, with a warning that says so."""
    hf_model, path = full_vocab_checkpoint
    prompt = "Solve 2 + 3 = "
    with caplog.at_level(logging.WARNING, logger="stapo_jax.tools.demo"):
        assert main(["--model", str(path), "--prompt", prompt, "--max-new-tokens", "10"]) == 0
    assert any("holds no tokenizer" in r.message and "Qwen3 tokenizer" in r.message for r in caplog.records)
    rec = _parse(capsys.readouterr().out)
    prompt_ids = json.loads(rec["prompt_ids"])
    assert prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    got = json.loads(rec["generated_ids"])
    with torch.no_grad():
        ref = hf_model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                dtype=torch.long), max_new_tokens=10, do_sample=False)[0, len(prompt_ids):].tolist()
    if 151645 in ref:                      # HF stops at EOS (and pads); the demo prints up to the EOS
        ref = ref[: ref.index(151645) + 1]
    assert got == ref and len(got) >= 1
    assert json.loads(rec["text"]) == tokenizer.decode(got, skip_special_tokens=False)
    assert "HF checkpoint" in rec["model"]


def test_default_tiny_random_model_runs_with_chat_template(tokenizer, capsys):
    assert main(["--max-new-tokens", "3", "--chat", "--prompt", "hi"]) == 0
    rec = _parse(capsys.readouterr().out)
    ids = json.loads(rec["prompt_ids"])
    assert ids[:3] == [151644, 872, 198] and ids[-3:] == [151644, 77091, 198]   # <|im_start|>user\n ... assistant\n
    gen = json.loads(rec["generated_ids"])
    assert 1 <= len(gen) <= 3 and all(0 <= t < 151936 for t in gen)
    assert json.loads(rec["text"]) == tokenizer.decode(gen, skip_special_tokens=False)


@pytest.fixture(scope="module")
def char_vocab_export(tmp_path_factory):
    """An HF export the way the trainer writes one for configs/tiny_cpu.yaml: a small model over the builtin
    character tokenizer's 103 ids, with that tokenizer saved beside the weights; and the same weights alone."""
    from stapo_jax.data.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    model = make_hf_model(tied=True, seed=5, vocab_size=len(tok), bos_token_id=0, eos_token_id=2, pad_token_id=0)
    with_tok, bare = tmp_path_factory.mktemp("export_tok"), tmp_path_factory.mktemp("export_bare")
    model.save_pretrained(with_tok)
    model.save_pretrained(bare)
    tok.save_pretrained(with_tok)
    return tok, with_tok, bare


def test_demo_uses_the_tokenizer_saved_with_the_model(char_vocab_export, capsys, caplog):
    tok, with_tok, bare = char_vocab_export
    prompt = "Calculate 3 - 7 + 5."
    with caplog.at_level(logging.WARNING, logger="stapo_jax.tools.demo"):
        assert main(["--model", str(with_tok), "--prompt", prompt, "--max-new-tokens", "4", "--chat"]) == 0
    assert not [r for r in caplog.records if "holds no tokenizer" in r.message]
    rec = _parse(capsys.readouterr().out)
    want = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    assert json.loads(rec["prompt_ids"]) == tok(want, add_special_tokens=False)["input_ids"]
    # one id per character, one per special token (two <|im_start|>, one <|im_end|>)
    assert len(json.loads(rec["prompt_ids"])) == len(want) - 2 * len("<|im_start|>") - len("<|im_end|>") + 3
    gen = json.loads(rec["generated_ids"])
    assert 1 <= len(gen) <= 4 and json.loads(rec["text"]) == tok.decode(gen, skip_special_tokens=False)
    # the same weights without tokenizer files: the vocabulary (103) cannot hold Qwen3's, so the builtin
    # character tokenizer is used, with a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stapo_jax.tools.demo"):
        assert main(["--model", str(bare), "--prompt", prompt, "--max-new-tokens", "4"]) == 0
    assert any("character tokenizer" in r.message for r in caplog.records)
    assert json.loads(_parse(capsys.readouterr().out)["prompt_ids"]) == tok(prompt)["input_ids"]


def test_demo_errors_are_reported_with_exit_code_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert main(["--preset", "Qwen3-3B"]) == 2
    assert "unknown Qwen3 preset" in capsys.readouterr().err
    assert main(["--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens=0" in capsys.readouterr().err
    assert main(["--tokenizer", str(tmp_path / "no_tok")]) == 2


def test_stapo_jax_demo_command(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "stapo_jax", "demo", "--max-new-tokens", "2"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = _parse(r.stdout)
    assert rec["prompt"] == repr("The capital of France is")
    assert len(json.loads(rec["generated_ids"])) in (1, 2)
    assert np.all(np.array(json.loads(rec["prompt_ids"])) < 151669)


def test_demo_two_processes_print_once_and_equal_one(tmp_path):
    """``stapo-jax launch --local 2 --command demo``: both processes join one multi-controller job, and the
    single printed record (process 0's) equals a one-process run's (greedy, same seed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES",
                                                                     "JAX_PROCESS_ID", "SLURM_", "OMPI_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(), HF_HUB_OFFLINE="1", STAPO_DISTRIBUTED="auto",
               PYTHONPATH=str(REPO))
    args = ["demo", "--max-new-tokens", "3", "--seed", "3"]
    one = subprocess.run([sys.executable, "-m", "stapo_jax", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "stapo_jax", "launch", "--local", "2", "--devices-per-process", "1",
                          "--timeout", "300", "--command", *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=400)
    assert two.returncode == 0, two.stdout[-3000:]
    printed = [line for line in two.stdout.splitlines() if "generated_ids:" in line]
    assert len(printed) == 1 and printed[0].startswith("[p0] "), two.stdout[-3000:]
    rec1 = _parse(one.stdout)
    rec2 = _parse("\n".join(line[len("[p0] "):] for line in two.stdout.splitlines() if line.startswith("[p0] ")))
    for key in ("model", "prompt", "prompt_ids", "generated_ids", "text"):
        assert rec2[key] == rec1[key], key
    assert len(json.loads(rec1["generated_ids"])) >= 1
