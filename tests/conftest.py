"""Test-wide setup: 8 simulated CPU devices (set before jax is imported), offline HF, derandomized hypothesis.

Every test process sees 8 host devices, so mesh tests run in-process; single-device code still runs on
device 0. Shared fixtures live in tests/fixtures_*.py modules and are imported where needed.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
