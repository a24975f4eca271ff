"""Experience collection: rewards -> advantages -> packing, DAPO dynamic sampling, overlong shaping,
truncated-response filtering; with a scripted rollout source and verifier (no model needed)."""
import itertools

import numpy as np
import pytest

from stapo_jax.train.experience import collect_experience
from stapo_jax.config.recipes import get_recipe
from stapo_jax.rollout.driver import RolloutBatch


class ScriptedRollouts:
    """Row i*G+g of prompt i answers token 5 + g; a response ends with EOS (id 1) unless it is 'long'."""

    def __init__(self, long_rows=()):
        self.calls = 0
        self.long_rows = set(long_rows)

    def generate(self, prompts, *, num_samples, max_new_tokens, seed, sampling=None):
        self.calls += 1
        rows, lengths, reasons = [], [], []
        for i, _ in enumerate(prompts):
            for g in range(num_samples):
                r = i * num_samples + g
                n = max_new_tokens if r in self.long_rows else 2
                rows.append([5 + g] * (n - 1) + ([7] if r in self.long_rows else [1]))
                lengths.append(n)
                reasons.append("length" if r in self.long_rows else "eos")
        n_rows = len(rows)
        resp = np.zeros((n_rows, max_new_tokens), np.int32)
        mask = np.zeros((n_rows, max_new_tokens), np.int32)
        for r, toks in enumerate(rows):
            resp[r, :len(toks)] = toks
            mask[r, :len(toks)] = 1
        return RolloutBatch(prompt_index=np.repeat(np.arange(len(prompts)), num_samples).astype(np.int32),
                            responses=resp, response_mask=mask, rollout_log_probs=-np.ones(resp.shape, np.float32) * mask,
                            response_lengths=np.asarray(lengths, np.int32), finish_reasons=reasons,
                            prompts=[np.asarray(prompts[r // num_samples], np.int32) for r in range(n_rows)])


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 1))


class Scorer:
    """gold 'all' -> every sample correct; 'none' -> none; 'first' -> only sample g=0 (token 5) correct."""

    def score(self, texts, golds):
        s = np.array([1.0 if g == "all" or (g == "first" and t.startswith("5")) else 0.0
                      for t, g in zip(texts, golds)], np.float32)
        return s, {"n": float(len(s)), "n_correct": float(s.sum()), "n_timeout": 0.0, "n_error": 0.0}


def batches(golds):
    it = itertools.cycle(golds)
    while True:
        yield [{"prompt_ids": np.array([3, 4], np.int32), "gold": next(it)} for _ in range(2)]


def test_plain_grpo_experience_layout_and_advantages():
    exp = collect_experience(ScriptedRollouts(), batches(["first", "all"]), Scorer(), Tok(), get_recipe("stapo"),
                             group_size=4, max_new_tokens=6, seed=0, pad_id=0)
    a = exp.arrays
    assert a["input_ids"].shape[0] == 8 and a["response_mask"].sum(1).tolist() == [2] * 8
    adv = a["advantages"]
    # group 0: one correct of 4 -> z-scores with ddof 1; group 1: all correct -> exactly 0
    r = np.array([1.0, 0, 0, 0])
    np.testing.assert_allclose(adv[:4], (r - r.mean()) / (r.std(ddof=1) + 1e-6), rtol=1e-6)
    assert np.all(adv[4:] == 0.0)
    assert exp.metrics["acc/mean"] == pytest.approx(5 / 8) and exp.metrics["advantages/zero_group_frac"] == 0.5
    np.testing.assert_array_equal(a["rollout_log_probs"][a["response_mask"]], -1.0)


def test_dynamic_sampling_drops_constant_groups_and_refills():
    src = ScriptedRollouts()
    recipe = get_recipe("dapo", overlong={"overlong_buffer_len": 0})
    # every generation round brings one informative ('first') and one constant ('none') prompt
    exp = collect_experience(src, batches(["first", "none"]), Scorer(), Tok(), recipe, group_size=4,
                             max_new_tokens=6, seed=0, pad_id=0)
    assert src.calls == 2 and exp.metrics["sampling/gen_rounds"] == 2.0
    assert exp.num_rows == 8 and np.all(exp.arrays["advantages"].reshape(2, 4).std(1) > 0)
    # nothing informative at all: a clear error after max_gen_batches rounds
    with pytest.raises(RuntimeError, match="every group had equal rewards in 3 generation rounds"):
        collect_experience(ScriptedRollouts(), batches(["none", "all"]), Scorer(), Tok(),
                           recipe.replace(sampling={"max_gen_batches": 3}), group_size=4, max_new_tokens=6, seed=0, pad_id=0)


def test_overlong_shaping_and_drop_truncated():
    recipe = get_recipe("stapo", overlong={"overlong_buffer_len": 4, "overlong_penalty": 1.0}, drop_truncated=True)
    exp = collect_experience(ScriptedRollouts(long_rows={1}), batches(["all", "all"]), Scorer(), Tok(), recipe,
                             group_size=4, max_new_tokens=8, seed=0, pad_id=0)
    # row 1 hit the 8-token limit: penalty min(0, -(8 - (8 - 4)) / 4) = -1 on top of its score 1
    assert exp.rewards[1] == pytest.approx(0.0) and exp.rewards[0] == pytest.approx(1.0)
    assert exp.arrays["response_mask"][1].sum() == 0 and exp.arrays["response_mask"][0].sum() == 2
    assert exp.metrics["response_length/clip_frac"] == pytest.approx(1 / 8)


def test_heldout_accuracy_shows_a_bar_with_the_running_accuracy(capsys):
    """Greedy held-out accuracy over batches; with progress on, a bar 'held-out' (problems, acc=) on stderr."""
    from stapo_jax.train.experience import heldout_accuracy

    examples = [{"prompt_ids": np.array([3, 4], np.int32), "gold": g} for g in ["all", "none", "all", "all", "none"]]
    assert heldout_accuracy(ScriptedRollouts(), examples, Tok(), Scorer(), max_new_tokens=4, batch_size=2) == 0.6
    assert capsys.readouterr().err == ""                      # quiet by default
    src = ScriptedRollouts()
    assert heldout_accuracy(src, examples, Tok(), Scorer(), max_new_tokens=4, batch_size=2, progress=True) == 0.6
    err = capsys.readouterr().err
    assert src.calls == 3 and "held-out" in err and "5/5" in err and "acc=0.6000" in err
    with pytest.raises(ValueError, match="val_size"):
        heldout_accuracy(src, [], Tok(), Scorer(), max_new_tokens=4)


class CompilingRollouts(ScriptedRollouts):
    """ScriptedRollouts whose first call compiles a new program that takes at least 0.3 s to trace (a forced
    recompile inside the sampling call)."""

    def generate(self, prompts, **kw):
        import time

        import jax

        if self.calls == 0:
            def slow_to_trace(x):
                time.sleep(0.3)
                return x + time.time_ns() % 1_000_003  # a new constant: never a persistent-cache hit
            jax.jit(slow_to_trace)(np.ones(3, np.float32)).block_until_ready()
        return super().generate(prompts, **kw)


def test_rollout_tokens_per_s_leaves_out_the_rollout_compile_time():
    """rollout/tokens_per_s = generated tokens / (time/rollout - the rollout phase's compile seconds), i.e. over
    the ``time/rollout`` the trainer reports, not over the wall time that includes the compile."""
    from stapo_jax.runtime.compile_stats import CompileStats

    with CompileStats() as stats:
        exp = collect_experience(CompilingRollouts(), batches(["first", "all"]), Scorer(), Tok(), get_recipe("stapo"),
                                 group_size=4, max_new_tokens=6, seed=0, pad_id=0, compile_phase=stats.phase)
        compiled = stats.take_step()["time/compile/rollout"]
    m, tokens = exp.metrics, 8 * 2.0  # 8 rows of 2 tokens
    assert compiled >= 0.3 and m["time/rollout"] > compiled
    assert m["rollout/tokens_per_s"] == pytest.approx(tokens / (m["time/rollout"] - compiled), rel=1e-9)
    assert m["rollout/tokens_per_s"] > 2 * tokens / m["time/rollout"]  # the compile dominates the wall time
