"""Check the command outputs quoted in ``README.md`` and ``docs/*.md`` against what the commands print today.

A quoted output is a fenced block right after a marker comment naming the command::

    <!-- output: stapo-jax check examples/check/verl_grpo_step.safetensors --recipe grpo -->
    ```text
    name                             ours           theirs    abs diff    rel diff  ok
    ...
    ```

``output[slow]:`` marks a command too slow for the test suite (``stapo-jax plan`` of a 14B model: about a
minute each on 2 cores): ``tests/project/test_readme_outputs.py`` runs every other block, and this script runs all of
them (``python tests/readme_outputs.py [--slow] [FILE ...]``, exit 1 on a mismatch, printing the differences).

Matching rules (the same for the test and the script):

* the command runs from the repository root; ``stapo-jax ...`` (or ``.venv/bin/stapo-jax ...``) runs as
  ``python -m stapo_jax ...`` with this interpreter; its stdout, then its stderr, is the output;
* every non-empty line of the block must appear in the output, in the block's order and adjacent to the
  previous one, except after a line ``...``, which stands for any number of omitted lines;
* runs of white space compare as one space; numbers compare within ``1e-6 + 1e-5 * |quoted|`` (so a
  float32 difference printed as ``7.451e-09`` may read ``0.000e+00`` on another CPU, while a ``plan`` figure
  printed to 0.01 GB must match to the digit); ``<seconds>`` in a block matches any number (timings).
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a marker on a line of its own, then (blank lines allowed) a fenced block
MARKER = re.compile(r"^<!--[ \t]*output(?P<slow>\[slow\])?:[ \t]*(?P<cmd>[^\n]+?)[ \t]*-->[ \t]*\n\s*```[^\n]*\n"
                    r"(?P<body>.*?)^```", re.S | re.M)
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
ATOL, RTOL = 1e-6, 1e-5


@dataclass(frozen=True)
class Quote:
    """One quoted output: the file and line of its marker, the command, whether it is slow, the quoted lines."""
    path: str
    line: int
    command: str
    slow: bool
    lines: tuple[str, ...]


def documents(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def quotes(path: Path) -> list[Quote]:
    """Every marked block of one Markdown file."""
    text = path.read_text(encoding="utf-8")
    return [Quote(path.name if path.parent == ROOT else f"{path.parent.name}/{path.name}",
                  text.count("\n", 0, m.start()) + 1, m.group("cmd"), bool(m.group("slow")),
                  tuple(line for line in m.group("body").splitlines() if line.strip()))
            for m in MARKER.finditer(text)]


def argv_of(command: str) -> list[str]:
    """The process arguments of a quoted command (``stapo-jax`` runs as ``python -m stapo_jax``)."""
    args = shlex.split(command)
    if args and args[0] in ("stapo-jax", ".venv/bin/stapo-jax"):
        return [sys.executable, "-m", "stapo_jax", *args[1:]]
    if args and args[0] in ("python", ".venv/bin/python"):
        return [sys.executable, *args[1:]]
    return args


def run(command: str, timeout: float = 900) -> str:
    """stdout then stderr of the command, run from the repository root."""
    out = subprocess.run(argv_of(command), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return out.stdout + out.stderr


def _tokens(line: str) -> list:
    parts, pos = [], 0
    line = " ".join(line.split())
    for m in NUMBER.finditer(line):
        parts += [line[pos:m.start()], float(m.group())]
        pos = m.end()
    return parts + [line[pos:]]


def same_line(quoted: str, printed: str) -> bool:
    """Whether a printed line matches a quoted one (white space, number tolerance, ``<seconds>``)."""
    if "<seconds>" in quoted:
        pattern = re.escape(" ".join(quoted.split())).replace(re.escape("<seconds>"), NUMBER.pattern)
        return re.fullmatch(pattern, " ".join(printed.split())) is not None
    a, b = _tokens(quoted), _tokens(printed)
    return len(a) == len(b) and all(
        x == y if isinstance(x, str) else isinstance(y, float) and abs(x - y) <= ATOL + RTOL * abs(x)
        for x, y in zip(a, b))


def mismatch(quote: Quote, output: str) -> str | None:
    """None when the quoted lines appear in ``output`` by the rules above, else the first quoted line not found."""
    printed = [line for line in output.splitlines() if line.strip()]
    pos, gap = 0, True
    for line in quote.lines:
        if line.strip() == "...":
            gap = True
            continue
        hits = [i for i in range(pos, len(printed) if gap else min(pos + 1, len(printed)))
                if same_line(line, printed[i])]
        if not hits:
            return line
        pos, gap = hits[0] + 1, False
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the marked commands of the given Markdown files (default: README.md and docs/*.md); exit 1 on a
    mismatch."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--slow", action="store_true", help="also the blocks marked output[slow]")
    a = p.parse_args(argv)
    bad = 0
    for path in a.files or documents():
        for q in quotes(path):
            if q.slow and not a.slow:
                continue
            output = run(q.command)
            missing = mismatch(q, output)
            print(f"{q.path}:{q.line}: {q.command}: {'ok' if missing is None else 'MISMATCH'}")
            if missing is not None:
                bad += 1
                print(f"  quoted line not printed: {missing!r}\n  printed:\n    " +
                      "\n    ".join(output.splitlines()[-40:]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
