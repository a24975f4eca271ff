"""Plots (issue 12): held-out accuracy starts with the before-RL point at step 0; ``stapo-jax plot A B`` /
``stapo-jax compare A B`` overlay runs, one figure per metric with one line per run, labelled by run name and
recipe."""
import json

import pytest
import yaml

from stapo_jax.tools.cli import main as cli_main
from stapo_jax.train.plots import CURVES, compare_runs, plot_run, run_series


def make_run(path, recipe, rows, summary=None):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"recipe": recipe}}))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def rows_for(scale, clip=True):
    rows = []
    for s in range(1, 5):
        r = {"step": s, "reward/mean": scale * s, "entropy": 1.0 / s, "s2t/masked_frac": 1e-3 * s,
             "response_length/mean": 4.0 + s, "acc/mean": scale * s}
        if clip:
            r.update({"pg_clipfrac": 0.01 * s, "pg_clipfrac_lower": 0.0})
        if s % 2 == 0:
            r["val/acc"] = 0.2 + scale * s
        rows.append(r)
    return rows


def test_heldout_accuracy_starts_with_the_before_rl_point(tmp_path):
    run = make_run(tmp_path / "r", "stapo", rows_for(0.1),
                   {"heldout_acc_before": 0.175, "heldout_acc_after": 0.61, "final_step": 5})
    assert run_series(str(run))["val/acc"] == [(0, 0.175), (2, pytest.approx(0.4)), (4, pytest.approx(0.6)),
                                               (5, 0.61)]
    # the trainer passes its in-memory summary (written to summary.json only after the plots)
    bare = make_run(tmp_path / "bare", "stapo", rows_for(0.1))
    assert run_series(str(bare), {"heldout_acc_before": 0.1})["val/acc"][0] == (0, 0.1)
    written = plot_run(str(run))
    assert str(run / "plots" / "val_acc.png") in written and str(run / "plots" / "pg_clipfrac.png") in written


def test_compare_overlays_one_line_per_run_per_metric(tmp_path, capsys):
    a = make_run(tmp_path / "runs" / "tiny_stapo", "stapo", rows_for(0.1), {"heldout_acc_before": 0.2})
    b = make_run(tmp_path / "runs" / "tiny_grpo", "grpo", rows_for(0.05, clip=False), {"heldout_acc_before": 0.2})
    assert cli_main(["compare", str(a), str(b)]) == 0
    out = tmp_path / "runs" / "compare"                      # default: beside the runs
    printed = capsys.readouterr().out.split()
    lines = json.loads((out / "comparison.json").read_text())
    assert [k for k, _ in CURVES if k in lines] == list(lines) == [k for k, _ in CURVES]
    for key, runs in lines.items():
        assert (out / (key.replace("/", "_") + ".png")).stat().st_size > 1000
        assert str(out / (key.replace("/", "_") + ".png")) in printed
        want = ["tiny_stapo (stapo)", "tiny_grpo (grpo)"] if not key.startswith("pg_clip") else ["tiny_stapo (stapo)"]
        assert [r["label"] for r in runs] == want, key
    assert lines["reward/mean"][1]["steps"] == [1, 2, 3, 4]
    assert lines["reward/mean"][1]["values"] == pytest.approx([0.05, 0.1, 0.15, 0.2])
    assert lines["val/acc"][0]["steps"] == [0, 2, 4] and lines["val/acc"][0]["values"][0] == 0.2
    assert (out / "comparison.png").stat().st_size > 1000
    # `plot` with several runs is the same command; labels and the output directory can be given
    assert cli_main(["plot", str(a), str(b), "--out", str(tmp_path / "o"), "--labels", "S,G"]) == 0
    assert [r["label"] for r in json.loads((tmp_path / "o" / "comparison.json").read_text())["entropy"]] == ["S", "G"]


def test_compare_errors(tmp_path):
    a = make_run(tmp_path / "x" / "run", "stapo", rows_for(0.1))
    b = make_run(tmp_path / "y" / "run", "stapo", rows_for(0.1))
    with pytest.raises(ValueError, match="at least two runs"):
        compare_runs([str(a)])
    with pytest.raises(ValueError, match="share a label"):
        compare_runs([str(a), str(b)])
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        compare_runs([str(a), str(b)], labels=["one"])
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        compare_runs([str(a), str(tmp_path / "missing")], labels=["a", "m"])


