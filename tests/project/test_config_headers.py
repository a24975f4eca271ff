"""Issue 43: the figures a shipped config's header quotes are the README's (``configs/tiny_cpu.yaml`` said
0.21-0.29 and +0.08 to +0.18 while README said 0.245-0.313 and +0.011 to +0.124)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIGURE = re.compile(r"[+]?\d+\.\d+(?:-\d+\.\d+| to [+]?\d+\.\d+)")  # a range: 0.245-0.313, +0.011 to +0.124


def header_figures(path: Path) -> list[str]:
    """The ranges quoted in the leading comment block of a YAML config (list of str)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return FIGURE.findall(" ".join(lines))


def test_the_main_job_header_quotes_the_readme_figures():
    readme = " ".join((REPO / "README.md").read_text().split())
    figures = header_figures(REPO / "configs" / "tiny_cpu.yaml")
    quoted = [f for f in figures if not f.startswith("0.1-")]  # the 300-step warm-up's figure is history
    assert quoted == ["0.245-0.313", "0.302-0.437", "+0.011 to +0.124"], figures
    assert all(f in readme for f in quoted), [f for f in quoted if f not in readme]
