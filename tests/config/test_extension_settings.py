"""Extensions own their settings (issue 44 item 3): a token mask, a reward kind, a policy loss or an advantage
estimator registered with a settings dataclass and a section is set from YAML through the real config loader, the
recipe / scorer / loss / estimator gets the instance, and the setting changes the result. Also the built-in ones that were not settable: ``cov.*`` (Clip-Cov / KL-Cov)
and ``reward.math_verify_strict.*`` (``rel_tol``, ``require_think_close``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import pytest

from stapo_jax.algo.advantages import ADVANTAGE_ESTIMATORS, recipe_advantages, register_adv_est
from stapo_jax.algo.masks import (TOKEN_MASKS, CovConfig, S2TConfig, TokenMask, TopEntropyConfig,
                                  register_token_mask)
from stapo_jax.algo.objectives import (POLICY_LOSSES, PolicyLossInputs, compute_policy_loss, get_policy_loss_fn,
                                       register_policy_loss)
from stapo_jax.algo.recipes import compute_token_mask, recipe_field
from stapo_jax.core.errors import ConfigError
from stapo_jax.core.registry import DeclaredSettings, settings_for
from stapo_jax.core.settings import check_field_types
from stapo_jax.config.extensions import declared_sections
from stapo_jax.config.recipes import get_recipe, recipe_from_config
from stapo_jax.config.schema import Config, from_dict, load_config
from stapo_jax.rewards import make_scorer
from stapo_jax.rewards.math_strict import MathStrictSettings
from stapo_jax.rewards.registry import REWARD_KINDS, RewardKind, register_reward

# ------------------------------------------------------------------ a new mask with a setting of its own


@dataclass(frozen=True)
class EntropyCapSettings:
    """Keep the valid tokens whose entropy is at most ``cap`` (nats)."""

    cap: float = 1.0

    def __post_init__(self):
        check_field_types(self, "entropy_cap")
        if not self.cap > 0:
            raise ConfigError(f"entropy_cap.cap={self.cap} must be > 0")


def entropy_cap_mask(entropy, response_mask, *, cap=1.0):
    valid = response_mask.astype(bool)
    return valid & (entropy <= cap), jnp.asarray(cap, entropy.dtype)


# ------------------------------------------------------------------ a new reward with a setting of its own


@dataclass(frozen=True)
class ShortAnswerSettings:
    """Score 1 for a response of at most ``max_chars`` characters."""

    max_chars: int = 10

    def __post_init__(self):
        check_field_types(self, "reward.short_answer")
        if self.max_chars < 1:
            raise ConfigError(f"reward.short_answer.max_chars={self.max_chars} must be >= 1")


def short_answer(response: str, gold: str, max_chars: int = 10) -> float:
    return 1.0 if len(response) <= max_chars else 0.0


@pytest.fixture
def extensions():
    """Register the two examples (as their own file would), and remove them afterwards."""
    register_token_mask("entropy_cap", needs=("entropy",), settings=("entropy_cap.cap",), population="valid tokens",
                        settings_cls=EntropyCapSettings, section="entropy_cap")(entropy_cap_mask)
    register_reward("short_answer", settings_cls=ShortAnswerSettings, section="reward.short_answer")(short_answer)
    yield
    dict.__delitem__(TOKEN_MASKS, "entropy_cap")
    dict.__delitem__(REWARD_KINDS, "short_answer")


ENTROPY = jnp.asarray([[0.2, 0.9, 1.4, 3.0], [0.1, 2.0, 0.6, 0.0]], jnp.float32)
RESPONSE_MASK = jnp.asarray([[1, 1, 1, 1], [1, 1, 1, 0]], jnp.int32)


def _scorer(cfg):
    """The scorer of a run config, given the sections it reads."""
    return make_scorer(cfg.reward, gym_task=cfg.data.gym.task, extensions=cfg.extensions)


def _write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_new_mask_reads_its_own_section_from_yaml(extensions, tmp_path):
    path = _write(tmp_path, "algorithm:\n  recipe: grpo\nactor:\n  token_mask: entropy_cap\nentropy_cap:\n  cap: 0.5\n")
    cfg = load_config(path)
    assert cfg.extensions == {"entropy_cap": EntropyCapSettings(cap=0.5)}
    recipe = recipe_from_config(cfg)
    keep, stats = compute_token_mask(recipe, response_mask=RESPONSE_MASK, entropy=ENTROPY)
    assert np.asarray(keep).tolist() == [[True, False, False, False], [True, False, False, False]]
    assert float(stats["entropy_cap/threshold"]) == 0.5
    # the setting changes the result; an override reaches it as well
    keep2, _ = compute_token_mask(recipe_from_config(load_config(path, ["entropy_cap.cap=1.5"])),
                                  response_mask=RESPONSE_MASK, entropy=ENTROPY)
    assert np.asarray(keep2).tolist() == [[True, True, True, False], [True, False, True, False]]
    # absent section: not held, the mask reads the class defaults (cap 1.0); the saved config reloads to an equal one
    default = recipe_from_config(from_dict({"algorithm": {"recipe": "grpo"}, "actor": {"token_mask": "entropy_cap"}}))
    assert default.extensions == {}
    keep_default, stats_default = compute_token_mask(default, response_mask=RESPONSE_MASK, entropy=ENTROPY)
    assert np.asarray(keep_default).tolist() == [[True, True, False, False], [True, False, True, False]]
    assert float(stats_default["entropy_cap/threshold"]) == 1.0
    assert load_config(cfg.save(tmp_path / "run")) == cfg


def test_a_recipe_built_in_python_reads_its_mask_defaults(extensions):
    """``get_recipe("justrl", token_mask="entropy_cap")`` has ``extensions={}``; its mask used to raise
    AttributeError "recipe 'justrl' has no settings section 'entropy_cap'" at trace time. It now takes the mask's
    declared defaults (cap 1.0), as a policy loss or an estimator does (``Registry.bound``); given settings win."""
    recipe = get_recipe("justrl", token_mask="entropy_cap")
    assert recipe.extensions == {}
    assert recipe_field(recipe, "entropy_cap.cap") == 1.0
    keep, stats = compute_token_mask(recipe, response_mask=RESPONSE_MASK, entropy=ENTROPY)
    assert np.asarray(keep).tolist() == [[True, True, False, False], [True, False, True, False]]
    assert float(stats["entropy_cap/threshold"]) == 1.0
    wide = recipe.replace(extensions={"entropy_cap": EntropyCapSettings(cap=2.5)})
    assert np.asarray(compute_token_mask(wide, response_mask=RESPONSE_MASK, entropy=ENTROPY)[0]).tolist() == [
        [True, True, True, False], [True, True, True, False]]
    with pytest.raises(AttributeError, match=r"recipe 'justrl' has no settings section 'other_mask'"):
        recipe_field(recipe, "other_mask.cap")  # a section no selected extension declares


def test_new_mask_section_errors_name_the_key(extensions):
    with pytest.raises(ConfigError, match=r"entropy_cap.cap=-1.0 must be > 0"):
        from_dict({"algorithm": {"recipe": "grpo"}, "actor": {"token_mask": "entropy_cap"}, "entropy_cap": {"cap": -1}})
    with pytest.raises(ConfigError, match=r"unknown config key 'entropy_cap.capp'; did you mean 'entropy_cap.cap'"):
        from_dict({"algorithm": {"recipe": "grpo"}, "entropy_cap": {"capp": 1}})
    with pytest.raises(ConfigError, match=r"entropy_cap.cap: expected float, got str"):
        from_dict({"algorithm": {"recipe": "grpo"}, "entropy_cap": {"cap": "wide"}})


def test_new_reward_reads_its_own_section_from_yaml(extensions, tmp_path):
    path = _write(tmp_path, "reward:\n  kind: short_answer\n  short_answer:\n    max_chars: 3\n")
    cfg = load_config(path)
    assert cfg.extensions == {"reward.short_answer": ShortAnswerSettings(max_chars=3)}
    responses, golds = ["abc", "abcdef", "a"], ["", "", ""]
    with _scorer(cfg) as scorer:
        assert scorer.score(responses, golds)[0].tolist() == [1.0, 0.0, 1.0]
    with _scorer(load_config(path, ["reward.short_answer.max_chars=6"])) as scorer:
        assert scorer.score(responses, golds)[0].tolist() == [1.0, 1.0, 1.0]
    with _scorer(from_dict({"reward": {"kind": "short_answer"}})) as scorer:  # absent: default 10
        assert scorer.score(["x" * 10, "x" * 11], ["", ""])[0].tolist() == [1.0, 0.0]
    with pytest.raises(ConfigError, match=r"reward.short_answer.max_chars=0 must be >= 1"):
        load_config(path, ["reward.short_answer.max_chars=0"])


def test_settings_are_declared_once_in_the_registry(extensions):
    """A mask's / reward kind's settings class and section were stored twice (``TokenMask.settings_cls`` /
    ``RewardKind.settings_cls`` and the registry); the registry's declaration is now the only one, and what reads
    it (``RewardKind.keywords``, ``make_scorer``) gets the same settings."""
    assert not {"settings_cls", "section"} & {f.name for f in dataclasses.fields(TokenMask)}
    assert not {"settings_cls", "section"} & {f.name for f in dataclasses.fields(RewardKind)}
    assert TOKEN_MASKS.declared("entropy_cap") == DeclaredSettings("entropy_cap", EntropyCapSettings, "entropy_cap")
    assert TOKEN_MASKS.declared("s2t") == DeclaredSettings("s2t", S2TConfig, "s2t")
    assert REWARD_KINDS.declared("short_answer") == DeclaredSettings("short_answer", ShortAnswerSettings,
                                                                     "reward.short_answer")
    assert TOKEN_MASKS.declared("kl_cov").settings_cls is CovConfig and REWARD_KINDS.declared("think_format") is None
    kind = REWARD_KINDS["short_answer"]
    assert kind.keywords({}, ShortAnswerSettings(max_chars=3)) == {"max_chars": 3}
    assert kind.keywords({}) == {"max_chars": 10}  # None: the declared class's defaults
    assert REWARD_KINDS["boxed_exact_01"].keywords({"boxed_normalize": True}) == {"plus_minus": False,
                                                                                  "normalize": True}
    with pytest.raises(TypeError, match=r"reward kind 'short_answer' takes ShortAnswerSettings settings, got "
                                        r"EntropyCapSettings"):
        kind.keywords({}, EntropyCapSettings())
    with _scorer(from_dict({"reward": {"kind": "short_answer", "short_answer": {"max_chars": 2}}})) as scorer:
        assert scorer.settings == ShortAnswerSettings(max_chars=2)
        assert scorer.score(["ab", "abc"], ["", ""])[0].tolist() == [1.0, 0.0]
    with _scorer(from_dict({"reward": {"kind": "think_format"}})) as scorer:  # declares none: no settings
        assert scorer.settings is None


def test_settings_for_is_imported_from_core_registry_only():
    """``stapo_jax.config.extensions`` re-exported ``settings_for``; it is defined and imported in one place."""
    import stapo_jax.config.extensions as config_extensions

    assert not hasattr(config_extensions, "settings_for") and "settings_for" not in config_extensions.__all__
    declared = TOKEN_MASKS.declared("s2t")
    assert settings_for({}, declared) == S2TConfig()
    assert settings_for({"s2t": S2TConfig(tau_p=0.01)}, declared) == S2TConfig(tau_p=0.01)
    assert settings_for({"s2t": S2TConfig(tau_p=0.01)}, None) is None


def test_cov_section_sets_clip_cov_and_kl_cov(tmp_path):
    path = _write(tmp_path, "algorithm:\n  recipe: grpo\nactor:\n  token_mask: kl_cov\ncov:\n  kl_cov_ratio: 0.5\n"
                            "  clip_cov_ratio: 0.25\n  clip_cov_lb: -2.0\n  clip_cov_ub: 7.0\n")
    recipe = recipe_from_config(load_config(path))
    assert (recipe.cov.kl_cov_ratio, recipe.cov.clip_cov_ratio, recipe.cov.clip_cov_lb, recipe.cov.clip_cov_ub) == (
        0.5, 0.25, -2.0, 7.0)
    lp = jnp.log(jnp.asarray([[0.1, 0.5, 0.9, 0.3], [0.2, 0.7, 0.4, 0.6]], jnp.float32))
    adv = jnp.asarray([1.0, -1.0], jnp.float32)
    mask = jnp.ones((2, 4), jnp.int32)
    sel, _ = compute_token_mask(recipe, response_mask=mask, log_probs=lp, advantages=adv)
    sel_default, _ = compute_token_mask(recipe_from_config(load_config(path, ["cov.kl_cov_ratio=0.0002"])),
                                        response_mask=mask, log_probs=lp, advantages=adv)
    assert int(np.asarray(sel).sum()) == 4 and int(np.asarray(sel_default).sum()) == 1  # floor(0.5 * 8), max(1, 0)
    for bad, msg in ((["cov.kl_cov_ratio=0"], r"cov.kl_cov_ratio=0.0 must be in \(0, 1\]"),
                     (["cov.clip_cov_lb=8"], r"cov.clip_cov_lb=8.0 must be < cov.clip_cov_ub=7.0")):
        with pytest.raises(ConfigError, match=msg):
            load_config(path, bad)


def test_math_verify_strict_settings_from_yaml():
    cfg = from_dict({"reward": {"kind": "math_verify_strict", "num_workers": 1,
                                "math_verify_strict": {"rel_tol": 1e-3, "require_think_close": True}}})
    assert cfg.extensions["reward.math_verify_strict"] == MathStrictSettings(rel_tol=1e-3, require_think_close=True)
    responses = ["</think> \\boxed{0.3333}", "\\boxed{0.3333}", "</think> \\boxed{0.33}"]
    with _scorer(cfg) as scorer:
        assert scorer.score(responses, ["\\frac{1}{3}"] * 3)[0].tolist() == [1.0, 0.0, 0.0]
    with _scorer(from_dict({"reward": {"kind": "math_verify_strict", "num_workers": 1}})) as scorer:  # defaults
        assert scorer.score(responses, ["\\frac{1}{3}"] * 3)[0].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match=r"reward.math_verify_strict.rel_tol=0.0 must be > 0"):
        from_dict({"reward": {"math_verify_strict": {"rel_tol": 0}}})
    with pytest.raises(ConfigError, match=r"reward.math_verify_strict.require_think_close: expected bool"):
        from_dict({"reward": {"math_verify_strict": {"require_think_close": "yes"}}})


# ------------------------------------------------------------------ a new policy loss with a setting of its own


@dataclass(frozen=True)
class ScaledPGSettings:
    """Multiply the advantages by ``scale`` (> 0) before the vanilla surrogate."""

    scale: float = 1.0

    def __post_init__(self):
        check_field_types(self, "actor.scaled_pg")
        if not self.scale > 0:
            raise ConfigError(f"actor.scaled_pg.scale={self.scale} must be > 0")


def scaled_pg_loss(inputs, config, *, scale):  # keyword-only, no default: a call without its settings fails
    return compute_policy_loss(dataclasses.replace(inputs, advantages=inputs.advantages * scale), config)


# ------------------------------------------------------------------ a new advantage estimator with a setting of its own


@dataclass(frozen=True)
class FixedBaselineSettings:
    """``A = R - baseline`` (a constant baseline in [0, 1])."""

    baseline: float = 0.0

    def __post_init__(self):
        check_field_types(self, "algorithm.fixed_baseline")
        if not 0.0 <= self.baseline <= 1.0:
            raise ConfigError(f"algorithm.fixed_baseline.baseline={self.baseline} must be in [0, 1]")


def fixed_baseline_advantages(rewards, group_ids, *, baseline, num_groups=None, **_unused):
    return (jnp.asarray(rewards, jnp.float32) - baseline).astype(jnp.float32)


@pytest.fixture
def loss_and_estimator():
    """Register the loss and the estimator (as their own files would), and remove them afterwards."""
    register_policy_loss("scaled_pg", settings_cls=ScaledPGSettings, section="actor.scaled_pg")(scaled_pg_loss)
    register_adv_est("fixed_baseline", settings_cls=FixedBaselineSettings,
                     section="algorithm.fixed_baseline")(fixed_baseline_advantages)
    yield
    dict.__delitem__(POLICY_LOSSES, "scaled_pg")
    dict.__delitem__(ADVANTAGE_ESTIMATORS, "fixed_baseline")


LP = jnp.log(jnp.asarray([[0.3, 0.5, 0.9, 0.4], [0.2, 0.7, 0.6, 0.5]], jnp.float32))
OLD = jnp.log(jnp.asarray([[0.3, 0.4, 0.8, 0.5], [0.25, 0.7, 0.5, 0.5]], jnp.float32))
LOSS_INPUTS = PolicyLossInputs(old_log_probs=OLD, log_probs=LP, advantages=jnp.asarray([1.0, -0.5], jnp.float32),
                               response_mask=RESPONSE_MASK)


def _loss_sum(recipe):
    return float(get_policy_loss_fn(recipe.policy_loss, recipe.extensions)(LOSS_INPUTS, recipe.loss)[0])


def test_new_policy_loss_reads_its_own_section_from_yaml(loss_and_estimator, tmp_path):
    path = _write(tmp_path, "algorithm:\n  recipe: grpo\nactor:\n  policy_loss: scaled_pg\n  scaled_pg:\n"
                            "    scale: 2.0\n")
    cfg = load_config(path)
    assert "actor.scaled_pg" in declared_sections() and "algorithm.fixed_baseline" in declared_sections()
    assert cfg.extensions == {"actor.scaled_pg": ScaledPGSettings(scale=2.0)}
    recipe = recipe_from_config(cfg)
    vanilla = float(compute_policy_loss(LOSS_INPUTS, recipe.loss)[0])
    assert vanilla != 0.0
    np.testing.assert_allclose(_loss_sum(recipe), 2.0 * vanilla, rtol=1e-6)  # the setting reaches the loss
    np.testing.assert_allclose(_loss_sum(recipe_from_config(load_config(path, ["actor.scaled_pg.scale=3"]))),
                               3.0 * vanilla, rtol=1e-6)
    # absent section: the class defaults (scale 1: the vanilla loss); the saved config reloads to an equal one
    default = recipe_from_config(from_dict({"algorithm": {"recipe": "grpo"}, "actor": {"policy_loss": "scaled_pg"}}))
    assert default.extensions == {}  # the loss gets ScaledPGSettings() through Registry.bound
    np.testing.assert_allclose(_loss_sum(default), vanilla, rtol=1e-6)
    assert load_config(cfg.save(tmp_path / "run")) == cfg
    with pytest.raises(TypeError, match="scale"):  # the bare entry needs its settings: never silently defaulted
        POLICY_LOSSES["scaled_pg"](LOSS_INPUTS, recipe.loss)
    # a built-in declares no settings: the registered function itself, called as before
    assert get_policy_loss_fn("vanilla", cfg.extensions) is compute_policy_loss


def test_new_advantage_estimator_reads_its_own_section_from_yaml(loss_and_estimator, tmp_path):
    path = _write(tmp_path, "algorithm:\n  recipe: grpo\n  adv_estimator: fixed_baseline\n  fixed_baseline:\n"
                            "    baseline: 0.25\n")
    cfg = load_config(path)
    assert cfg.extensions == {"algorithm.fixed_baseline": FixedBaselineSettings(baseline=0.25)}
    rewards, gid = jnp.asarray([1.0, 0.0, 1.0, 1.0], jnp.float32), jnp.asarray([0, 0, 1, 1], jnp.int32)

    def advantages(recipe):
        return np.asarray(recipe_advantages(recipe.advantage, rewards, gid, extensions=recipe.extensions,
                                            num_groups=2)).tolist()

    assert advantages(recipe_from_config(cfg)) == [0.75, -0.25, 0.75, 0.75]
    assert advantages(recipe_from_config(load_config(path, ["algorithm.fixed_baseline.baseline=1.0"]))) == [
        0.0, -1.0, 0.0, 0.0]
    default = recipe_from_config(from_dict({"algorithm": {"recipe": "grpo", "adv_estimator": "fixed_baseline"}}))
    assert default.extensions == {}  # the estimator gets FixedBaselineSettings() through Registry.bound
    assert advantages(default) == [1.0, 0.0, 1.0, 1.0]
    assert load_config(cfg.save(tmp_path / "run")) == cfg


def test_new_loss_and_estimator_section_errors_name_the_key(loss_and_estimator):
    base = {"algorithm": {"recipe": "grpo"}}
    with pytest.raises(ConfigError, match=r"actor.scaled_pg.scale=0.0 must be > 0"):
        from_dict({**base, "actor": {"policy_loss": "scaled_pg", "scaled_pg": {"scale": 0}}})
    with pytest.raises(ConfigError, match=r"actor.scaled_pg.scale: expected float, got str"):
        from_dict({**base, "actor": {"scaled_pg": {"scale": "big"}}})
    with pytest.raises(ConfigError, match=r"algorithm.fixed_baseline.baseline=1.5 must be in \[0, 1\]"):
        from_dict({"algorithm": {"recipe": "grpo", "adv_estimator": "fixed_baseline",
                                 "fixed_baseline": {"baseline": 1.5}}})
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm.fixed_baseline.basline'; did you mean "
                                          r"'algorithm.fixed_baseline.baseline'"):
        from_dict({"algorithm": {"recipe": "grpo", "fixed_baseline": {"basline": 0.5}}})
    with pytest.raises(TypeError, match=r"policy loss 'scaled_pg' takes ScaledPGSettings settings, got "
                                        r"FixedBaselineSettings"):
        get_policy_loss_fn("scaled_pg", {"actor.scaled_pg": FixedBaselineSettings()})
    with pytest.raises(ValueError, match=r"settings_cls and section go together"):
        register_policy_loss("no_section", settings_cls=ScaledPGSettings)


@pytest.mark.parametrize("register, section, message", [
    # a schema section with another class: the schema's class was built and the extension's silently ignored
    ("mask", "cov", r"token mask 'own_settings' declares settings section 'cov' with EntropyCapSettings, but the run "
                    r"config's cov section is CovConfig"),
    ("mask", "sampling", r"token mask 'own_settings' declares settings section 'sampling' with EntropyCapSettings, "
                         r"but the run config's sampling section is SamplingConfig"),
    # a schema key that is not a section: split_sections popped it from the YAML (reward.kind vanished)
    ("reward", "reward.kind", r"reward kind 'own_settings' declares settings section 'reward.kind', but reward.kind "
                              r"is a key of the run config, not a section"),
    ("loss", "actor.policy_loss", r"policy loss 'own_settings' declares settings section 'actor.policy_loss', but "
                                  r"actor.policy_loss is a key of the run config"),
    ("mask", "data.gym.config.x", r"token mask 'own_settings' declares settings section 'data.gym.config.x', but "
                                  r"data.gym.config is a key of the run config"),
])
def test_an_extension_section_colliding_with_the_schema_is_refused(register, section, message):
    registry, reg = {"mask": (TOKEN_MASKS, lambda **kw: register_token_mask(
        "own_settings", needs=("entropy",), settings=(), population="valid tokens", **kw)),
        "reward": (REWARD_KINDS, lambda **kw: register_reward("own_settings", **kw)),
        "loss": (POLICY_LOSSES, lambda **kw: register_policy_loss("own_settings", **kw))}[register]
    reg(settings_cls=EntropyCapSettings, section=section)(entropy_cap_mask)
    try:
        with pytest.raises(ConfigError, match=message):
            from_dict({"reward": {"kind": "math_verify_01"}, "cov": {"kl_cov_ratio": 0.5}})
        with pytest.raises(ConfigError, match=message):
            declared_sections(Config)
        if section != "cov":  # (cov is also clip_cov's: two classes for one section, refused with or without)
            assert declared_sections()[section] is EntropyCapSettings  # without a schema: not checked
    finally:
        dict.__delitem__(registry, "own_settings")
    cfg = from_dict({"reward": {"kind": "math_verify_01"}, "cov": {"kl_cov_ratio": 0.5}})
    assert cfg.reward.kind == "math_verify_01" and cfg.cov.kl_cov_ratio == 0.5 and cfg.extensions == {}


def test_an_extension_may_declare_the_schema_section_of_its_own_class():
    """``clip_cov`` / ``kl_cov`` declare ``cov`` with ``CovConfig`` (the schema's): built by the schema."""
    sections = declared_sections(Config)
    assert sections["cov"] is CovConfig and sections["s2t"] is S2TConfig and sections["top_entropy"] is TopEntropyConfig
    assert from_dict({"cov": {"kl_cov_ratio": 0.5}}).cov == CovConfig(kl_cov_ratio=0.5)


def test_unregistered_sections_are_unknown_keys_again():
    """After the fixtures' clean-up the sections are no longer read (a removed entry's declaration is ignored)."""
    assert "actor.scaled_pg" not in declared_sections() and "entropy_cap" not in declared_sections()
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.scaled_pg"):
        from_dict({"actor": {"scaled_pg": {"scale": 2.0}}})
