"""Outcome-reward advantage estimators (one scalar reward per response) and DAPO's reward-side hooks.

Groups are the G responses sampled for one prompt, identified by an integer ``group_ids`` array (verl's
prompt ``uid``): any integers (negative, sparse, unsorted), rows in any order, jit-able as they are. Passing
``num_groups`` instead declares dense ids in ``[0, num_groups)`` (checked when concrete) and skips the
relabelling sort.

Conventions (conventions.md §1.3, verl ``compute_grpo_outcome_advantage`` / ``compute_rloo_outcome_advantage``):

* GRPO: ``A = (R - mean) / (std + epsilon)`` with ``std`` of ddof 1 (``torch.std``), ``epsilon = 1e-6``.
* A single-sample group has no baseline: by default its advantage is 0 (``single_sample="zero"``, the
  issue's rule; Tunix rejects G = 1). ``single_sample="verl"`` gives verl's mean 0 / std 1, i.e.
  ``A = R / (1 + epsilon)`` (GRPO) or ``A = R`` (Dr.GRPO, RLOO), for parity checks.
* A group whose rewards are all equal gets exactly 0 (never NaN, never a rounding residue).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stapo_jax.core.registry import Registry

__all__ = [
    "register_adv_est",
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "compute_advantages",
    "recipe_advantages",
    "nonzero_variance_groups",
    "overlong_reward_penalty",
    "ADVANTAGE_ESTIMATORS",
]


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", "algorithm.adv_estimator",
                                         homes=("stapo_jax.algo.advantages",))


def register_adv_est(name: str, *, settings_cls: type | None = None, section: str | None = None):
    """Decorator registering an outcome-advantage estimator ``fn(rewards [N], group_ids [N], **kw) -> [N]`` under
    ``name`` (the recipe's ``adv_estimator``); rewards float32, group_ids any integer dtype, the estimate float32.
    ``settings_cls`` / ``section``: settings of its own, a frozen dataclass (validating in ``__post_init__``) read
    from that dotted run-config section (``algorithm.<name>`` by convention; :mod:`stapo_jax.config.extensions`);
    the estimator then takes each field as a keyword (:func:`compute_advantages` / :func:`recipe_advantages` with
    ``extensions`` pass them; declare them keyword-only without defaults, so that a call without its settings
    fails loudly). Returns the decorator.
    Raises ValueError if the name is taken, or for ``settings_cls`` without ``section``.
    Source: verl ``core_algos.register_adv_est``; an extension reading its own keys: verl ``policy_loss.*``."""
    return ADVANTAGE_ESTIMATORS.register(name, settings_cls=settings_cls, section=section)


def _check(rewards: jax.Array, group_ids: jax.Array) -> None:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N] (one scalar per response), got shape {tuple(rewards.shape)}")
    if tuple(group_ids.shape) != tuple(rewards.shape):
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} must equal rewards shape {tuple(rewards.shape)}")
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be integer, got dtype {group_ids.dtype}")


def _dense_ids(group_ids, num_groups):
    """``(ids in [0, n_g), n_g)``: with ``num_groups`` the ids as given (range-checked when concrete); without it
    any integer ids relabelled by rank (``jnp.unique(..., size=N)``, jit-able; n_g = N, unused slots empty)."""
    if num_groups is not None:
        n_g = int(num_groups)
        _check_group_range(group_ids, n_g)
        return group_ids, n_g
    n = group_ids.shape[0]
    if n == 0:
        return group_ids.astype(jnp.int32), 0
    _, inverse = jnp.unique(group_ids, size=n, fill_value=jnp.max(group_ids), return_inverse=True)
    return inverse.reshape(-1).astype(jnp.int32), n


def _check_group_range(group_ids, n_g: int) -> None:
    """Concrete ``group_ids`` must lie in ``[0, n_g)``: ``segment_sum`` drops ids >= n_g and the gather back
    clamps them, so a bad id would silently merge rows into another group. Skipped for tracers (under jit the
    values are unknown; the caller guarantees the range there) and for arrays spread over several processes."""
    if isinstance(group_ids, jax.core.Tracer) or not group_ids.size or \
            (isinstance(group_ids, jax.Array) and not group_ids.is_fully_addressable):
        return
    ids = np.asarray(group_ids)
    bad = (ids < 0) | (ids >= n_g)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"group_ids[{i}] = {int(ids[i])} is outside [0, num_groups={n_g}) "
                         f"({int(bad.sum())} of {ids.size} ids out of range)")


def _group_stats(rewards, group_ids, num_groups, ddof):
    """Per-row (count, mean, std with ``ddof``, all-equal flag) of the row's group. rewards float [N]."""
    group_ids, n_g = _dense_ids(group_ids, num_groups)
    ones = jnp.ones_like(rewards)
    count = jax.ops.segment_sum(ones, group_ids, n_g)[group_ids]
    mean = (jax.ops.segment_sum(rewards, group_ids, n_g) / jnp.maximum(jax.ops.segment_sum(ones, group_ids, n_g), 1))[
        group_ids
    ]
    sq = jax.ops.segment_sum((rewards - mean) ** 2, group_ids, n_g)[group_ids]
    std = jnp.sqrt(sq / jnp.maximum(count - ddof, 1))
    gmax = jax.ops.segment_max(rewards, group_ids, n_g)[group_ids]
    gmin = jax.ops.segment_min(rewards, group_ids, n_g)[group_ids]
    return count, mean, std, gmax == gmin


def _float(rewards):
    """rewards in the dtype the statistics are computed in: at least float32 (a float16 or bfloat16 reward of a
    few hundred overflows or loses the variance when squared), float64 kept."""
    dt = jnp.promote_types(rewards.dtype, jnp.float32) if jnp.issubdtype(rewards.dtype, jnp.floating) else jnp.float32
    return rewards.astype(jax.dtypes.canonicalize_dtype(dt))  # float64 only where x64 is on


def _out_dtype(rewards):
    """The advantages' dtype: the rewards' float dtype (float32 for integer rewards)."""
    return jax.dtypes.canonicalize_dtype(rewards.dtype) if jnp.issubdtype(rewards.dtype, jnp.floating) else jnp.float32


@register_adv_est("grpo")
def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    num_groups: int | None = None,
    epsilon: float = 1e-6,
    ddof: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    single_sample: str = "zero",
) -> jax.Array:
    """GRPO group z-score advantage.

    Args:
      rewards: ``[N]`` float (int is cast to float32), one outcome reward per response.
      group_ids: ``[N]`` int, the prompt each response belongs to (any integers, like verl's ``uid``).
      num_groups: optional static group count declaring ids dense in ``[0, num_groups)`` (no relabelling).
      epsilon: added to the std (verl 1e-6; TRL uses 1e-4).
      ddof: delta degrees of freedom of the std (1 = unbiased, verl/TRL/Tunix; 0 = MaxText).
      norm_adv_by_std_in_grpo: False gives Dr.GRPO, ``R - mean`` (verl's switch of the same name).
      single_sample: ``"zero"`` (default) or ``"verl"``: the advantage of a group with one response.

    Returns:
      ``[N]`` advantages, float dtype of ``rewards`` (float32 for int rewards; the group statistics are computed
      in at least float32, so float16 / bfloat16 rewards neither overflow nor lose the variance). Single-sample
      groups: 0 (``"verl"``: ``R/(1+epsilon)`` or ``R``); all-equal groups: exactly 0.

    Raises:
      ValueError: if ``rewards`` is not 1-D, ``group_ids`` mismatches it or is not integer, ``epsilon`` < 0 or
        NaN, or, with ``num_groups``, concrete (not traced) ``group_ids`` outside ``[0, num_groups)`` (names the
        first bad index; under jit the range is the caller's to guarantee).

    Source: Shao et al. 2402.03300 eq. (GRPO outcome supervision); verl ``compute_grpo_outcome_advantage``.
    """
    _check(rewards, group_ids)
    _check_single_sample(single_sample)
    if isinstance(epsilon, (int, float)) and not epsilon >= 0.0:  # a negative one can cancel the std: +-inf
        raise ValueError(f"grpo_advantages: epsilon must be >= 0, got {epsilon}")
    r = _float(rewards)
    count, mean, std, constant = _group_stats(r, group_ids, num_groups, ddof)
    single = count <= 1
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    centred = r - mean
    adv = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    return _zero_groups(adv, constant, single, single_sample).astype(_out_dtype(rewards))


