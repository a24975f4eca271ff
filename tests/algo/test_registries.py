"""Registries by name: filled where their entries are defined, complete whatever the caller imported, selected
from YAML (``actor.policy_loss``, ``actor.token_mask``, ``algorithm.adv_estimator``, ``reward.kind``) with a
did-you-mean error naming the key and the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stapo_jax.core.registry import Registry
from stapo_jax.config.schema import from_dict, load_config, token_mask_name
from stapo_jax.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_lookup_names_the_key_with_did_you_mean():
    reg = Registry("widget", "section.widget")
    reg.register("alpha")(len)
    assert reg.lookup("alpha") is len and reg.lookup("none", extra=("none",)) is None
    with pytest.raises(ConfigError, match=r"^section.widget: 'alpah' is not a registered widget; did you mean "
                                          r"'alpha'\? \(registered: \['alpha'\]\)$"):
        reg.lookup("alpah")
    with pytest.raises(ValueError, match="widget 'alpha' is already registered"):
        reg.register("alpha")(len)


def test_every_registry_is_complete_in_a_fresh_process():
    """Importing only the module that holds a registry is enough: no entry depends on an import elsewhere (the
    S2T strategy used to register itself when algo/s2t.py happened to be imported)."""
    code = ("from stapo_jax.algo.objectives import POLICY_LOSSES\n"
            "from stapo_jax.train.mask_strategy import MASK_STRATEGIES\n"
            "from stapo_jax.rewards.registry import REWARD_KINDS\n"
            "print(sorted(POLICY_LOSSES), sorted(MASK_STRATEGIES), sorted(REWARD_KINDS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("['gspo', 'vanilla'] ['s2t'] ['boxed_exact_01', 'boxed_exact_pm1', 'gym', "
                                  "'math_verify_01', 'math_verify_strict', 'think_format']")


@pytest.mark.parametrize("overrides,match", [
    (["actor.policy_loss=vanila"], r"actor.policy_loss: 'vanila' is not a registered policy loss; did you mean "
                                   r"'vanilla'\?"),
    (["algorithm.recipe=grpo", "actor.token_mask=klcov"], r"actor.token_mask: 'klcov' is not a registered token "
                                                           r"mask; did you mean 'kl_cov'\?"),
    (["algorithm.adv_estimator=dr-grpo"], r"algorithm.adv_estimator: 'dr-grpo' is not a registered advantage "
                                          r"estimator; did you mean 'dr_grpo'\?"),
    (["reward.kind=math_verify"], r"reward.kind: 'math_verify' is not a registered reward kind; did you mean "),
])
def test_yaml_names_are_checked_against_the_registries(overrides, match):
    path = REPO / "configs" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=rf"^{path} with overrides: {match}"):
        load_config(path, overrides)


def test_token_mask_key_and_the_older_flags():
    """actor.token_mask is the one key choosing the mask (unset: the recipe row's); the s2t.enabled /
    top_entropy.enabled flags are derived from it. The older spelling still loads, with one FutureWarning naming
    actor.token_mask; a flag that contradicts the key, or two flags on, is an error naming the keys."""
    from stapo_jax.config.recipes import RECIPES, recipe_from_config

    for name, mask in (("stapo", "s2t"), ("entropy20", "top_entropy"), ("grpo", "none")):  # the presets' rows
        cfg = from_dict({"algorithm": {"recipe": name}})
        assert cfg.actor.token_mask == token_mask_name(cfg) == RECIPES[name].token_mask == mask
        assert (cfg.s2t.enabled, cfg.top_entropy.enabled) == (mask == "s2t", mask == "top_entropy")
    cfg = from_dict({"algorithm": {"recipe": "grpo"}, "actor": {"token_mask": "clip_cov"}})
    assert (token_mask_name(cfg), cfg.s2t.enabled, cfg.top_entropy.enabled) == ("clip_cov", False, False)
    assert recipe_from_config(cfg).token_mask == "clip_cov" and not recipe_from_config(cfg).renormalize
    cfg = from_dict({"algorithm": {"recipe": "entropy20"}, "actor": {"token_mask": "top_entropy"}})
    assert cfg.top_entropy.enabled and not cfg.s2t.enabled
    assert recipe_from_config(cfg).replace(loss=RECIPES["entropy20"].loss) == RECIPES["entropy20"]
    assert "enabled" not in cfg.to_dict()["s2t"] and "enabled" not in cfg.to_dict()["top_entropy"]  # derived
    # the older spelling: accepted, with one deprecation note naming the replacement
    with pytest.warns(FutureWarning, match=r"^s2t.enabled, top_entropy.enabled is deprecated: the token mask is "
                                           r"chosen by actor.token_mask \(e.g. actor.token_mask: s2t\)$"):
        old = from_dict({"algorithm": {"recipe": "entropy20"}, "s2t": {"enabled": False},
                         "top_entropy": {"enabled": True}})
    assert old == cfg
    with pytest.warns(FutureWarning, match="s2t.enabled is deprecated"):
        assert from_dict({"s2t": {"enabled": False}, "algorithm": {"strict_recipe": False}}).actor.token_mask == "none"
    with pytest.warns(FutureWarning), pytest.raises(
            ConfigError, match=r"actor.token_mask=kl_cov contradicts top_entropy.enabled=true"):
        from_dict({"algorithm": {"recipe": "grpo"}, "actor": {"token_mask": "kl_cov"},
                   "top_entropy": {"enabled": True}})
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"s2t.enabled and top_entropy.enabled are all"):
        from_dict({"s2t": {"enabled": True}, "top_entropy": {"enabled": True}})


def test_a_loss_without_kl_cov_selection_is_rejected_with_the_kl_cov_mask_at_load():
    """gspo takes no KL-Cov selection: gspo + kl_cov fails when the config loads (naming both keys), not in the
    first update; vanilla + kl_cov and gspo + clip_cov load."""
    from stapo_jax.algo.recipes import Recipe
    from stapo_jax.config.recipes import RECIPES

    path = REPO / "configs" / "tiny_cpu.yaml"
    bad = ["algorithm.recipe=grpo", "actor.policy_loss=gspo", "actor.token_mask=kl_cov"]
    with pytest.raises(ConfigError, match=rf"^{path} with overrides: actor.policy_loss=gspo cannot be combined with "
                                          r"actor.token_mask=kl_cov: .* only the policy losses \['vanilla'\] take"):
        load_config(path, bad)
    with pytest.raises(ConfigError, match=r"^actor.policy_loss=gspo cannot be combined with actor.token_mask=kl_cov"):
        Recipe(name="x", loss=RECIPES["grpo"].loss, token_mask="kl_cov", policy_loss="gspo")
    assert token_mask_name(load_config(path, bad[:1] + ["actor.token_mask=kl_cov"])) == "kl_cov"
    assert load_config(path, bad[:2] + ["actor.token_mask=clip_cov"]).actor.policy_loss == "gspo"


def test_a_newly_registered_estimator_is_accepted_from_yaml():
    """algorithm.adv_estimator is a name checked against the live registry, not a fixed list."""
    from stapo_jax.algo.advantages import ADVANTAGE_ESTIMATORS, register_adv_est
    from stapo_jax.config.recipes import recipe_from_config

    with pytest.raises(ConfigError, match="'sign_of_reward' is not a registered advantage estimator"):
        from_dict({"algorithm": {"adv_estimator": "sign_of_reward"}})
    register_adv_est("sign_of_reward")(lambda rewards, group_ids, **kw: rewards)
    try:
        cfg = from_dict({"algorithm": {"adv_estimator": "sign_of_reward"}})
        assert recipe_from_config(cfg).advantage.adv_estimator == "sign_of_reward"
    finally:
        ADVANTAGE_ESTIMATORS.pop("sign_of_reward")
