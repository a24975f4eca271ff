"""The package's public surface: the algorithm re-exported at the top, loaded lazily."""
import subprocess
import sys

import pytest

import stapo_jax
from stapo_jax.algo import masks, objectives


def test_top_level_reexports_are_the_algo_functions():
    from stapo_jax import compute_policy_loss, s2t_mask

    assert s2t_mask is masks.s2t_mask
    assert compute_policy_loss is objectives.compute_policy_loss
    assert "grpo_advantages" in dir(stapo_jax)


def test_unknown_top_level_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_function"):
        stapo_jax.no_such_function  # noqa: B018


def test_importing_the_dump_tool_does_not_import_jax():
    code = "import sys, stapo_jax, stapo_jax.tools.dump; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