def _check_single_sample(single_sample: str) -> None:
    if single_sample not in ("zero", "verl"):
        raise ValueError(f"single_sample must be 'zero' or 'verl', got {single_sample!r}")


def _zero_groups(adv, constant, single, single_sample):
    zero = (constant & ~single) | (single if single_sample == "zero" else False)
    return jnp.where(zero, jnp.zeros_like(adv), adv)


@register_adv_est("dr_grpo")
def dr_grpo_advantages(rewards, group_ids, *, num_groups=None, single_sample="zero", **_unused) -> jax.Array:
    """Dr.GRPO advantage ``R - mean_group(R)`` (no std normalisation).

    Shapes, dtypes, errors and single-sample/constant-group rules as :func:`grpo_advantages`.
    Source: Liu et al. 2503.20783; verl ``norm_adv_by_std_in_grpo=False``.
    """
    return grpo_advantages(rewards, group_ids, num_groups=num_groups, norm_adv_by_std_in_grpo=False,
                           single_sample=single_sample)


@register_adv_est("rloo")
def rloo_advantages(rewards, group_ids, *, num_groups=None, single_sample="zero", **_unused) -> jax.Array:
    """RLOO leave-one-out advantage ``R_i - mean_{j != i} R_j = G/(G-1) * (R_i - mean)``.

    Args/returns as :func:`grpo_advantages`: ``rewards`` ``[N]`` float, ``group_ids`` ``[N]`` int (any values);
    returns ``[N]`` in the rewards' float dtype (float32 for int rewards; statistics in at least float32). A
    single-sample group: 0 (``"verl"``: keeps ``R``); all-equal: 0.
    Raises: ValueError on shape mismatch or an unknown ``single_sample``.
    Source: Ahmadian et al. 2402.14740; verl ``compute_rloo_outcome_advantage``.
    """
    _check(rewards, group_ids)
    _check_single_sample(single_sample)
    r = _float(rewards)
    count, mean, _, constant = _group_stats(r, group_ids, num_groups, 0)
    single = count <= 1
    adv = jnp.where(single, r, (r - mean) * count / jnp.maximum(count - 1, 1))
    return _zero_groups(adv, constant, single, single_sample).astype(_out_dtype(rewards))


