"""No test depends on a library that ``make test`` does not install.

A fresh machine runs the README's commands (``make run``, ``make test``): the Makefile creates ``.venv`` and
installs the requirement files its recipes name (``pip install -r``; ``--no-deps`` for JetStream and the peers).
Instead of a real install into a clean virtual environment (several GB and ~10 minutes, too slow for the suite),
this test reads what such an install provides and what the code imports, and checks one against the other:

* the requirement files and their ``--no-deps`` flags come from the ``Makefile`` itself;
* the installed set is the named distributions plus, for files installed with dependencies, everything they
  require (``importlib.metadata``, markers of extras and other platforms left out), transitively;
* every third-party top-level module imported anywhere in ``stapo_jax/``, ``models/``, ``tests/`` and the
  ``bench/`` / ``launch/`` scripts the tests import (``ast``; stdlib and project modules excluded) must come
  from a distribution of that set (``importlib.metadata.packages_distributions``).

A system library is outside pip's reach: the only one the code uses, TCMalloc, is optional
(``tests/runtime/test_allocator.py`` expects the allocator this machine has).
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("stapo_jax", "models", "tests")
SCRIPT_DIRS = ("bench", "launch", "tests")  # modules imported by name from sys.path entries (tests add them)
PROJECT = {"stapo_jax", "models"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def makefile_requirements(makefile: Path = ROOT / "Makefile") -> list[tuple[str, bool]]:
    """``(requirements file, installed with dependencies)`` for every ``pip install ... -r FILE`` of the Makefile."""
    out = []
    for line in makefile.read_text().splitlines():
        if "pip install" in line:
            for m in re.finditer(r"-r\s+(\S+)", line):
                out.append((m.group(1), "--no-deps" not in line))
    return out


def requirement_names(path: Path) -> list[Requirement]:
    """The requirements of one file (comments and blank lines skipped)."""
    reqs = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append(Requirement(line))
    return reqs


def installed_closure(files: list[tuple[str, bool]]) -> set[str]:
    """Normalised names of what installing ``files`` provides (dependencies followed where pip follows them)."""
    env = {**default_environment(), "extra": ""}
    provided: set[str] = set()
    expanded: set[str] = set()
    todo: list[tuple[str, bool]] = []
    for name, with_deps in files:
        todo += [(r.name, with_deps) for r in requirement_names(ROOT / name)]
    while todo:
        name, with_deps = todo.pop()
        provided.add(_norm(name))
        if not with_deps or _norm(name) in expanded:
            continue
        expanded.add(_norm(name))
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for spec in requires:
            r = Requirement(spec)
            if r.marker is None or r.marker.evaluate(env):
                todo.append((r.name, True))
    return provided


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def third_party_imports() -> dict[str, set[str]]:
    """``{top-level module: {file, ...}}`` of the third-party imports of the scanned code and the scripts it
    imports."""
    scripts = {p.stem: p for d in SCRIPT_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts}
    files = [p for d in SCANNED for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts]
    found: dict[str, set[str]] = {}
    done: set[Path] = set()
    while files:
        path = files.pop()
        if path in done:
            continue
        done.add(path)
        for mod in _imports(path):
            if mod in scripts:
                files.append(scripts[mod])
            elif mod not in sys.stdlib_module_names and mod not in PROJECT:
                found.setdefault(mod, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_the_makefile_installs_every_requirement_file():
    named = {name for name, _ in makefile_requirements()}
    assert named == {p.name for p in ROOT.glob("requirements*.txt")}, named
    assert ("requirements.txt", True) in makefile_requirements()
    assert ("requirements-peers.txt", False) in makefile_requirements()


def test_every_imported_library_is_installed_by_make_test():
    provided = installed_closure(makefile_requirements())
    assert {"jax", "torch", "verl", "trl", "pytest", "jaxlib", "ml-dtypes"} <= provided  # jaxlib: jax's dependency
    by_module = md.packages_distributions()
    missing = {}
    for mod, where in sorted(third_party_imports().items()):
        dists = {_norm(d) for d in by_module.get(mod, [])}
        if not dists & provided:
            missing[mod] = (sorted(dists) or "not installed here", sorted(where)[:3])
    assert not missing, f"imported but not installed by the Makefile's requirement files: {missing}"


def test_the_check_sees_a_library_nothing_installs(tmp_path):
    (tmp_path / "Makefile").write_text("x:\n\tpip install -r requirements.txt\n\tpip install --no-deps -r peers.txt\n")
    assert makefile_requirements(tmp_path / "Makefile") == [("requirements.txt", True), ("peers.txt", False)]
    (tmp_path / "peers.txt").write_text("trl==1.16.0  # no deps\n")
    closure = installed_closure([(str(tmp_path / "peers.txt"), False)])
    assert closure == {"trl"}  # its dependencies (accelerate, datasets, ...) are not followed under --no-deps
    assert "accelerate" in {_norm(Requirement(r).name) for r in md.requires("trl") or []}
