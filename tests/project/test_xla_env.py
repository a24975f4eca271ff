"""tests/xla_env.py: the XLA flags of the test processes, added to a user's own XLA_FLAGS without overriding them."""
from xla_env import FAST_COMPILE_FLAGS, with_test_flags, xla_flags


def test_xla_flags_name_the_devices_and_the_fast_compile_flags():
    assert xla_flags(3).split() == [*FAST_COMPILE_FLAGS, "--xla_force_host_platform_device_count=3"]
    assert xla_flags().split() == list(FAST_COMPILE_FLAGS)  # one CPU device: no device-count flag


def test_a_users_flags_win_and_the_missing_ones_are_added():
    assert with_test_flags("", 8) == xla_flags(8)
    user = "--xla_force_host_platform_device_count=2 --xla_dump_to=/tmp/d --xla_backend_optimization_level=2"
    merged = with_test_flags(user, 8).split()
    assert merged == [*user.split(), "--xla_llvm_disable_expensive_passes=true"]
    assert with_test_flags(with_test_flags("", 8), 8) == xla_flags(8)  # xdist workers inherit it: idempotent
