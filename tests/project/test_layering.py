"""The package's dependency layering (DESIGN.md, "Package layout: layers with one direction"), read from the source.

Every import of every module in ``stapo_jax/`` and ``models/`` counts: top-level, inside functions (lazy), under
``if TYPE_CHECKING:`` and relative ones. A module may import its own package and packages of a *lower* layer only,
and the module graph has no cycle.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Lowest first; the layers of DESIGN.md's picture. A unit is a package (its modules and subpackages) or the root
# package's own modules (``stapo_jax/__init__.py``, ``__main__.py``: the CLI entry and the lazy re-exports).
LAYERS: dict[str, int] = {
    "stapo_jax.core": 0,     # errors (ConfigError, CheckpointError), settings coercion, Registry
    "stapo_jax.assets": 0,   # shipped data files (importlib.resources)
    "models": 1,             # the Qwen3 port
    "stapo_jax.algo": 1,     # the pure algorithm and its settings dataclasses
    "stapo_jax.rewards": 2,  # verifiers and their registry
    "stapo_jax.config": 3,   # run schema, YAML loading (checks registered names), named recipe presets
    "stapo_jax.data": 4,
    "stapo_jax.runtime": 5,  # config -> mesh / tokenizer / model (build), collectives, multi-controller, checkpoints
    "stapo_jax.rollout": 6,
    "stapo_jax.train": 7,
    "stapo_jax.tools": 8,
    "stapo_jax": 9,
}
CONFIG_LAYER = LAYERS["stapo_jax.config"]

# Third-party packages the bottom layers may import (besides the standard library and the modules of ours the
# layer table allows).
PURE_IMPORTS = {
    "stapo_jax.core": set(),
    "stapo_jax.algo": {"jax", "numpy"},
    "models": {"jax", "numpy", "flax", "ml_dtypes", "safetensors", "huggingface_hub"},  # hf.py reads checkpoints
}


def module_files(root: Path = REPO) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every ``.py`` file under ``stapo_jax/`` and ``models/``."""
    out = {}
    for pkg in ("stapo_jax", "models"):
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def imported_names(source: str, module: str, is_pkg: bool) -> list[tuple[str, int]]:
    """Every absolute dotted name imported anywhere in ``source`` (``from a import b`` gives ``a.b``: the module
    ``a.b``, or else the name b of module ``a``), with its line; relative imports resolved against ``module``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_pkg else module.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def import_graph(root: Path = REPO) -> dict[str, dict[str, int]]:
    """module -> {imported module of ours -> first line}: each imported name resolved to the longest module
    prefix that exists (``from a.b import f`` -> ``a.b``; ``from a import b`` -> ``a.b`` when b is a module).
    The parent packages Python imports on the way are not edges: a package's ``__init__`` runs before any of
    its modules in every case."""
    mods = module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for mod, (path, is_pkg) in mods.items():
        edges = graph.setdefault(mod, {})
        for name, line in imported_names(path.read_text(encoding="utf-8"), mod, is_pkg):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod:
                edges.setdefault(name, line)
    return graph


def unit_of(module: str) -> str:
    """The ``LAYERS`` unit of a module: its longest dotted prefix in the table."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in LAYERS:
            return ".".join(parts[:i])
    raise KeyError(f"{module}: no layer in tests/project/test_layering.py LAYERS (add its package to the table and to "
                   f"DESIGN.md's picture)")


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """``"a (layer i) -> b (layer j), line n"`` for every import of a unit of the same or a higher layer."""
    out = []
    for mod, edges in sorted(graph.items()):
        for dep, line in sorted(edges.items()):
            a, b = unit_of(mod), unit_of(dep)
            if a != b and LAYERS[b] >= LAYERS[a]:
                out.append(f"{mod} (layer {LAYERS[a]}) -> {dep} (layer {LAYERS[b]}), line {line}")
    return out


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str]:
    """One import cycle ``[m0, m1, ..., m0]`` (depth-first search), or [] when the graph is acyclic."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, {})):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_every_module_has_a_layer_and_imports_only_lower_layers():
    graph = import_graph()
    assert len(graph) > 80 and "models.qwen3" in graph and "stapo_jax.tools.cli" in graph  # both packages read
    for mod in graph:
        unit_of(mod)  # raises, naming the module, for a package missing from the table
    assert layer_violations(graph) == []


def test_no_import_cycles():
    assert find_cycle(import_graph()) == []


def test_bottom_layer_imports_only_jax_numpy_and_the_standard_library():
    """Third-party imports of the bottom layer (imports of ours: the layer test)."""
    mods = module_files()
    for unit, allowed in PURE_IMPORTS.items():
        for mod, (path, is_pkg) in mods.items():
            if unit_of(mod) != unit:
                continue
            for name, line in imported_names(path.read_text(encoding="utf-8"), mod, is_pkg):
                top = name.split(".")[0]
                assert top in ("stapo_jax", "models") or top in allowed or top in sys.stdlib_module_names, \
                    f"{mod}:{line} imports {name}"


def test_the_checks_see_lazy_type_checking_and_relative_imports(tmp_path):
    """The reader on a throw-away tree: an upward lazy import, a TYPE_CHECKING import and a relative import
    that closes a cycle are all reported."""
    for rel, text in {
        "stapo_jax/__init__.py": "",
        "stapo_jax/algo/__init__.py": "",
        "stapo_jax/algo/a.py": "def f():\n    from stapo_jax.train import t\n",
        "stapo_jax/train/__init__.py": "",
        "stapo_jax/train/t.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .u import X\n",
        "stapo_jax/train/u.py": "from . import t\n",
        "models/__init__.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["stapo_jax.algo.a"] == {"stapo_jax.train.t": 2}
    assert graph["stapo_jax.train.t"] == {"stapo_jax.train.u": 3}
    assert layer_violations(graph) == ["stapo_jax.algo.a (layer 1) -> stapo_jax.train.t (layer 7), line 2"]
    assert find_cycle(graph) == ["stapo_jax.train.t", "stapo_jax.train.u", "stapo_jax.train.t"]


def test_no_package_defines_a_name_of_one_of_its_modules():
    """Importing ``pkg.x`` sets ``pkg.x`` to the module, replacing a function ``x`` that ``pkg/__init__.py``
    defines (``stapo_jax.rollout.engine_config`` once did), so a module name must not be a package-level name."""
    mods = module_files()
    clashes = []
    for mod, (path, is_pkg) in mods.items():
        if not is_pkg:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
                t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            clashes += [f"{mod}.{n}" for n in names if f"{mod}.{n}" in mods]
    assert clashes == []


# Functions below ``config`` that still take the whole run config; to be given the sections they read instead.
# Each entry must still be found (the test fails when one is fixed, so the list only shrinks).
WHOLE_CONFIG_KNOWN: set[str] = set()
WHOLE_CONFIG_PARAMS = ("cfg", "run_cfg", "run_config")  # the project's names of the whole run config


def whole_config_params(root: Path = REPO, below: int = CONFIG_LAYER) -> list[str]:
    """``"module.function(param)"`` for every parameter of a function (or method, or lambda) in a module of a layer
    below ``below`` that takes the whole run config: annotated ``Config`` (``schema.Config``, ``"Config"``), or
    named ``cfg`` / ``run_cfg`` / ``run_config`` and annotated ``Any`` or not at all (which would hide the
    dependency from the layer test). A section or a model config (``cfg: Qwen3Config``) is fine."""

    def names_config(ann) -> bool:
        if ann is None:
            return False
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return False
        return any((isinstance(n, ast.Name) and n.id == "Config")
                   or (isinstance(n, ast.Attribute) and n.attr == "Config") for n in ast.walk(ann))

    def hides(arg: ast.arg) -> bool:
        ann = arg.annotation
        is_any = (ann is None or (isinstance(ann, ast.Name) and ann.id == "Any")
                  or (isinstance(ann, ast.Constant) and ann.value == "Any")
                  or (isinstance(ann, ast.Attribute) and ann.attr == "Any"))
        return arg.arg in WHOLE_CONFIG_PARAMS and is_any

    out = []
    for mod, (path, _) in module_files(root).items():
        if LAYERS[unit_of(mod)] >= below:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
                if names_config(arg.annotation) or hides(arg):
                    out.append(f"{mod}.{getattr(node, 'name', '<lambda>')}({arg.arg})")
    return sorted(out)


def test_no_function_below_config_takes_the_whole_run_config():
    """Builders below ``config`` take the sections they read (issue 44), so the layer test sees every dependency."""
    assert whole_config_params() == sorted(WHOLE_CONFIG_KNOWN)


def test_the_whole_config_check_sees_annotations_and_untyped_cfg(tmp_path):
    for rel, text in {
        "stapo_jax/__init__.py": "",
        "stapo_jax/algo/__init__.py": "",
        "stapo_jax/algo/a.py": ("from typing import Any\n"
                                "def f(cfg: 'Config'): ...\n"
                                "def g(x, *, cfg: Any = None): ...\n"
                                "def h(run_cfg): ...\n"
                                "def i(cfg: 'schema.Config | None'): ...\n"
                                "def ok(cfg: 'Qwen3Config', section: Any, config: 'PolicyLossConfig'): ...\n"),
        "stapo_jax/train/__init__.py": "",
        "stapo_jax/train/t.py": "def f(cfg: 'Config'): ...\n",  # above config: allowed here
        "models/__init__.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert whole_config_params(tmp_path) == ["stapo_jax.algo.a.f(cfg)", "stapo_jax.algo.a.g(cfg)",
                                             "stapo_jax.algo.a.h(run_cfg)", "stapo_jax.algo.a.i(cfg)"]
