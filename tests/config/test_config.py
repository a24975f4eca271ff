"""Config schema: YAML + dotted overrides, unknown/mistyped keys, cross-field checks, recipe defaults,
save/reload round trip, and base.yaml documenting every key with the schema default."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml

from stapo_jax.config.schema import JUSTRL_PROMPT_SUFFIX, Config, load_config, parse_override
from stapo_jax.core.errors import ConfigError
from stapo_jax.core.settings import dataclass_keys
from stapo_jax.algo.loss_settings import PolicyLossConfig
from stapo_jax.algo.mask_settings import S2TConfig
from stapo_jax.algo.recipe_settings import AdvantageConfig, OverlongConfig, SamplingConfig

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_spec_values():
    cfg = load_config(None)
    # stapo_spec §3-§4, §10 and conventions.md §1.3 / §4.
    assert cfg.algorithm.recipe == "stapo" and cfg.s2t.enabled
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert cfg.actor.loss_agg_mode == "token-mean"
    assert (cfg.actor.kl_loss_coef, cfg.actor.entropy_coeff, cfg.actor.use_kl_loss) == (0.0, 0.0, False)
    assert (cfg.s2t.tau_p, cfg.s2t.entropy_quantile) == (0.002, 0.8)
    assert (cfg.s2t.quantile_scope, cfg.s2t.quantile_tokens, cfg.s2t.quantile_method, cfg.s2t.stats_policy) == (
        "minibatch", "valid", "linear", "current")
    assert cfg.s2t.renormalize is True
    assert (cfg.algorithm.std_ddof, cfg.algorithm.adv_eps) == (1, 1e-6)
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens) == (8, 1.0, 1.0,
                                                                                                      15360)
    assert (cfg.trainer.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs) == (256, 64, 1)
    assert (cfg.actor.optim.lr, cfg.actor.optim.warmup_steps) == (1e-6, 10)
    assert cfg.reward.kind == "boxed_exact_pm1" and cfg.reward.overlong_buffer_len == 0
    assert cfg.sampling.dynamic is False and cfg.data.drop_truncated is False
    assert cfg.top_entropy.ratio == 0.2 and cfg.top_entropy.scope == "minibatch"
    assert cfg.eval.max_new_tokens == 31744 and cfg.eval.grader == "math_verify"
    assert cfg.data.prompt_suffix == JUSTRL_PROMPT_SUFFIX
    assert cfg.data.prompt_suffix.endswith("put your final answer within \\boxed{}.")
    assert cfg.trainer.total_steps is None


def test_yaml_then_overrides_take_precedence(tmp_path):
    p = _write(tmp_path, "actor:\n  clip_ratio_high: 0.3\n  optim:\n    lr: 2.0e-6\nrollout:\n  n: 4\n")
    cfg = load_config(p, ["actor.clip_ratio_high=0.25", "actor.optim.betas=[0.9, 0.95]", "rollout.top_k=20",
                          "data.gym.config.min_terms=2", "trainer.run_dir=runs/x", "actor.clip_ratio_c=null"])
    assert cfg.actor.clip_ratio_high == 0.25  # override beats the file
    assert cfg.actor.optim.lr == 2e-6 and cfg.rollout.n == 4  # file beats the default
    assert cfg.actor.optim.betas == (0.9, 0.95) and isinstance(cfg.actor.optim.betas, tuple)
    assert cfg.rollout.top_k == 20 and cfg.actor.clip_ratio_c is None
    assert cfg.data.gym.config == {"min_terms": 2}
    assert cfg.trainer.run_dir == "runs/x"


def test_yaml11_exponent_strings_become_floats(tmp_path):
    # PyYAML reads "1e-6" (no dot) as a string; float fields accept numeric strings.
    p = _write(tmp_path, "actor:\n  optim:\n    lr: 1e-6\n")
    assert load_config(p, ["actor.optim.eps=1e-7"]).actor.optim.lr == 1e-6
    assert load_config(p, ["actor.optim.eps=1e-7"]).actor.optim.eps == 1e-7


@pytest.mark.parametrize("override,named,suggested", [
    ("actor.clip_ratio_hi=0.3", "actor.clip_ratio_hi", "actor.clip_ratio_high"),
    ("actor.tau_p=0.1", "actor.tau_p", "s2t.tau_p"),  # right key, wrong section
    ("rolout.n=4", "rolout", "rollout"),
    ("actor.optim.learning_rate=1e-5", "actor.optim.learning_rate", None),
])
def test_unknown_key_names_it_and_suggests(override, named, suggested):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert repr(named) in msg or named in msg
    if suggested:
        assert f"did you mean {suggested!r}" in msg


def test_unknown_key_in_yaml_file(tmp_path):
    p = _write(tmp_path, "s2t:\n  tau_h: 0.5\n")
    with pytest.raises(ConfigError, match=r"'s2t.tau_h'.*did you mean 's2t.tau_p'"):
        load_config(p)


@pytest.mark.parametrize("override,match", [
    ("actor.optim.lr=abc", r"actor\.optim\.lr: expected float, got str"),
    ("rollout.n=2.5", r"rollout\.n: expected int"),
    ("rollout.n=true", r"rollout\.n: expected int, got bool"),
    ("s2t.enabled=1", r"s2t\.enabled: expected bool, got int"),
    ("algorithm.recipe=stpo", r"algorithm\.recipe: 'stpo' is not one of .*did you mean 'stapo'"),
    ("actor.loss_agg_mode=token_mean", r"actor\.loss_agg_mode: 'token_mean' is not one of"),
    ("trainer.total_steps=ten", r"trainer\.total_steps: expected int or null"),
    ("rollout.n=null", r"rollout\.n: expected int, got NoneType"),
    ("actor.optim.betas=[0.9]", r"actor\.optim\.betas: expected a list of 2 values"),
    ("data.train_files=a.jsonl", r"data\.train_files: expected a list of str"),
    ("eval.n_samples={aime24: x}", r"eval\.n_samples: expected int or a mapping of str to int"),
    ("actor=3", r"actor: expected a mapping"),
    ("s2t.quantile_scope=rollout_batch", r"s2t\.quantile_scope: 'rollout_batch' is not one of"),
    ("actor.kl_loss_type=k4", r"actor\.kl_loss_type: 'k4' is not one of"),
])
def test_wrong_types_are_named(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("overrides,match", [
    (["trainer.train_batch_size=100"], r"trainer\.train_batch_size=100 is not divisible by actor\.ppo_mini_batch_size=64"),
    (["actor.ppo_micro_batch_size=0"], r"actor\.ppo_micro_batch_size=0 must be >= 1"),
    (["actor.ppo_mini_batch_size=2", "trainer.train_batch_size=4", "rollout.n=2", "actor.ppo_micro_batch_size=5"],
     r"actor\.ppo_micro_batch_size=5 exceeds"),
    (["actor.clip_ratio_c=1.0"], r"actor\.clip_ratio_c=1\.0 must be > 1"),
    (["actor.entropy_coeff=0.01"], r"algorithm\.recipe=stapo has no entropy bonus: actor\.entropy_coeff"),
    (["actor.use_kl_loss=true", "actor.kl_loss_coef=0.001"], r"algorithm\.recipe=stapo has no KL term"),
    (["algorithm.recipe=justrl", "actor.entropy_coeff=0.001"], r"algorithm\.recipe=justrl has no entropy bonus"),
    (["actor.token_mask=none"], r"algorithm\.recipe=stapo needs actor\.token_mask=s2t \(got none\)"),
    (["algorithm.recipe=justrl", "actor.token_mask=s2t"], r"actor\.token_mask=s2t belongs to algorithm\.recipe=stapo"),
    (["model.preset=null"], r"model\.hidden_size.*model\.num_attention_heads"),
    (["model.path=/x"], r"model\.path and model\.preset are both set"),
    (["reward.kind=gym"], r"reward\.kind=gym needs data\.source=gym"),
    (["data.source=gym"], r"data\.source=gym needs data\.gym\.task"),
    (["rollout.top_p=0"], r"rollout\.top_p=0\.0 must be in \(0, 1\]"),
    (["model.max_position_embeddings=1000"], r"data\.max_prompt_length \+ rollout\.max_new_tokens"),
    (["actor.token_mask=top_entropy"], r"algorithm\.recipe=stapo needs actor\.token_mask=s2t \(got top_entropy\)"),
])
def test_cross_field_errors_name_the_keys(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize("kl_type", ["kl+", "abs+", "mse+", "k3+"])
def test_every_objective_kl_type_is_a_valid_config_value(kl_type):
    import typing

    from stapo_jax.config.schema import ActorConfig
    from stapo_jax.algo.objectives import KL_TYPES, LOSS_AGG_MODES

    assert load_config(None, [f"actor.kl_loss_type={kl_type}"]).actor.kl_loss_type == kl_type
    hints = typing.get_type_hints(ActorConfig)
    assert set(typing.get_args(hints["kl_loss_type"])) == set(KL_TYPES)
    assert set(typing.get_args(hints["loss_agg_mode"])) == set(LOSS_AGG_MODES)


def test_strict_recipe_can_be_lifted_explicitly():
    cfg = load_config(None, ["actor.entropy_coeff=0.01", "algorithm.strict_recipe=false"])
    assert cfg.actor.entropy_coeff == 0.01


def test_recipe_defaults_fill_only_unset_keys():
    grpo = load_config(None, ["algorithm.recipe=grpo"])
    assert grpo.actor.clip_ratio_high == 0.2 and not grpo.s2t.enabled  # stapo_spec §5: GRPO 0.2/0.2
    assert load_config(None, ["algorithm.recipe=grpo", "actor.clip_ratio_high=0.3"]).actor.clip_ratio_high == 0.3
    dapo = load_config(None, ["algorithm.recipe=dapo"])
    assert dapo.sampling.dynamic and dapo.reward.overlong_buffer_len == 4096 and dapo.actor.clip_ratio_high == 0.28
    e20 = load_config(None, ["algorithm.recipe=entropy20"])
    assert e20.top_entropy.enabled and not e20.s2t.enabled


def test_grad_accum_steps():
    cfg = load_config(None, ["actor.ppo_mini_batch_size=4", "trainer.train_batch_size=8", "rollout.n=4",
                             "actor.ppo_micro_batch_size=2"])
    assert cfg.grad_accum_steps(1) == 8 and cfg.grad_accum_steps(4) == 2 and cfg.grad_accum_steps(8) == 1
    # the trainer's rule (one rule, config.schema.micro_batch_count): a micro-batch above a shard's rows is K = 1
    assert cfg.grad_accum_steps(16) == 1
    with pytest.raises(ConfigError, match="do not split into 3 data-parallel shards"):
        cfg.grad_accum_steps(3)
    with pytest.raises(ConfigError, match="ppo_micro_batch_size=3"):
        load_config(None, ["actor.ppo_mini_batch_size=4", "trainer.train_batch_size=8", "rollout.n=4",
                           "actor.ppo_micro_batch_size=3"]).grad_accum_steps(2)  # 8 rows per shard, micro 3


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("config", ["configs/tiny_cpu.yaml", "configs/compare/tiny_stapo.yaml",
                                    "configs/paper/qwen3-1.7b-base-stapo.yaml"])
def test_one_micro_batch_rule_for_trainer_planner_and_config(config, devices):
    """K is one rule: the trainer's ``batch_shapes.check_batch_shapes``, ``Config.grad_accum_steps`` and ``stapo-jax
    plan``'s spec agree on the same config and data-parallel size (the plan once refused the main job's own
    config on 4 devices that the trainer ran)."""
    from types import SimpleNamespace

    from stapo_jax.tools.plan import make_spec
    from stapo_jax.train.batch_shapes import check_batch_shapes

    cfg = load_config(config)
    mesh = SimpleNamespace(shape={"data": 1, "fsdp": devices, "tensor": 1}, axis_names=("data", "fsdp", "tensor"))
    k = check_batch_shapes(cfg, mesh, sft=False)
    assert k >= 1 and cfg.grad_accum_steps(devices) == k
    # the builtin tokenizer's vocabulary is set by the run; the plan needs a number
    sized = cfg if cfg.model.preset or cfg.model.path else load_config(config, ["model.vocab_size=512"])
    assert make_spec(sized, mesh=f"data=1,fsdp={devices},tensor=1", decode=False)["num_micro_batches"] == k


def test_check_rl_ready_requires_total_steps():
    cfg = load_config(None, ["data.train_files=[a.jsonl]"])
    with pytest.raises(ConfigError, match="trainer.total_steps is required"):
        cfg.check_rl_ready()
    load_config(None, ["data.train_files=[a.jsonl]", "trainer.total_steps=3"]).check_rl_ready()


def test_save_reload_round_trip(tmp_path):
    cfg = load_config(None, ["algorithm.recipe=dapo", "actor.optim.betas=[0.9, 0.95]", "rollout.top_k=5",
                             "data.gym.config={min_terms: 2}", "eval.n_samples=3", "trainer.total_steps=7"])
    path = cfg.save(tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    again = load_config(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text()) == cfg.to_dict()
    # the saved file holds every key, resolved (recipe defaults included)
    assert yaml.safe_load(path.read_text())["reward"]["overlong_buffer_len"] == 4096


@pytest.mark.parametrize("recipe, s2t_on, top_entropy_on, mask", [
    ("grpo", False, True, "top_entropy"),  # the flag chooses a mask the recipe does not (reload gave "none")
    ("stapo", False, False, "none"),  # no flag on: no mask (reload gave the recipe's "s2t")
    ("stapo", True, False, "s2t"),
])
def test_to_dict_of_a_config_built_in_python_keeps_the_flags_mask(tmp_path, recipe, s2t_on, top_entropy_on, mask):
    """``Config`` built in Python with ``actor.token_mask=None`` (the mask chosen by the ``<mask>.enabled`` flags):
    ``to_dict`` wrote ``token_mask: null`` and dropped the flags, so a reload took the recipe's mask instead."""
    from stapo_jax.config.recipes import recipe_from_config
    from stapo_jax.config.schema import from_dict

    base = from_dict({"algorithm": {"recipe": recipe, "strict_recipe": False}})
    cfg = dataclasses.replace(base, actor=dataclasses.replace(base.actor, token_mask=None),
                              s2t=dataclasses.replace(base.s2t, enabled=s2t_on),
                              top_entropy=dataclasses.replace(base.top_entropy, enabled=top_entropy_on))
    out = cfg.to_dict()
    assert out["actor"]["token_mask"] == mask and "enabled" not in out["s2t"] and "enabled" not in out["top_entropy"]
    again = load_config(cfg.save(tmp_path / "run"))
    assert again.actor.token_mask == mask and recipe_from_config(again).token_mask == mask
    assert (again.s2t.enabled, again.top_entropy.enabled) == (s2t_on, top_entropy_on)
    assert again == dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, token_mask=mask))