def test_compare_config_pair_is_the_main_job_with_two_recipes():
    """configs/compare/tiny_{stapo,grpo}.yaml: the main job (configs/tiny_cpu.yaml) with only the recipe and
    the run directory changed, so the comparison isolates the algorithm."""
    from pathlib import Path

    from stapo_jax.config.schema import load_config

    repo = Path(__file__).resolve().parents[2]
    main = load_config(repo / "configs" / "tiny_cpu.yaml").to_dict()
    for recipe in ("stapo", "grpo"):
        cfg = load_config(repo / "configs" / "compare" / f"tiny_{recipe}.yaml")
        assert cfg.algorithm.recipe == recipe and cfg.trainer.run_dir == f"runs/compare/tiny_{recipe}"
        want = load_config(repo / "configs" / "tiny_cpu.yaml",
                           [f"algorithm.recipe={recipe}", f"trainer.run_dir=runs/compare/tiny_{recipe}"]).to_dict()
        assert cfg.to_dict() == want
    assert main["algorithm"]["recipe"] == "stapo"
    grpo = load_config(repo / "configs" / "compare" / "tiny_grpo.yaml")
    assert not grpo.s2t.enabled and grpo.actor.clip_ratio_high == grpo.actor.clip_ratio_low


def _axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    return plt, fig, ax


def test_every_panel_has_a_y_unit_and_accuracy_marks_before_rl():
    from stapo_jax.train.plots import BEFORE_RL, Y_LABELS, draw_panel

    assert set(Y_LABELS) == {k for k, _ in CURVES}
    for key, title in CURVES:
        plt, fig, ax = _axes()
        draw_panel(ax, key, title, [(None, [0, 2, 4], [0.2, 0.3, 0.4])])
        assert ax.get_ylabel() == Y_LABELS[key] and "(" in ax.get_ylabel(), key   # a unit in brackets
        marks = [t.get_text() for t in ax.texts]
        assert marks == ([BEFORE_RL] if key == "val/acc" else []), key
        if key == "val/acc":
            assert ax.texts[0].xy == (0, 0.2) and "0: before RL" in ax.get_xlabel()
        plt.close(fig)
    plt, fig, ax = _axes()
    draw_panel(ax, "val/acc", "acc", [(None, [2, 4], [0.3, 0.4])])  # no before-RL point: no mark
    assert not ax.texts
    plt.close(fig)


def test_a_comparison_keeps_every_run_visible():
    """Two runs with equal values (one line used to hide the other): distinct markers and line styles, hollow
    markers of decreasing size, the later run drawn on top, and a legend naming both."""
    from stapo_jax.train.plots import draw_panel

    plt, fig, ax = _axes()
    same = ([0, 1, 2], [0.2, 0.3, 0.4])
    draw_panel(ax, "val/acc", "acc", [("a (stapo)", *same), ("b (grpo)", *same), ("c (dapo)", *same)])
    a, b, c = ax.get_lines()
    assert len({ln.get_marker() for ln in (a, b, c)}) == 3 and len({ln.get_linestyle() for ln in (a, b, c)}) == 3
    assert a.get_markersize() > b.get_markersize() > c.get_markersize() and a.get_markerfacecolor() == "none"
    assert a.get_zorder() < b.get_zorder() < c.get_zorder()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a (stapo)", "b (grpo)", "c (dapo)"]
    plt.close(fig)


@pytest.mark.parametrize("ys", [[0.2, 0.3, 0.4], [0.5, 0.3, 0.25], [0.3, 0.3, 0.3]])
def test_the_before_rl_label_stays_inside_the_axes(ys):
    """Issue 43: the "before RL" label sat 12 points below the lowest point, across the x axis and its tick labels.
    Rendered: the label's box lies within the axes' box, whichever way the curve goes."""
    from stapo_jax.train.plots import draw_panel

    plt, fig, ax = _axes()
    draw_panel(ax, "val/acc", "held-out", [(None, [0, 2, 4], ys)])
    fig.canvas.draw()
    box, axes_box = ax.texts[0].get_window_extent(), ax.get_window_extent()
    assert axes_box.y0 < box.y0 and box.y1 < axes_box.y1, (box, axes_box)
    assert axes_box.x0 < box.x0 and box.x1 < axes_box.x1, (box, axes_box)
    plt.close(fig)
