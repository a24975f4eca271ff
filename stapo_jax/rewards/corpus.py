"""Verdict rates of a reward on a labelled corpus (``tests/data/reward_adversarial.jsonl``, issue 13): false
accepts (a wrong answer paid) and false rejects (a right answer refused), per category."""
from __future__ import annotations

import collections
from typing import Sequence

import numpy as np


def verdict_rates(rows: Sequence[dict], accepted: np.ndarray) -> tuple[dict, str]:
    """Count false accepts and false rejects per category.

    Args:
      rows: corpus cases, each a dict with ``category`` (str) and ``expected`` (bool: the prediction is right).
      accepted: [len(rows)] bool, the reward's verdict per case (e.g. ``scores > 0``).
    Returns:
      ``({category: Counter(n, should_accept, false_accept, false_reject)}, table)``; ``table`` is a printable
      text table with a total row and the false-reject rate (of the cases that should be accepted).
    Raises:
      ValueError: ``accepted`` does not have one verdict per row.

    Source: the false-accept / false-reject audit of issue 13 (project convention, no peer).
    """
    accepted = np.asarray(accepted, bool)
    if accepted.shape != (len(rows),):
        raise ValueError(f"accepted has shape {accepted.shape}, expected ({len(rows)},): one verdict per corpus row")
    per = collections.defaultdict(collections.Counter)
    for r, ok in zip(rows, accepted):
        c = per[r["category"]]
        c["n"] += 1
        c["should_accept"] += bool(r["expected"])
        c["false_accept"] += bool(ok and not r["expected"])
        c["false_reject"] += bool(r["expected"] and not ok)
    lines = [f"{'category':<22}{'n':>4}{'accept':>8}{'false acc':>11}{'false rej':>11}"]
    for cat in sorted(per):
        c = per[cat]
        lines.append(f"{cat:<22}{c['n']:>4}{c['should_accept']:>8}{c['false_accept']:>11}{c['false_reject']:>11}")
    tot = sum(per.values(), collections.Counter())
    rate = tot["false_reject"] / tot["should_accept"] if tot["should_accept"] else 0.0
    lines.append(f"{'total':<22}{tot['n']:>4}{tot['should_accept']:>8}{tot['false_accept']:>11}"
                 f"{tot['false_reject']:>11}  (false-reject rate {rate:.1%})")
    return dict(per), "\n".join(lines)
