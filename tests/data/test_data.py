"""Prompt data: JSONL/parquet/HF-dir/gym loading, chat template vs transformers, bad rows, missing files,
length filter, seeded shuffling, iterator state resume, per-process sharding; the offline tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stapo_jax.assets import asset_path, qwen3_tokenizer_dir
from stapo_jax.config.schema import load_config
from stapo_jax.core.errors import ConfigError
from stapo_jax.data.prompts import DataError, format_prompt, load_prompt_dataset, make_iterator
from stapo_jax.data.tokenizer import build_builtin_tokenizer, load_tokenizer, pad_token_id, stop_token_ids

GSM8K = asset_path("samples", "gsm8k_test.jsonl")
QWEN_TOK = qwen3_tokenizer_dir()


@pytest.fixture(scope="module")
def qwen_tok():
    return load_tokenizer(load_config(None, [f"tokenizer.path={QWEN_TOK}"]))


@pytest.fixture(scope="module")
def char_tok():
    return build_builtin_tokenizer()


def _gsm8k_head(tmp_path, n=12) -> Path:
    lines = GSM8K.read_text().splitlines()[:n]
    p = tmp_path / "gsm8k_head.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _cfg(*overrides):
    return load_config(None, list(overrides))


# ------------------------------------------------------------------------------------------- loading


def test_jsonl_gsm8k_prompts_match_transformers_chat_template(tmp_path, qwen_tok):
    path = _gsm8k_head(tmp_path)
    cfg = _cfg(f"data.train_files=[{path}]")
    ds = load_prompt_dataset(cfg, qwen_tok)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(ds) == len(rows) == ds.report.n_kept and ds.report.n_bad == 0
    for ex, row in zip(ds.examples, rows):
        assert ex["problem"] == row["problem"] and ex["answer"] == ex["gold"] == row["answer"]
        messages = [{"role": "user", "content": row["problem"] + cfg.data.prompt_suffix}]
        want = qwen_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert ex["prompt_ids"].dtype == np.int32 and ex["prompt_ids"].tolist() == list(want)
        assert ex["prompt"].startswith("<|im_start|>user\n" + row["problem"])
        assert ex["prompt"].endswith("\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert ds.examples[0]["prompt_ids"][:3].tolist() == [151644, 872, 198]  # <|im_start|> user \n
    assert [ex["index"] for ex in ds.examples] == list(range(len(rows)))


def test_enable_thinking_false_and_no_template(qwen_tok):
    d = _cfg("data.enable_thinking=false").data
    assert format_prompt("1+1?", qwen_tok, d).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    d = _cfg("data.apply_chat_template=false", "data.prompt_suffix=' Answer:'").data
    assert format_prompt("1+1?", qwen_tok, d) == "1+1? Answer:"


def test_bad_rows_are_counted_by_reason(tmp_path, char_tok):
    p = tmp_path / "mixed.jsonl"
    rows = ['{"problem": "ok 1", "answer": "1"}', '{"problem": "no answer"}', '{"problem": "int", "answer": 3}',
            '{"problem": "  ", "answer": "2"}', "not json {", "[1, 2]", "", '{"problem": "ok 2", "answer": "2"}',
            '{"problem": null, "answer": "5"}']
    p.write_text("\n".join(rows) + "\n")
    cfg = _cfg(f"data.train_files=[{p}]", "tokenizer.kind=builtin")
    ds = load_prompt_dataset(cfg, char_tok)
    assert [ex["problem"] for ex in ds.examples] == ["ok 1", "ok 2"]
    r = ds.report
    assert (r.n_rows, r.n_bad, r.n_kept) == (8, 6, 2)  # the blank line is not a row
    assert r.bad_reasons == {"missing:answer": 1, "not_str:answer": 1, "empty:problem": 1, "invalid_json": 1,
                             "not_object": 1, "missing:problem": 1}
    assert "6 bad" in r.summary() and "not_str:answer: 1" in r.summary()
    with pytest.raises(DataError, match=r"mixed\.jsonl:2: bad row \(missing:answer\)"):
        load_prompt_dataset(_cfg(f"data.train_files=[{p}]", "data.on_bad_row=error"), char_tok)


def test_configurable_fields(tmp_path, char_tok):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question": "2+2", "final": "4"}\n')
    ds = load_prompt_dataset(_cfg(f"data.train_files=[{p}]", "data.prompt_key=question", "data.answer_key=final"),
                             char_tok)
    assert ds.examples[0]["problem"] == "2+2" and ds.examples[0]["answer"] == "4"


def test_missing_file_is_named(tmp_path, char_tok):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_dataset(_cfg(f"data.train_files=[{missing}]"), char_tok)


def test_no_rows_left_is_an_error(tmp_path, char_tok):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"x": 1}\n')
    with pytest.raises(DataError, match="no training prompts left"):
        load_prompt_dataset(_cfg(f"data.train_files=[{p}]"), char_tok)


def test_length_filter_drops_and_counts(tmp_path, qwen_tok):
    path = _gsm8k_head(tmp_path, n=40)
    full = load_prompt_dataset(_cfg(f"data.train_files=[{path}]"), qwen_tok)
    lengths = np.array([len(ex["prompt_ids"]) for ex in full.examples])
    limit = int(np.median(lengths))
    cut = load_prompt_dataset(_cfg(f"data.train_files=[{path}]", f"data.max_prompt_length={limit}"), qwen_tok)
    assert cut.report.n_too_long == int((lengths > limit).sum()) > 0
    assert len(cut) == int((lengths <= limit).sum())
    assert [ex["index"] for ex in cut.examples] == [i for i, n in enumerate(lengths) if n <= limit]
    assert all(len(ex["prompt_ids"]) <= limit for ex in cut.examples)  # dropped, never truncated
    assert cut.report.max_prompt_tokens == lengths[lengths <= limit].max()


def test_parquet_and_local_hf_directory(tmp_path, char_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"problem": ["a", "b", "c"], "answer": ["1", "2", None]})
    pq.write_table(table, tmp_path / "t.parquet")
    ds = load_prompt_dataset(_cfg(f"data.train_files=[{tmp_path / 't.parquet'}]", "data.source=parquet"), char_tok)
    assert [ex["problem"] for ex in ds.examples] == ["a", "b"] and ds.report.bad_reasons == {"missing:answer": 1}

    hub_layout = tmp_path / "hfds" / "data"
    hub_layout.mkdir(parents=True)
    pq.write_table(pa.table({"problem": ["p0", "p1"], "answer": ["0", "1"]}), hub_layout / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"problem": ["t0"], "answer": ["9"]}), hub_layout / "test-00000-of-00001.parquet")
    cfg = _cfg(f"data.train_files=[{tmp_path / 'hfds'}]", f"data.val_files=[{tmp_path / 'hfds'}]", "data.source=hf")
    assert [ex["problem"] for ex in load_prompt_dataset(cfg, char_tok).examples] == ["p0", "p1"]
    assert [ex["problem"] for ex in load_prompt_dataset(cfg, char_tok, "val").examples] == ["t0"]
    with pytest.raises(DataError, match="no .* file for split 'validation'"):
        load_prompt_dataset(_cfg(f"data.train_files=[{tmp_path / 'hfds'}]", "data.source=hf",
                                 "data.hf_split=validation"), char_tok)


def test_hub_id_offline_is_a_clear_error(char_tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="cannot download hub dataset 'someorg/somedata'"):
        load_prompt_dataset(_cfg("data.train_files=[someorg/somedata]", "data.source=hf"), char_tok)


def test_gym_source_with_held_out_split(char_tok):
    cfg = _cfg("data.source=gym", "data.gym.task=chain_sum", "data.gym.size=30", "data.gym.val_size=20",
               "data.gym.config={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}", "reward.kind=gym")
    train = load_prompt_dataset(cfg, char_tok)
    val = load_prompt_dataset(cfg, char_tok, "val")
    assert len(train) == 30 and len(val) + val.report.n_overlap_dropped == 20
    assert not {ex["problem"] for ex in val.examples} & {ex["problem"] for ex in train.examples}
    ex = train.examples[0]
    assert ex["gold"]["answer"] == ex["answer"] and ex["gold"]["question"] == ex["problem"]
    assert ex["data_source"] == "gym/chain_sum" and ex["prompt"].startswith("<|im_start|>user\n")
    assert char_tok.decode(ex["prompt_ids"].tolist()) == ex["prompt"]


def test_bad_split_name(char_tok):
    with pytest.raises(ConfigError, match="split="):
        load_prompt_dataset(_cfg(), char_tok, "test")


# ----------------------------------------------------------------------------------------- iteration


def _examples(n):
    return [{"index": i, "answer": str(i), "prompt_ids": np.array([i], np.int32)} for i in range(n)]


def _take(it, k):
    return [[ex["index"] for ex in next(it)] for _ in range(k)]


def test_seeded_shuffle_is_deterministic_and_a_permutation_per_epoch():
    ex = _examples(12)
    a = _take(make_iterator(ex, 4, seed=7, shard_index=0, shard_count=1), 6)
    b = _take(make_iterator(ex, 4, seed=7, shard_index=0, shard_count=1), 6)
    c = _take(make_iterator(ex, 4, seed=8, shard_index=0, shard_count=1), 6)
    assert a == b and a != c
    epoch1, epoch2 = sum(a[:3], []), sum(a[3:], [])
    assert sorted(epoch1) == sorted(epoch2) == list(range(12)) and epoch1 != epoch2
    assert _take(make_iterator(ex, 4, seed=7, shuffle=False, shard_index=0, shard_count=1), 3) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_finite_epochs_stop():
    it = make_iterator(_examples(10), 4, seed=0, num_epochs=1, shard_index=0, shard_count=1)
    assert len(list(it)) == 2  # the partial third batch is dropped


def test_iterator_state_restores_the_same_next_batches():
    ex = _examples(10)
    it = make_iterator(ex, 3, seed=1, shard_index=0, shard_count=1)
    _take(it, 5)  # crosses an epoch boundary
    state = json.loads(json.dumps(it.get_state()))  # JSON-able, as Orbax / grain's handler store it
    expected = _take(it, 4)
    resumed = make_iterator(ex, 3, seed=1, shard_index=0, shard_count=1)
    resumed.set_state(state)
    assert _take(resumed, 4) == expected


def test_iterator_state_through_orbax_checkpoint_manager(tmp_path):
    import grain
    import orbax.checkpoint as ocp

    ex = _examples(10)
    it = make_iterator(ex, 3, seed=1, shard_index=0, shard_count=1)
    _take(it, 4)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",))
    mngr.save(4, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = _take(it, 3)
    resumed = make_iterator(ex, 3, seed=1, shard_index=0, shard_count=1)
    mngr.restore(4, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
    assert _take(resumed, 3) == expected
    mngr.close()


def test_two_processes_split_each_global_batch():
    ex = _examples(16)
    single = _take(make_iterator(ex, 4, seed=3, shard_index=0, shard_count=1), 8)
    p0 = _take(make_iterator(ex, 4, seed=3, shard_index=0, shard_count=2), 8)
    p1 = _take(make_iterator(ex, 4, seed=3, shard_index=1, shard_count=2), 8)
    for s in range(8):
        assert len(p0[s]) == len(p1[s]) == 2 and not set(p0[s]) & set(p1[s])
        assert sorted(p0[s] + p1[s]) == sorted(single[s])  # same prompts per step as one process
    with pytest.raises(ValueError, match="not divisible by the 3"):
        make_iterator(ex, 4, seed=3, shard_index=0, shard_count=3)
    with pytest.raises(ValueError, match="shard_index=2 out of range"):
        make_iterator(ex, 4, seed=3, shard_index=2, shard_count=2)
    with pytest.raises(DataError, match="empty"):
        make_iterator([], 4, seed=0)


def test_default_shard_is_this_jax_process():
    import jax

    assert jax.process_count() == 1
    it = make_iterator(_examples(4), 2, seed=0, shuffle=False)
    assert _take(it, 2) == [[0, 1], [2, 3]]


def test_fingerprint_tracks_content(tmp_path, char_tok):
    path = _gsm8k_head(tmp_path, n=5)
    a = load_prompt_dataset(_cfg(f"data.train_files=[{path}]"), char_tok)
    b = load_prompt_dataset(_cfg(f"data.train_files=[{path}]"), char_tok)
    c = load_prompt_dataset(_cfg(f"data.train_files=[{path}]", "data.prompt_suffix=''"), char_tok)
    assert a.fingerprint == b.fingerprint != c.fingerprint


# ----------------------------------------------------------------------------------------- tokenizer


def test_builtin_tokenizer_round_trip_and_specials(char_tok, tmp_path):
    assert len(char_tok) == 103
    assert char_tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert stop_token_ids(char_tok) == [2, 0] and pad_token_id(char_tok) == 0
    text = "<|im_start|>user\nCompute 12 + 7 = ?\t{ok}<|im_end|>\n"
    ids = char_tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-2] == 2 and len(ids) == len(text) - len("<|im_start|>") - len("<|im_end|>") + 2
    assert char_tok.decode(ids) == text
    assert char_tok.decode(char_tok("é")["input_ids"]) == "<|unk|>"  # outside ASCII: unknown, not dropped
    char_tok.save_pretrained(tmp_path / "tok")
    again = load_tokenizer(load_config(None, [f"tokenizer.path={tmp_path / 'tok'}"]))
    assert again(text, add_special_tokens=False)["input_ids"] == ids


def test_qwen3_tokenizer_ids(qwen_tok):
    # conventions.md §6 / DATA.md checks
    assert len(qwen_tok) == 151669
    assert qwen_tok("Hello, AI!", add_special_tokens=False)["input_ids"] == [9707, 11, 15235, 0]
    assert stop_token_ids(qwen_tok) == [151645, 151643] and pad_token_id(qwen_tok) == 151643


def test_tokenizer_config_errors():
    with pytest.raises(ConfigError, match="tokenizer.path or model.path"):
        load_tokenizer(load_config(None))
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(load_config(None, ["tokenizer.path=./no/such/dir"]))
