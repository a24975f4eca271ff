"""RolloutDriver: continuous batching, groups, EOS/length handling, ragged prompts, determinism, bad input,
bounded asynchronous dispatch."""
import jax
import numpy as np
import pytest

from fixtures_rollout import RAGGED_PROMPTS, make_engine, rows_of, tiny_model
from stapo_jax.rollout.dispatch import DISPATCH_WINDOW
from stapo_jax.rollout.driver import PromptTooLongError, RolloutDriver, RolloutInputError
from stapo_jax.rollout.sampling import SamplingParams

MODEL = tiny_model(0)
EOS = tuple(range(3, 128, 16))  # 8 stop ids: sampled rows end at varied lengths
PROMPTS = [[(7 * i + j) % 128 for j in range(1 + (5 * i) % 13)] for i in range(10)]  # ragged, 1..13 tokens
SAMPLING = SamplingParams(temperature=1.0)


def driver(slots, sampling=SAMPLING, eos=EOS, **kw):
    return RolloutDriver(make_engine(MODEL, slots=slots, sampling=sampling, eos_token_ids=eos), **kw)


@pytest.fixture(scope="module")
def wide():
    """Every sample has its own slot (30 rows, 32 slots): no refilling needed."""
    return driver(32).generate(PROMPTS, num_samples=3, max_new_tokens=12, seed=5)


def test_continuous_batching_more_samples_than_slots_equals_one_wave(wide):
    drv = driver(4)
    steps = []
    step = drv.engine.step
    drv.engine.step = lambda *a, **k: steps.append(1) or step(*a, **k)
    narrow = drv.generate(PROMPTS, num_samples=3, max_new_tokens=12, seed=5)
    np.testing.assert_array_equal(narrow.responses, wide.responses)
    np.testing.assert_array_equal(narrow.response_mask, wide.response_mask)
    np.testing.assert_allclose(narrow.rollout_log_probs, wide.rollout_log_probs, atol=1e-5)
    assert narrow.finish_reasons == wide.finish_reasons
    lengths = wide.response_lengths
    assert len(set(lengths.tolist())) > 3, "lengths should vary for this test to mean something"
    # Refilling at once: the 4 slots are busy on every step but the tail, so the step count is far below
    # static batching in waves of 4 (each wave lasting as long as its longest row).
    waves = sum(lengths[i:i + 4].max() for i in range(0, len(lengths), 4))
    assert len(steps) <= int(np.ceil(lengths.sum() / 4)) + lengths.max()
    assert len(steps) < waves
    # Several steps per host round trip (lax.scan inside one jitted call): same samples.
    chunked = driver(4, steps_per_sync=5).generate(PROMPTS, num_samples=3, max_new_tokens=12, seed=5)
    np.testing.assert_array_equal(chunked.responses, wide.responses)
    np.testing.assert_allclose(chunked.rollout_log_probs, wide.rollout_log_probs, atol=1e-5)
    assert chunked.finish_reasons == wide.finish_reasons


