"""Test-wide setup: 8 simulated CPU devices (set before jax is imported), offline HF, derandomized hypothesis.

Every test process sees 8 host devices, so mesh tests run in-process; single-device code still runs on
device 0. Shared fixtures live in tests/fixtures_*.py modules and are imported where needed. The files with the
longest runs (``SLOW_FIRST``) are collected first, so that ``make test``'s two pytest-xdist workers (``-n 2 --dist
loadfile``: a file's tests, and its module-scoped runs, stay on one worker) start them at once and end together.
"""
import os

from xla_env import with_test_flags  # noqa: E402  (tests/ is on sys.path)

# 8 simulated devices and the fast-compile flags (tests/xla_env.py), added to any XLA_FLAGS the user set
os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""), 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# runs' persistent compilation cache (trainer.compilation_cache_dir: auto reads this) in a temporary folder shared
# by the session's processes, never in the user's home
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="stapo_jax_test_jax_cache_")

# property tests draw the same examples every run (CI must not depend on luck or on a local example database)
from hypothesis import settings  # noqa: E402

settings.register_profile("stapo_jax", derandomize=True, database=None, deadline=None)
settings.load_profile("stapo_jax")

# the longest files of a full run (pytest --durations, summed per file, 2026-12-05), longest first; every other
# file keeps its place after them
SLOW_FIRST = ("test_multihost.py", "test_packing.py", "test_run_robustness.py", "test_plan_target.py",
              "test_train_step.py", "test_attention.py", "test_resume.py", "test_gpu_check.py",
              "test_reference_policy.py", "test_remove_padding.py", "test_soak.py", "test_distributed.py",
              "test_objectives.py", "test_compile_accounting.py", "test_verifiers_benchmarks.py",
              "test_trainer_e2e.py", "test_batched_prefill.py", "test_demo.py", "test_readme_outputs.py")


def pytest_configure(config):
    """Keep ``SLOW_FIRST``'s order under ``-n 2 --dist loadfile``: pytest-xdist >= 3.6 otherwise reorders the
    files by their number of tests (``--loadscope-reorder``, its default), which put the few long multi-process
    files last, one worker running them alone at the end of the suite."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Put the tests of ``SLOW_FIRST`` files first (in that order), the others after them in collection order."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))
