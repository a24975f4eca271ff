"""requirements.txt admits only jax / flax pairs that import (issue 33, item 7): flax 0.12.8 fails to import on
jax 0.11.2 (``jax.experimental.hijax`` has no ``HiPrimitive``), flax 0.12.10 works. The pins are read with
``packaging`` and evaluated for every Python the project supports."""
from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements.txt"
PYTHONS = ("3.11", "3.12", "3.13")
JAX_RELEASES = ("0.10.2", "0.11.0", "0.11.1", "0.11.2", "0.12.0")
FLAX_RELEASES = ("0.12.8", "0.12.9", "0.12.10", "0.12.12")
KNOWN_GOOD = {("3.11", "0.10.2", "0.12.8"), ("3.12", "0.11.2", "0.12.10")}  # pairs that ran the suite


def pins(text: str, python: str) -> dict[str, list[Requirement]]:
    """The requirement lines of ``text`` that apply under ``python`` (markers evaluated), by package name."""
    out: dict[str, list[Requirement]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"python_version": python, "python_full_version": python + ".0"}):
            out.setdefault(req.name.lower(), []).append(req)
    return out


def admitted(reqs: list[Requirement], version: str) -> bool:
    """True when every requirement in ``reqs`` admits ``version``."""
    return all(r.specifier.contains(Version(version), prereleases=True) for r in reqs)


def bad_pairs(text: str) -> list[tuple[str, str, str]]:
    """(python, jax, flax) pairs the pins admit where flax < 0.12.10 meets jax >= 0.11."""
    out = []
    for py in PYTHONS:
        p = pins(text, py)
        for jax_v in JAX_RELEASES:
            for flax_v in FLAX_RELEASES:
                if admitted(p.get("jax", []), jax_v) and admitted(p.get("flax", []), flax_v) and \
                        Version(jax_v) >= Version("0.11") and Version(flax_v) < Version("0.12.10"):
                    out.append((py, jax_v, flax_v))
    return out


def test_requirements_admit_no_failing_jax_flax_pair():
    assert bad_pairs(REQUIREMENTS.read_text()) == []


def test_requirements_admit_the_pairs_that_work():
    text = REQUIREMENTS.read_text()
    for py, jax_v, flax_v in sorted(KNOWN_GOOD):
        p = pins(text, py)
        assert p["jax"] and p["flax"], f"no jax/flax pin applies on Python {py}"
        assert admitted(p["jax"], jax_v) and admitted(p["flax"], flax_v), (py, jax_v, flax_v)


def test_checker_rejects_the_former_pins():
    former = "jax>=0.10.2\nflax>=0.12.8\n"
    assert ("3.12", "0.11.2", "0.12.8") in bad_pairs(former)