def compute_advantages(name: str, rewards, group_ids, *, extensions=None, **kwargs) -> jax.Array:
    """Dispatch by estimator name (``grpo``, ``dr_grpo``, ``rloo``, any registered later); kwargs go to the
    estimator, and so do the fields of the settings it declares (``register_adv_est(..., settings_cls=,
    section=)``): ``extensions[section]`` (``Recipe.extensions``, ``{dotted section: settings instance}``), else
    its ``settings_cls()`` defaults. A built-in (no settings) is called exactly as before.

    Args: ``rewards`` ``[N]`` float, ``group_ids`` ``[N]`` int. Returns ``[N]`` float advantages (as the estimator).
    Source: verl ``core_algos.get_adv_estimator_fn`` (estimators registered by name).

    Raises:
      ValueError: unknown ``name`` (a ConfigError naming ``algorithm.adv_estimator``, with did-you-mean).
      TypeError: settings in ``extensions`` of the wrong class.
    """
    return ADVANTAGE_ESTIMATORS.bound(name, extensions)(rewards, group_ids, **kwargs)


def recipe_advantages(settings, rewards, group_ids, *, extensions=None, **kwargs) -> jax.Array:
    """The advantages a recipe's :class:`~stapo_jax.algo.recipe_settings.AdvantageConfig` (the run config's
    ``algorithm`` section) describes: its ``adv_estimator`` via :func:`compute_advantages`, with ``grpo`` given
    ``epsilon=adv_eps``, ``ddof=std_ddof`` and ``norm_adv_by_std_in_grpo``; ``extensions`` (``Recipe.extensions``)
    holds the settings of an estimator that declares its own; kwargs (e.g. ``num_groups``, ``single_sample``) go
    to the estimator.

    Args: ``rewards`` ``[N]`` float, ``group_ids`` ``[N]`` int (any integers). Returns ``[N]`` float advantages.
    Raises: ValueError as :func:`compute_advantages` and the estimator (shapes, an unknown name); TypeError for
      settings of the wrong class.
    Source: verl ``compute_advantage`` (``algorithm.adv_estimator``, ``algorithm.norm_adv_by_std_in_grpo``).
    """
    if settings.adv_estimator == "grpo":
        kwargs = dict(epsilon=settings.adv_eps, ddof=settings.std_ddof,
                      norm_adv_by_std_in_grpo=settings.norm_adv_by_std_in_grpo, **kwargs)
    return compute_advantages(settings.adv_estimator, rewards, group_ids, extensions=extensions, **kwargs)


def nonzero_variance_groups(rewards: jax.Array, group_ids: jax.Array, *, num_groups: int | None = None) -> jax.Array:
    """DAPO dynamic-sampling filter: True for rows whose group's rewards are not all equal.

    Args: ``rewards`` ``[N]`` float, ``group_ids`` ``[N]`` int. Returns ``[N]`` bool.
    Raises: ValueError as :func:`grpo_advantages` (shapes, dtype, concrete ``group_ids`` out of range).
    Source: Yu et al. 2503.14476 §3.2 (dynamic sampling); stapo_spec.md §5.
    """
    _check(rewards, group_ids)
    count, _, _, constant = _group_stats(_float(rewards), group_ids, num_groups, 0)
    return ~constant


def overlong_reward_penalty(
    response_lengths: jax.Array, *, max_response_length: int, overlong_buffer_len: int, penalty_factor: float = 1.0
) -> jax.Array:
    """DAPO overlong reward shaping ``min(0, -kappa * (|y| - (L_max - L_cache)) / L_cache)``, added to rewards.

    Args:
      response_lengths: ``[N]`` int, response length in tokens (EOS included).
      max_response_length: ``L_max``; overlong_buffer_len: ``L_cache`` (0 disables: returns zeros);
      penalty_factor: ``kappa``.

    Returns: ``[N]`` float32 penalties (<= 0).
    Raises: ValueError if ``overlong_buffer_len`` < 0 or > ``max_response_length``.
    Source: Yu et al. 2503.14476 eq. (13); verl DAPO reward manager; stapo_spec.md §5.
    """
    if overlong_buffer_len < 0 or overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in [0, max_response_length={max_response_length}], got {overlong_buffer_len}"
        )
    lengths = jnp.asarray(response_lengths, jnp.float32)
    if overlong_buffer_len == 0:
        return jnp.zeros_like(lengths)
    expected = max_response_length - overlong_buffer_len
    return jnp.minimum(0.0, -penalty_factor * (lengths - expected) / overlong_buffer_len)