def test_override_parsing():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a.b=null") == ("a.b", None)
    assert parse_override("a.b=x=y") == ("a.b", "x=y")
    for bad in ("a.b", "=3", "a..b=1"):
        with pytest.raises(ConfigError):
            parse_override(bad)
    with pytest.raises(ConfigError, match="trainer.seed is a value, not a section"):
        load_config(None, ["trainer.seed=1", "trainer.seed.x=2"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in ("data.gym.config", "eval.n_samples"):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_base_yaml_documents_every_key_with_its_default():
    base = REPO / "configs" / "base.yaml"
    raw = yaml.safe_load(base.read_text())
    # extensions: in their own sections; the <mask>.enabled flags: derived from actor.token_mask (not written)
    keys = [k for k in dataclass_keys(Config) if k not in ("extensions", "s2t.enabled", "top_entropy.enabled")]
    assert set(_leaves(raw)) == set(keys)
    assert load_config(base) == Config()
    text = base.read_text()
    for key in keys:  # every key carries a comment
        leaf = key.rsplit(".", 1)[-1]
        lines = [ln for ln in text.splitlines() if ln.startswith(" ") and ln.strip().startswith(f"{leaf}:")]
        assert lines and all("#" in ln for ln in lines), key


def test_config_is_plain_dataclasses():
    cfg = load_config(None)
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg.to_dict()["actor"]["optim"]["betas"], list)


def test_the_actor_section_is_the_recipes_loss():
    """The actor section is a PolicyLossConfig (one dataclass: its keys, validation and meaning), used by the
    recipe as its loss as it is (no copy); every loss field is set by its own key."""
    from stapo_jax.algo.objectives import PolicyLossConfig
    from stapo_jax.config.recipes import recipe_from_config

    values = {"clip_ratio_low": 0.11, "clip_ratio_high": 0.33, "clip_ratio_c": 4.5, "loss_agg_mode": "token-sum",
              "loss_scale_factor": 7.0, "log_ratio_clamp": 9.0, "entropy_coeff": 0.01, "use_kl_loss": True,
              "kl_loss_coef": 0.02, "kl_loss_type": "k2", "ppo_kl_coef": 0.7, "sampler_is": "truncate",
              "sampler_is_cap": 3.5}
    assert set(values) == {f.name for f in dataclasses.fields(PolicyLossConfig)}
    cfg = load_config(None, [f"actor.{k}={v}" for k, v in values.items()] + ["algorithm.strict_recipe=false"])
    loss = recipe_from_config(cfg).loss
    assert isinstance(cfg.actor, PolicyLossConfig) and loss is cfg.actor
    assert {k: getattr(loss, k) for k in values} == values and loss.rollout_is_threshold == 3.5
    assert recipe_from_config(load_config(None)).loss.rollout_is_threshold is None


def test_the_recipe_uses_the_config_sections_themselves():
    """algorithm / sampling / reward are the recipe's advantage / sampling / overlong settings (no copies), so a
    key such as algorithm.norm_adv_by_std_in_grpo cannot be dropped on the way: false gives Dr.GRPO's R - mean."""
    import jax.numpy as jnp

    from stapo_jax.algo.advantages import dr_grpo_advantages, grpo_advantages, recipe_advantages
    from stapo_jax.config.recipes import recipe_from_config

    cfg = load_config(None, ["algorithm.recipe=dapo", "algorithm.norm_adv_by_std_in_grpo=false",
                             "sampling.max_gen_batches=3", "reward.overlong_buffer_len=7"])
    recipe = recipe_from_config(cfg)
    assert recipe.advantage is cfg.algorithm and recipe.sampling is cfg.sampling and recipe.overlong is cfg.reward
    assert (recipe.sampling.dynamic, recipe.sampling.max_gen_batches, recipe.overlong.overlong_buffer_len) == (
        True, 3, 7)
    r, g = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), jnp.array([5, 5, 5, 9, 9, 2])
    got = np.asarray(recipe_advantages(recipe.advantage, r, g))
    np.testing.assert_allclose(got, [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(got, np.asarray(dr_grpo_advantages(r, g)), rtol=1e-6)
    default = recipe_from_config(load_config(None))
    np.testing.assert_allclose(np.asarray(recipe_advantages(default.advantage, r, g)),
                               np.asarray(grpo_advantages(r, g)), rtol=1e-6)


@pytest.mark.parametrize("override,match", [
    ("actor.sampler_is_cap=0.5", r"^actor\.sampler_is_cap=0\.5 must be >= 1$"),
    ("actor.clip_ratio_low=1.5", r"^actor\.clip_ratio_low=1\.5 must be in \[0, 1\)$"),
    ("actor.kl_loss_coef=-1", r"^actor\.kl_loss_coef=-1\.0 must be >= 0$"),
    ("actor.log_ratio_clamp=0", r"^actor\.log_ratio_clamp=0\.0 must be > 0$"),
    ("actor.sampler_is=clip", r"^actor\.sampler_is: 'clip' is not one of"),
    ("actor.sampler_is=on", r"^actor\.sampler_is: True is not one of \['off', 'truncate'\]; YAML reads a bare on/off"),
    ("actor.ppo_epochs=0", r"^actor\.ppo_epochs=0 must be >= 1$"),
    ("actor.logprob_seq_chunk=0", r"^actor\.logprob_seq_chunk=0 must be >= 1 or null"),
    ("actor.optim.lr=0", r"^actor\.optim\.lr=0\.0 must be > 0$"),
    ("actor.optim.betas=[0.9, 1.0]", r"^actor\.optim\.betas=\[0\.9, 1\.0\] must lie in \[0, 1\)$"),
    ("algorithm.std_ddof=2", r"^algorithm\.std_ddof=2 must be 0 or 1$"),
    ("algorithm.adv_eps=0", r"^algorithm\.adv_eps=0\.0 must be > 0$"),
    ("algorithm.adv_estimator=drgrpo", r"^overrides: algorithm\.adv_estimator: 'drgrpo' is not a registered advantage "
                                       r"estimator; did you mean 'dr_grpo'"),
    ("sampling.max_gen_batches=0", r"^sampling\.max_gen_batches=0 must be >= 1$"),
    ("reward.overlong_buffer_len=-1", r"^reward\.overlong_buffer_len=-1 must be >= 0$"),
    ("reward.timeout_s=0", r"^reward\.timeout_s=0\.0 must be > 0$"),
])
def test_a_sections_invalid_value_is_a_config_error_naming_its_key(override, match):
    """Validation sits next to the fields (the section's own __post_init__); the message names the dotted key."""
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("override,match", [
    ("algorithm.recipe=[stapo]", r"^algorithm\.recipe: \['stapo'\] is not one of"),  # was a TypeError (unhashable)
    ("s2t=[]", r"^s2t: expected a mapping of keys, got list"),  # was "override s2t.enabled: ..." (a recipe default)
    ("actor.clip_ratio_c=.inf", r"^actor\.clip_ratio_c: inf is not a finite number$"),  # an Optional's own reason
    ("sft.warmup_steps=-5", r"sft\.warmup_steps=-5 must be >= 0"),  # was accepted, then "optim.warmup_steps"
])
def test_hostile_values_are_config_errors_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_a_key_given_twice_in_the_yaml_file_is_named(tmp_path):
    """PyYAML keeps the last of two ``actor:`` sections silently; the loader names the key, its line and file."""
    path = tmp_path / "dup.yaml"
    path.write_text("trainer:\n  total_steps: 3\nactor:\n  clip_ratio_low: 0.1\nactor:\n  clip_ratio_low: 0.3\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml: config key 'actor' is given twice \(line 5\)"):
        load_config(path)
    path.write_text("actor:\n  clip_ratio_low: 0.1\n  clip_ratio_low: 0.3\n")
    with pytest.raises(ConfigError, match=r"config key 'clip_ratio_low' is given twice \(line 3\)"):
        load_config(path)


def test_a_directory_as_config_file_is_named(tmp_path):
    with pytest.raises(IsADirectoryError, match=r"is a directory"):
        load_config(tmp_path)


@pytest.mark.parametrize("make,match", [
    (lambda: PolicyLossConfig(clip_ratio_low="abc"), r"^actor\.clip_ratio_low: expected float, got str 'abc'$"),
    (lambda: PolicyLossConfig(clip_ratio_c=float("inf")), r"^actor\.clip_ratio_c: inf is not a finite number$"),
    (lambda: PolicyLossConfig(use_kl_loss="no"), r"^actor\.use_kl_loss: expected bool, got str 'no'$"),
    (lambda: S2TConfig(tau_p=None), r"^s2t\.tau_p: expected float, got NoneType None$"),
    (lambda: AdvantageConfig(std_ddof=True), r"^algorithm\.std_ddof: expected int, got bool True$"),
    (lambda: SamplingConfig(max_gen_batches=2.5), r"^sampling\.max_gen_batches: expected int, got float 2\.5$"),
    (lambda: OverlongConfig(overlong_buffer_len=4, overlong_penalty=float("nan")),
     r"^reward\.overlong_penalty: nan is not a finite number$"),
])
def test_settings_built_in_python_check_types_naming_the_key(make, match):
    """The frozen settings used directly by the library: a wrong type was a TypeError (``0 <= 'abc'``) or was
    accepted (``use_kl_loss='no'`` is truthy, ``std_ddof=True``, a NaN penalty); now the YAML path's ConfigError."""
    with pytest.raises(ConfigError, match=match):
        make()


def test_settings_accept_numpy_scalars_and_registered_names():
    from stapo_jax.config.recipes import get_recipe

    loss = PolicyLossConfig(clip_ratio_low=np.float32(0.25), clip_ratio_high=1)
    assert type(loss.clip_ratio_low) is float and loss.clip_ratio_low == pytest.approx(0.25)
    assert type(loss.clip_ratio_high) is float and loss.clip_ratio_high == 1.0
    assert SamplingConfig(max_gen_batches=np.int64(3)).max_gen_batches == 3
    # a name is checked against the live registry (config loading, Recipe), which names the key
    assert AdvantageConfig(adv_estimator="my_estimator").adv_estimator == "my_estimator"
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator: 'my_estimator' is not a registered advantage "
                                          r"estimator"):
        get_recipe("grpo", advantage={"adv_estimator": "my_estimator"})
