"""Code-quality rules from the project brief (issue 11), checked by reading the source with ``ast``.

* Every public function, class and public method has a docstring; in ``STRICT_DIRS`` (every directory of
  ``DOCSTRING_DIRS``, less the files in ``STRICT_PENDING``) every public module-level
  function's docstring also names its source (paper / peer) and says what it raises (a ``Raises`` line, or words
  with "raises"/"errors"); a function that handles arrays must also state shapes (``[B, T]``-style or the word
  "shape"/"scalar") and dtypes (``float32``, ``bool``, ``int``, ...). Whether a function handles arrays is read
  from the code, not from its docstring (``handles_arrays``): a parameter or return annotation names an array
  type (``Array``, ``ndarray``, ``ArrayLike``, ``PyTree``, ``Tensor``), or the function passes one of its own
  parameters to an array call (``jnp.``, ``np.``, ``lax.``, ``jax.numpy.``, ``jax.lax.``, ``jax.nn.``,
  ``jax.random.``, ``jax.tree.``, ``jax.device_put`` / ``device_get``: ``ARRAY_CALL_PREFIXES``); ``jax.config``
  or ``jax.checkpoint`` calls do not count. Other functions need no ritual "no arrays" line. The files in ``STRICT_PENDING`` need a docstring only (their strict findings are
  printed by the script run, as ``docstring-pending``).
* No module imports another project module's private (``_name``) names.
* No file in ``stapo_jax/`` or ``models/`` is over 600 lines.
* No function in ``stapo_jax/`` or ``models/`` has over 60 lines of code: the lines after its docstring that are
  neither blank nor comments, its nested functions included; each nested function is also held to the limit on
  its own.

``DOCSTRING_DIRS`` lists the directories the docstring test covers: every subpackage of
``stapo_jax/`` plus ``models/``. ``PENDING`` may name files being rewritten elsewhere (reported by
``python tests/project/test_code_quality.py`` but not asserted); it is empty: every file is asserted.

Run as a script to print every finding in every directory (a before/after count for the audit)::

    PYTHONPATH=. python tests/project/test_code_quality.py
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("stapo_jax", "models")
ALL_DIRS = ("stapo_jax", "models")
# Directories whose docstrings are asserted.
DOCSTRING_DIRS = ("stapo_jax/algo", "stapo_jax/rewards", "stapo_jax/data", "stapo_jax/config",
                  "stapo_jax/runtime", "stapo_jax/tools", "stapo_jax/train", "stapo_jax/rollout", "models")
# Files inside DOCSTRING_DIRS being rewritten elsewhere: reported, not yet asserted (none today).
PENDING: tuple[str, ...] = ()
# Directories where a function must also name its source, state shapes and dtypes and say what it raises:
# all of them.
STRICT_DIRS = DOCSTRING_DIRS
# Files in STRICT_DIRS held to the plain docstring rule only, each because another branch is rewriting it now
# (its strict docstrings land with that rewrite). None at present.
STRICT_PENDING: tuple[str, ...] = ()
PRIVATE_IMPORT_DIRS = ("stapo_jax", "models", "bench", "launch", "tests")
MAX_LINES = 600
MAX_FUNCTION_CODE_LINES = 60

SOURCE_RE = re.compile(r"source|arxiv|verl|trl\b|paper|eq\.|equation|spec|peer|convention|§|pytorch|torch|"
                       r"official|stapo|definition", re.I)
SHAPE_RE = re.compile(r"\[[^\]]*\]|shape|scalar|float|int\b|bool|array", re.I)
RAISES_RE = re.compile(r"raise|error", re.I)
DTYPE_RE = re.compile(r"float32|float64|bfloat16|float16|int32|int64|\bbool\b|dtype|\bfloat\b|\bint\b|"
                      r"\bstr\b|pytree|string", re.I)
# An annotation naming one of these marks a function as handling arrays (see handles_arrays).
ARRAY_ANNOTATION_RE = re.compile(r"\b(Array|ndarray|ArrayLike|PyTree|Tensor)\b")
# Calls (dotted-name prefixes) that, given one of a function's own parameters, mark it as handling arrays.
ARRAY_CALL_PREFIXES = ("jnp.", "np.", "lax.", "jax.numpy.", "jax.lax.", "jax.nn.", "jax.random.",
                       "jax.device_put", "jax.device_get", "jax.tree.", "jax.tree_util.")


def _py_files(d: str):
    return sorted(p for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def _public_defs(tree: ast.Module):
    """(qualified name, node) for module-level public functions/classes and public methods of public classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                        yield f"{node.name}.{sub.name}", sub