def test_groups_eos_and_padding(wide):
    b = wide
    assert b.responses.shape == (30, 12) and b.prompt_index.tolist() == np.repeat(np.arange(10), 3).tolist()
    for r in range(30):
        assert b.prompts[r].tolist() == PROMPTS[r // 3]
        k = b.response_lengths[r]
        assert b.response_mask[r].tolist() == [1] * k + [0] * (12 - k)
        toks = rows_of(b, r)
        assert not any(t in EOS for t in toks[:-1]), "no token after an EOS"
        if b.finish_reasons[r] == "eos":
            assert toks[-1] in EOS
        else:
            assert b.finish_reasons[r] == "length" and k == 12 and toks[-1] not in EOS
        assert (b.responses[r, k:] == 0).all() and (b.rollout_log_probs[r, k:] == 0).all()
        assert (b.rollout_log_probs[r, :k] < 0).all()
    assert {"eos", "length"} <= set(b.finish_reasons)
    groups = b.responses.reshape(10, 3, 12)
    assert any(len({g.tobytes() for g in grp}) > 1 for grp in groups), "samples of a group should differ"


def test_greedy_groups_are_identical_and_ragged_prompts_are_independent():
    drv = driver(3, sampling=SamplingParams(greedy=True), eos=(5,))
    b = drv.generate(RAGGED_PROMPTS, num_samples=2, max_new_tokens=10)
    for i, p in enumerate(RAGGED_PROMPTS):
        assert rows_of(b, 2 * i) == rows_of(b, 2 * i + 1)
        alone = drv.generate([p], max_new_tokens=10)
        assert rows_of(alone, 0) == rows_of(b, 2 * i)
        np.testing.assert_allclose(alone.rollout_log_probs[0], b.rollout_log_probs[2 * i], atol=1e-5)


def test_deterministic_for_a_seed():
    drv = driver(4)
    a = drv.generate(PROMPTS[:4], num_samples=2, max_new_tokens=8, seed=11)
    b = drv.generate(PROMPTS[:4], num_samples=2, max_new_tokens=8, seed=11)
    c = drv.generate(PROMPTS[:4], num_samples=2, max_new_tokens=8, seed=12)
    np.testing.assert_array_equal(a.responses, b.responses)
    np.testing.assert_array_equal(a.rollout_log_probs, b.rollout_log_probs)
    assert not np.array_equal(a.responses, c.responses)


def test_prompt_truncation_modes():
    long = list(range(1, 41))  # 40 tokens > max_prefill_length 32
    greedy = SamplingParams(greedy=True)
    for mode, kept in (("left", long[-32:]), ("right", long[:32])):
        b = driver(2, sampling=greedy, prompt_truncation=mode).generate([long], max_new_tokens=6)
        ref = driver(2, sampling=greedy).generate([kept], max_new_tokens=6)
        assert b.prompts[0].tolist() == kept and rows_of(b, 0) == rows_of(ref, 0)


@pytest.mark.parametrize(
    "prompts,kwargs,error,match",
    [
        ([[1, 2], list(range(40))], {}, PromptTooLongError, "prompt 1 has 40 tokens.*max_prefill_length=32"),
        ([[1, 2], []], {}, RolloutInputError, "prompt 1 is empty"),
        ([[1, 2]], {"max_new_tokens": 0}, RolloutInputError, "max_new_tokens must be an int > 0"),
        ([[1, 2]], {"max_new_tokens": -3}, RolloutInputError, "max_new_tokens must be an int > 0"),
        ([[1, 2]], {"max_new_tokens": 17}, RolloutInputError, "exceeds the engine's max_decode_length=16"),
        ([[1, 2]], {"num_samples": 0}, RolloutInputError, "num_samples"),
        ([[1, 200]], {}, RolloutInputError, r"prompt 0 holds token ids outside \[0, 128\)"),
        ([], {}, RolloutInputError, "prompts is empty"),
        ([[[1, 2]]], {}, RolloutInputError, "prompt 0 must be a 1-D"),
    ],
)
def test_bad_input_raises_clear_errors(prompts, kwargs, error, match):
    with pytest.raises(error, match=match):
        driver(2).generate(prompts, **kwargs)


def test_bad_driver_settings():
    with pytest.raises(RolloutInputError, match="prompt_truncation"):
        driver(2, prompt_truncation="middle")
    with pytest.raises(RolloutInputError, match="steps_per_sync"):
        driver(2, steps_per_sync=0)


def test_build_rollout_takes_steps_per_sync_from_the_config():
    from stapo_jax.config.schema import Config
    from stapo_jax.rollout import build_rollout

    cfg = Config()
    cfg.rollout.max_new_tokens, cfg.data.max_prompt_length, cfg.rollout.max_concurrent_decodes = 8, 16, 2
    assert build_rollout(cfg, tiny_model(0)).steps_per_sync == 8  # the default
    cfg.rollout.steps_per_sync = 3
    assert build_rollout(cfg, tiny_model(0)).steps_per_sync == 3


def test_row_offset_samples_a_share_of_the_global_batch(wide):
    """A process sampling prompts [4, 10) with row_offset = 4 * G draws exactly rows 12.. of the whole batch
    (the multi-process share of stapo_jax.rollout.multihost); a wrong offset draws other tokens."""
    share = driver(8).generate(PROMPTS[4:], num_samples=3, max_new_tokens=12, seed=5, row_offset=12)
    np.testing.assert_array_equal(share.responses, wide.responses[12:])
    np.testing.assert_allclose(share.rollout_log_probs, wide.rollout_log_probs[12:], atol=1e-5)
    unshifted = driver(8).generate(PROMPTS[4:], num_samples=3, max_new_tokens=12, seed=5)
    assert not np.array_equal(unshifted.responses, wide.responses[12:])
    with pytest.raises(RolloutInputError, match="row_offset"):
        driver(8).generate(PROMPTS, num_samples=3, max_new_tokens=12, seed=5, row_offset=-1)


def test_refill_waits_every_dispatch_window(monkeypatch, wide):
    """32 free slots before the first step (30 rows, 10 prefills + 30 inserts + cache resizes, none of whose results
    the host reads): a spy logs each program the driver dispatches and each wait (``jax.block_until_ready``, or
    ``jax.device_get`` of a step's results). The refill waits after the call that brings the count to
    ``DISPATCH_WINDOW``, so at most ``DISPATCH_WINDOW + 2`` programs (a refill's prefill, resize and insert) run
    between two waits; the tokens are those of the unspied run."""
    drv = driver(32)
    events = []

    def spy(name, fn):
        return lambda *a, **k: events.append(name) or fn(*a, **k)

    for name in ("prefill_batch", "resize_decode_state", "insert_sample", "step"):
        monkeypatch.setattr(drv.engine, name, spy("dispatch", getattr(drv.engine, name)))
    for name in ("block_until_ready", "device_get"):
        monkeypatch.setattr(jax, name, spy("wait", getattr(jax, name)))
    got = drv.generate(PROMPTS, num_samples=3, max_new_tokens=12, seed=5)
    np.testing.assert_array_equal(got.responses, wide.responses)
    runs, run = [], 0
    for e in events:
        run = 0 if e == "wait" else run + 1
        runs.append(run)
    n_dispatch = events.count("dispatch")
    print("dispatches", n_dispatch, "waits", events.count("wait"), "longest run", max(runs))
    assert n_dispatch >= 40 and DISPATCH_WINDOW <= max(runs) <= DISPATCH_WINDOW + 2, (n_dispatch, max(runs))
    first_step = events.index("wait", events.index("dispatch"))
    assert first_step < 12, events[:20]  # the first refill waits after its first window, not at the first step
