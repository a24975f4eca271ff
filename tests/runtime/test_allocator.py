"""The host allocator (stapo_jax.runtime.allocator): the preload decision as a pure function, and the real
re-execution of a Python process and of the ``stapo-jax`` command.

The suite passes with or without TCMalloc on the machine (a fresh machine has none; ``.ci/run`` installs
Debian's ``libtcmalloc-minimal4``): the re-execution itself is exercised everywhere with a stand-in library
(a copy of zlib named ``libtcmalloc_minimal.so.4``: preloading it is harmless and ``/proc/self/maps`` shows the
name), and the tests of the real library expect what :func:`find_tcmalloc` finds on this machine: TCMalloc
where it is installed, the system allocator (``auto``) or a one-line error (``tcmalloc``) where it is not."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ctypes.util
import shutil

import pytest

from stapo_jax.runtime.allocator import (ENV_ALLOCATOR, ENV_REEXEC, LIBRARY_DIRS, REPORT_THRESHOLD, AllocatorError,
                                         find_tcmalloc, loaded_allocator, preload_env)

ROOT = Path(__file__).resolve().parents[2]
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


def _stand_in_library(tmp_path) -> str:
    """A copy of the system zlib named like TCMalloc (preloading it changes nothing; the maps show the name)."""
    name = ctypes.util.find_library("z")
    source = next((str(Path(d) / name) for d in LIBRARY_DIRS + ("/lib/x86_64-linux-gnu", "/lib64", "/lib")
                   if name and (Path(d) / name).is_file()), None)
    assert source, f"no zlib shared library ({name!r}) in {LIBRARY_DIRS}"
    target = tmp_path / "libtcmalloc_minimal.so.4"
    shutil.copyfile(source, target)
    return str(target)


def test_a_process_reexecutes_itself_under_the_library_it_finds(tmp_path):
    """The re-execution on any machine: ``find_tcmalloc`` pointed at a stand-in library in ``tmp_path``."""
    lib = _stand_in_library(tmp_path)
    probe = (f"import os, sys; from stapo_jax.runtime import allocator; "
             f"allocator.find_tcmalloc = lambda: {lib!r}; " + PROBE.split("; ", 1)[1])
    for mode in ("auto", "tcmalloc"):
        out = _run(["-c", probe, "a b", "--x=1"], **{ENV_ALLOCATOR: mode})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[0] == f"tcmalloc ['a b', '--x=1'] {lib}"  # same arguments after the exec
    out = _run(["-c", probe], **{ENV_ALLOCATOR: "system"})
    assert out.stdout.strip() == "system []"


def test_a_process_runs_under_the_allocator_this_machine_has():
    lib = find_tcmalloc()
    for mode in ("auto", "tcmalloc"):
        out = _run(["-c", PROBE, "a b", "--x=1"], **{ENV_ALLOCATOR: mode})
        if lib is None and mode == "tcmalloc":  # required but missing: an error naming the package, no loop
            assert out.returncode == 1 and "AllocatorError" in out.stderr and "libtcmalloc-minimal4" in out.stderr
            continue
        assert out.returncode == 0, out.stderr
        expected = f"tcmalloc ['a b', '--x=1'] {lib}" if lib else "system ['a b', '--x=1'] "
        assert out.stdout.split("\n")[0] == expected
        assert "large alloc" not in out.stderr
    out = _run(["-c", PROBE], **{ENV_ALLOCATOR: "system"})
    assert out.stdout.strip() == "system []"


def test_the_cli_runs_under_the_allocator_this_machine_has_and_rejects_a_bad_value():
    # required mode: exit 0 under TCMalloc where it is installed; else one error line naming the package, exit 2
    out = _run(["-m", "stapo_jax", "launch", "--help"], **{ENV_ALLOCATOR: "tcmalloc"})
    if find_tcmalloc() is not None:
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("usage: stapo-jax launch") == 1  # printed by the re-executed process only
    else:
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.strip().count("\n") == 0 and "apt-get install libtcmalloc-minimal4" in out.stderr
    auto = _run(["-m", "stapo_jax", "launch", "--help"], **{ENV_ALLOCATOR: "auto"})
    assert auto.returncode == 0 and auto.stdout.count("usage: stapo-jax launch") == 1
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