def _dotted(func: ast.expr) -> str:
    """A call's dotted name (``jnp.linalg.norm``), or "" when it is not a plain attribute chain."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    return ".".join([func.id, *reversed(parts)]) if isinstance(func, ast.Name) else ""


def handles_arrays(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True when an annotation names an array type, or a call named in ``ARRAY_CALL_PREFIXES`` (``jnp.``, ``np.``,
    ``lax.``, ``jax.numpy.``, ``jax.device_put``, ...) takes one of the function's parameters in its arguments."""
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
              *([a.kwarg] if a.kwarg else [])]
    annotations = [p.annotation for p in params if p.annotation is not None] + ([node.returns] if node.returns else [])
    if any(ARRAY_ANNOTATION_RE.search(ast.unparse(t)) for t in annotations):
        return True
    names = {p.arg for p in params} - {"self", "cls"}
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and _dotted(call.func).startswith(ARRAY_CALL_PREFIXES):
            args = [*call.args, *(k.value for k in call.keywords)]
            if any(isinstance(n, ast.Name) and n.id in names for arg in args for n in ast.walk(arg)):
                return True
    return False


def docstring_findings(path: Path, exempt: tuple[str, ...] | None = None) -> list[str]:
    """Findings of one file; ``exempt`` (default ``STRICT_PENDING``) lists files held to the plain rule."""
    rel = _rel(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    strict = rel.startswith(STRICT_DIRS) and rel not in (STRICT_PENDING if exempt is None else exempt)
    out = []
    for qual, node in _public_defs(tree):
        doc = ast.get_docstring(node)
        where = f"{rel}:{node.lineno} {qual}"
        if not doc:
            out.append(f"{where}: no docstring")
            continue
        if not strict or isinstance(node, ast.ClassDef) or "." in qual:
            continue
        rules = (("source", SOURCE_RE), ("raises", RAISES_RE))
        if handles_arrays(node):
            rules = (("source", SOURCE_RE), ("shapes", SHAPE_RE), ("dtypes", DTYPE_RE), ("raises", RAISES_RE))
        missing = [part for part, rx in rules if not rx.search(doc)]
        if missing:
            out.append(f"{where}: docstring lacks {', '.join(missing)}")
    return out


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _module_name(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_import_findings(path: Path) -> list[str]:
    """``from project.mod import _name`` or ``project_mod._name`` where the module is another project module."""
    rel = _rel(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = _module_name(path)
    aliases: dict[str, str] = {}    # local name -> project module it is bound to
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(path, node)
            if mod.split(".")[0] not in PROJECT_PACKAGES:
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and mod != me:
                    out.append(f"{rel}:{node.lineno}: from {mod} import {a.name}")
                else:
                    aliases[a.asname or a.name] = f"{mod}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PROJECT_PACKAGES:
                    aliases[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            out.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    return out


def long_file_findings(path: Path) -> list[str]:
    n = len(path.read_text(encoding="utf-8").splitlines())
    return [f"{_rel(path)}: {n} lines > {MAX_LINES}"] if n > MAX_LINES else []


def function_code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of code of a function: from its first statement after the docstring to its end, less blank and
    comment-only lines (nested functions included)."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if not body:
        return 0
    return sum(1 for text in lines[body[0].lineno - 1:node.end_lineno]
               if text.strip() and not text.strip().startswith("#"))


def long_function_findings(path: Path) -> list[str]:
    """``file:line name: N code lines > 60`` for every function (methods and nested functions included)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    tree = ast.parse("\n".join(lines))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = function_code_lines(node, lines)
            if n > MAX_FUNCTION_CODE_LINES:
                out.append(f"{_rel(path)}:{node.lineno} {node.name}: {n} code lines > {MAX_FUNCTION_CODE_LINES}")
    return sorted(out)


@pytest.mark.parametrize("directory", DOCSTRING_DIRS)
def test_public_docstrings(directory):
    found = [f for p in _py_files(directory) if _rel(p) not in PENDING for f in docstring_findings(p)]
    assert found == [], "docstring findings:\n" + "\n".join(found)


RITUAL_RE = re.compile(r"\bno arrays\b", re.I)  # a phrase once added only to satisfy DTYPE_RE (issue 35)


@pytest.mark.parametrize("directory", ALL_DIRS)
def test_no_ritual_no_arrays_phrase(directory):
    """Docstrings state what a function takes and returns, not the absence of arrays."""
    found = [f"{_rel(p)}:{i}" for p in _py_files(directory)
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if RITUAL_RE.search(line)]
    assert found == [], "'no arrays' in:\n" + "\n".join(found)


@pytest.mark.parametrize("directory", PRIVATE_IMPORT_DIRS)
def test_no_imports_of_another_modules_private_names(directory):
    found = [f for p in _py_files(directory) for f in private_import_findings(p)]
    assert found == [], "imports of private names:\n" + "\n".join(found)


@pytest.mark.parametrize("directory", ALL_DIRS)
def test_no_file_over_600_lines(directory):
    found = [f for p in _py_files(directory) for f in long_file_findings(p)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("directory", ALL_DIRS)
def test_no_function_over_60_code_lines(directory):
    found = [f for p in _py_files(directory) for f in long_function_findings(p)]
    assert found == [], "\n".join(found)


def test_function_length_counts_code_lines_only(tmp_path, monkeypatch):
    """Blank lines, comments and the docstring do not count; a nested function counts in its parent and alone."""
    f = tmp_path / "stapo_jax" / "m.py"
    f.parent.mkdir()
    inner = "".join(f"        x{i} = {i}\n" for i in range(59))
    f.write_text('def outer():\n    """Doc.\n\n    More doc.\n    """\n    # a comment\n\n    def inner():\n'
                 + inner + "        return x0\n\n    return inner\n\n\ndef short():\n    return 1\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    lines = f.read_text().splitlines()
    funcs = {n.name: n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.FunctionDef)}
    assert {k: function_code_lines(v, lines) for k, v in funcs.items()} == {"outer": 62, "inner": 60, "short": 1}
    assert long_function_findings(f) == ["stapo_jax/m.py:1 outer: 62 code lines > 60"]


def test_checker_sees_a_missing_docstring_and_a_private_import(tmp_path, monkeypatch):
    """The checks find what they are meant to (so an empty finding list means something)."""
    pkg = tmp_path / "stapo_jax" / "algo"
    pkg.mkdir(parents=True)
    f = pkg / "m.py"
    f.write_text("from stapo_jax.data.prompts import _hidden\nimport stapo_jax.rewards as r\n"
                 "def f(x):\n    return r._p(x)\n\ndef g(x):\n    '''Doc.'''\n    return x\n\n"
                 "def h(x):\n    '''Doc.'''\n    return jnp.sum(x * 2)\n\n"
                 "def k(x: jax.Array) -> int:\n    '''Doc.'''\n    return 1\n\n"
                 "def n(path: str) -> str:\n    '''Doc. Source: convention. Raises OSError.'''\n"
                 "    return str(jax.devices())\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    # g, n: no array annotation and no jnp/np/jax call on a parameter, so no shapes/dtypes asked; h, k: arrays.
    assert docstring_findings(f) == ["stapo_jax/algo/m.py:3 f: no docstring",
                                     "stapo_jax/algo/m.py:6 g: docstring lacks source, raises",
                                     "stapo_jax/algo/m.py:10 h: docstring lacks source, shapes, dtypes, raises",
                                     "stapo_jax/algo/m.py:14 k: docstring lacks source, shapes, dtypes, raises"]
    assert private_import_findings(f) == ["stapo_jax/algo/m.py:1: from stapo_jax.data.prompts import _hidden",
                                          "stapo_jax/algo/m.py:4: r._p"]


if __name__ == "__main__":
    rows = []
    for d in ALL_DIRS:
        for p in _py_files(d):
            rows += [("docstring", f) for f in docstring_findings(p)]
            if _rel(p) in STRICT_PENDING:  # exempt from the strict rule for now: report what it still lacks
                rows += [("docstring-pending", f) for f in docstring_findings(p, exempt=())
                         if f not in docstring_findings(p)]
    for d in PRIVATE_IMPORT_DIRS:
        for p in _py_files(d):
            rows += [("private-import", f) for f in private_import_findings(p)]
    for d in ALL_DIRS:
        for p in _py_files(d):
            rows += [("long-file", f) for f in long_file_findings(p)]
            rows += [("long-function", f) for f in long_function_findings(p)]
    for kind, f in rows:
        print(f"{kind:15s} {f}")
    counts = {k: sum(1 for kind, _ in rows if kind == k)
              for k in ("docstring", "docstring-pending", "private-import", "long-file", "long-function")}
    print("counts:", counts)
