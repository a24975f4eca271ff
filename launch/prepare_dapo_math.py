"""Convert DAPO-Math-17k (HF ``BytedTsinghua-SIA/DAPO-Math-17k``, verl parquet layout) into the JSONL the paper
configs read: one ``{"problem", "answer", "data_source", "index"}`` object per line.

The source rows hold ``prompt = [{"role": "user", "content": DAPO_PREFIX + problem + DAPO_SUFFIX}]`` and
``reward_model = {"ground_truth": answer}``. DAPO's instruction (answer on an ``Answer:`` line) is removed
exactly (prefix/suffix match, not character stripping) because our prompt format adds JustRL's boxed
instruction (``data.prompt_suffix``). The published parquet repeats each problem many times; by default only
the first occurrence of each problem text is kept (``--keep-duplicates`` keeps all rows).

usage:  python launch/prepare_dapo_math.py SRC [OUT]
  SRC  a .parquet / .jsonl file, a directory of them (e.g. a `git clone` or `huggingface-cli download` of the
       dataset), or the hub id BytedTsinghua-SIA/DAPO-Math-17k (downloaded when the hub is reachable)
  OUT  default data/dapo_math_17k.jsonl

Rows without a string problem or ground truth are counted and skipped; the counts are printed. Exit status 2
when nothing usable is found.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def problem_text(row: dict):
    """The bare problem of a DAPO row (or a row that already has ``problem``), None if absent."""
    if isinstance(row.get("problem"), str):
        return row["problem"].strip()
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content")
    if not isinstance(prompt, str):
        return None
    return prompt.removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX).strip()


def answer_text(row: dict):
    rm = row.get("reward_model")
    ans = rm.get("ground_truth") if isinstance(rm, dict) else row.get("answer", row.get("solution"))
    if isinstance(ans, (int, float)) and not isinstance(ans, bool):
        ans = str(ans)
    return ans.strip() if isinstance(ans, str) else None


def read_rows(src: str):
    from stapo_jax.data.prompts import BadRow, read_file, resolve_hf_files

    p = Path(src)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in (".parquet", ".jsonl")) \
        if p.is_dir() else resolve_hf_files(src, "train")
    for f in files:
        for _, rec in read_file(f, f.suffix.lstrip(".")):
            yield None if isinstance(rec, BadRow) else rec


def convert(src: str, out: Path, keep_duplicates: bool = False) -> dict:
    """Write the JSONL; returns counts ``{"rows", "written", "duplicates", "bad"}``."""
    seen, counts = set(), {"rows": 0, "written": 0, "duplicates": 0, "bad": 0}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in read_rows(src):
            counts["rows"] += 1
            prob, ans = (problem_text(row), answer_text(row)) if isinstance(row, dict) else (None, None)
            if not prob or not ans:
                counts["bad"] += 1
                continue
            if not keep_duplicates and prob in seen:
                counts["duplicates"] += 1
                continue
            seen.add(prob)
            fh.write(json.dumps({"problem": prob, "answer": ans, "data_source": "dapo_math_17k",
                                 "index": counts["written"]}, ensure_ascii=False) + "\n")
            counts["written"] += 1
    tmp.replace(out)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out", nargs="?", default="data/dapo_math_17k.jsonl")
    ap.add_argument("--keep-duplicates", action="store_true")
    args = ap.parse_args(argv)
    try:
        counts = convert(args.src, Path(args.out), args.keep_duplicates)
    except (OSError, ValueError) as e:
        print(f"prepare_dapo_math: {e}", file=sys.stderr)
        return 2
    print(f"{args.src}: {counts['rows']} rows, {counts['written']} written to {args.out}, "
          f"{counts['duplicates']} duplicate problems dropped, {counts['bad']} rows without problem/answer")
    return 0 if counts["written"] else 2


if __name__ == "__main__":
    sys.exit(main())
