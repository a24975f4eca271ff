"""The host allocator (stapo_jax.runtime.allocator): the preload decision as a pure function, and the real
re-execution of a Python process and of the ``stapo-jax`` command under TCMalloc (Debian's
``libtcmalloc-minimal4``, which ``.ci/run`` installs)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_jax.runtime.allocator import (ENV_ALLOCATOR, ENV_REEXEC, REPORT_THRESHOLD, AllocatorError, find_tcmalloc,
                                         loaded_allocator, preload_env)

ROOT = Path(__file__).resolve().parents[1]
LIB = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def test_preload_env_prepends_the_library_once():
    env = preload_env({"LD_PRELOAD": "/opt/other.so", "PATH": "/bin"}, "system", LIB)
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/other.so"
    assert env[ENV_REEXEC] == "1" and env["PATH"] == "/bin"
    assert env[REPORT_THRESHOLD[0]] == REPORT_THRESHOLD[1]
    assert preload_env({}, "system", LIB)["LD_PRELOAD"] == LIB
    # a threshold the user set is kept
    assert preload_env({REPORT_THRESHOLD[0]: "5"}, "system", LIB)[REPORT_THRESHOLD[0]] == "5"


@pytest.mark.parametrize("env, loaded, lib", [
    ({ENV_ALLOCATOR: "system"}, "system", LIB),     # asked for none
    ({}, "tcmalloc", LIB),                          # already under TCMalloc
    ({ENV_ALLOCATOR: "tcmalloc"}, "jemalloc", LIB),  # another allocator the user preloaded
    ({ENV_REEXEC: "1"}, "system", LIB),             # re-executed once already: no loop
    ({}, "system", None),                           # auto without the library
])
def test_preload_env_keeps_the_process(env, loaded, lib):
    assert preload_env(env, loaded, lib) is None


def test_preload_env_errors_name_the_variable():
    with pytest.raises(AllocatorError, match=f"{ENV_ALLOCATOR}='jemalloc'.*auto, tcmalloc, system"):
        preload_env({ENV_ALLOCATOR: "jemalloc"}, "system", LIB)
    with pytest.raises(AllocatorError, match="libtcmalloc-minimal4"):
        preload_env({ENV_ALLOCATOR: "tcmalloc"}, "system", None)
    with pytest.raises(AllocatorError, match="TCMalloc is not loaded"):
        preload_env({ENV_ALLOCATOR: "tcmalloc", ENV_REEXEC: "1", "LD_PRELOAD": LIB}, "system", LIB)


def test_find_and_loaded_allocator_read_the_files(tmp_path):
    assert find_tcmalloc([str(tmp_path)]) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc([str(tmp_path / "missing"), str(tmp_path)]) == str(tmp_path / "libtcmalloc.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")  # the minimal build first
    assert find_tcmalloc([str(tmp_path)]) == str(tmp_path / "libtcmalloc_minimal.so.4")
    maps = tmp_path / "maps"
    maps.write_text("7f0 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert loaded_allocator(str(maps)) == "system"
    maps.write_text(maps.read_text() + "7f1 r-xp 00000000 08:01 2 /usr/lib/libjemalloc.so.2\n")
    assert loaded_allocator(str(maps)) == "jemalloc"
    assert loaded_allocator(str(tmp_path / "absent")) == "system"


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV_REEXEC, ENV_ALLOCATOR)}
    env.update(extra)
    return env


def _run(args, **env):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_clean_env(**env), capture_output=True, text=True,
                          timeout=120)


PROBE = ("import os, sys; from stapo_jax.runtime.allocator import use_tcmalloc; "
         "print(use_tcmalloc(), sys.argv[1:], os.environ.get('LD_PRELOAD', ''))")


def test_a_process_reexecutes_itself_under_tcmalloc():
    lib = find_tcmalloc()
    assert lib is not None, "TCMalloc is not installed: apt-get install libtcmalloc-minimal4 (.ci/run does)"
    for mode in ("auto", "tcmalloc"):
        out = _run(["-c", PROBE, "a b", "--x=1"], **{ENV_ALLOCATOR: mode})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[0] == f"tcmalloc ['a b', '--x=1'] {lib}"  # same arguments after the exec
        assert "large alloc" not in out.stderr
    out = _run(["-c", PROBE], **{ENV_ALLOCATOR: "system"})
    assert out.stdout.strip() == "system []"


def test_the_cli_runs_under_tcmalloc_and_rejects_a_bad_value():
    assert find_tcmalloc() is not None, "TCMalloc is not installed: apt-get install libtcmalloc-minimal4"
    # required mode: the re-executed process raises (exit 2) unless TCMalloc is mapped into it
    out = _run(["-m", "stapo_jax", "launch", "--help"], **{ENV_ALLOCATOR: "tcmalloc"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("usage: stapo-jax launch") == 1  # printed by the re-executed process only
    bad = _run(["-m", "stapo_jax", "launch", "--help"], **{ENV_ALLOCATOR: "mimalloc"})
    assert bad.returncode == 2 and bad.stdout == ""
    assert f"stapo-jax launch: error: {ENV_ALLOCATOR}='mimalloc'" in bad.stderr


def test_a_program_read_from_stdin_is_not_reexecuted():
    """``python - < script.py``: the first process has consumed the script, so a re-execution would start with
    nothing to run and exit 0 silently; the program keeps running under the system allocator instead."""
    script = PROBE + "; print('ran to the end')"
    out = subprocess.run([sys.executable, "-", "x"], input=script, capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**_clean_env(), ENV_ALLOCATOR: "auto"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["system ['x'] ", "ran to the end"]
