"""Every command output quoted in README.md and docs/*.md is what the command prints today (the rules:
``tests/readme_outputs.py``; the blocks marked ``output[slow]`` are checked by ``python tests/readme_outputs.py
--slow``)."""
from __future__ import annotations

import pytest
from readme_outputs import Quote, documents, mismatch, quotes, run, same_line

ALL = [q for path in documents() for q in quotes(path)]
FAST = [q for q in ALL if not q.slow]


def test_the_readme_quotes_check_plan_and_demo_outputs():
    commands = " | ".join(q.command for q in ALL)
    for needed in ("check examples/check/verl_grpo_step.safetensors", "check examples/check/trl_grpo_step",
                   "plan --config configs/paper/qwen3-1.7b-base-stapo.yaml --mesh gpu-8xh200", "demo"):
        assert needed in commands, needed
    assert all(q.lines for q in ALL), [q for q in ALL if not q.lines]


@pytest.mark.parametrize("quote", FAST, ids=[f"{q.path}:{q.line}" for q in FAST])
def test_quoted_output_is_what_the_command_prints(quote: Quote):
    output = run(quote.command)
    missing = mismatch(quote, output)
    assert missing is None, f"{quote.path}:{quote.line}: `{quote.command}` no longer prints {missing!r}:\n{output}"


def test_the_matching_rules():
    q = Quote("x.md", 1, "cmd", False, ("a 1.0e-08 ok", "b 39.75 GB", "...", "end <seconds> s"))
    printed = "noise\na  0.000e+00 ok\nb 39.75 GB\nmore\nend 12.5 s\n"
    assert mismatch(q, printed) is None
    assert mismatch(q, printed.replace("39.75", "39.76")) == "b 39.75 GB"  # a plan figure must match exactly
    assert mismatch(q, "a 0 ok\nother\nb 39.75 GB\nend 1 s") == "b 39.75 GB"  # adjacent unless after '...'
    assert mismatch(q, "a 0 ok\nb 39.75 GB\nend s") == "end <seconds> s"
    assert same_line("pg_loss 0.0689094514 yes", "pg_loss   0.0689094439  yes")
    assert not same_line("PASS", "FAIL") and not same_line("x 1", "x 1 2")
