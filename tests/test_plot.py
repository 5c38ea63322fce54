"""The run's curves: ``plot_run`` writes a PNG with one panel per kind of metric the run logged (its
size shows the layout), skips panels without data, refuses missing, empty and damaged metrics by file
name, leaves pyplot alone; and ``verl-core plot RUN_DIR`` with its exit codes and messages."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from verl_core.cli import main
from verl_core.errors import VerlCoreError
from verl_core.trainer.metrics import (
    ACTOR_LOSS_KEY,
    CRITIC_LOSS_KEY,
    REWARD_KEY,
    VAL_SCORE_KEY,
    MetricsLogger,
)
from verl_core.trainer.plot import (
    DPI,
    PANEL_SIZE,
    PANELS,
    PLOT_FILE,
    draw_curves,
    plot_run,
    validation_series,
)
from verl_core.trainer.run_files import METRICS_FILE

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EVERY_PANEL = ("training reward", "validation score", "actor loss", "critic loss")


def png_size(path: Path) -> tuple[int, int]:
    """Width and height in pixels, from the PNG's IHDR chunk (which follows the signature)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def panels_px(columns: int, rows: int) -> tuple[int, int]:
    return round(PANEL_SIZE[0] * columns * DPI), round(PANEL_SIZE[1] * rows * DPI)


def write_run(run_dir: Path, steps: int = 6, critic: bool = True) -> None:
    with MetricsLogger(run_dir, [], total_steps=steps, show_progress=False) as logger:
        for step in range(1, steps + 1):
            metrics = {REWARD_KEY: step / steps, ACTOR_LOSS_KEY: 1.0 / step, "perf/step_s": 0.5}
            if critic:
                metrics[CRITIC_LOSS_KEY] = 2.0 / step
            if step % 2 == 0:
                metrics |= {VAL_SCORE_KEY: step / 10, "val/pass@4": step / 8, "val/gsm8k/mean@4": 0.1}
            logger.log(step, metrics)


def test_plot_run_writes_a_png_with_every_panel_in_the_run_folder(tmp_path):
    write_run(tmp_path)
    path = plot_run(tmp_path)
    assert path == tmp_path / PLOT_FILE
    assert png_size(path) == panels_px(columns=2, rows=2)
    assert list(tmp_path.glob("*.partial")) == []


def test_draw_curves_reports_the_panels_drawn_and_skips_those_without_data(tmp_path):
    write_run(tmp_path)
    records = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert draw_curves(records, tmp_path / "all.png") == EVERY_PANEL
    grpo = [{key: value for key, value in record.items() if key != CRITIC_LOSS_KEY} for record in records]
    assert draw_curves(grpo, tmp_path / "grpo.png") == ("training reward", "validation score", "actor loss")
    assert png_size(tmp_path / "grpo.png") == panels_px(columns=2, rows=2)  # the fourth cell left empty
    reward_only = [{"step": r["step"], REWARD_KEY: r[REWARD_KEY]} for r in records]
    assert draw_curves(reward_only, tmp_path / "reward.png") == ("training reward",)
    assert png_size(tmp_path / "reward.png") == panels_px(columns=1, rows=1)


def test_the_validation_panel_draws_the_score_and_the_overall_pass_at_k():
    keys = [VAL_SCORE_KEY, "val/pass@4", "val/pass@1", "val/gsm8k/pass@4", REWARD_KEY]
    assert PANELS[1].matching(keys) == [VAL_SCORE_KEY, "val/pass@1", "val/pass@4"]


def test_null_values_leave_gaps_and_do_not_fail(tmp_path):
    records = [{"step": 1, REWARD_KEY: 0.5}, {"step": 2, REWARD_KEY: None}, {"step": 3, REWARD_KEY: 0.7}]
    assert draw_curves(records, tmp_path / "gaps.png") == ("training reward",)


def test_missing_empty_and_damaged_metrics_are_errors_naming_the_file(tmp_path):
    source = tmp_path / METRICS_FILE
    with pytest.raises(VerlCoreError, match=f"{source}: no such file: {tmp_path} holds no {METRICS_FILE}"):
        plot_run(tmp_path)
    with pytest.raises(VerlCoreError, match="is not a folder"):
        plot_run(tmp_path / "nowhere")
    source.write_text("")
    with pytest.raises(VerlCoreError, match=f"{source}: no metrics in it yet"):
        plot_run(tmp_path)
    source.write_text(json.dumps({"step": 1, "perf/step_s": 0.5}) + "\n")
    with pytest.raises(
        VerlCoreError, match=f"{source}: nothing to plot: no line has any of the keys {REWARD_KEY}"
    ):
        plot_run(tmp_path)
    source.write_text(json.dumps({"step": 1, REWARD_KEY: "high"}) + "\n")
    with pytest.raises(VerlCoreError, match=f"{source}: step 1: {REWARD_KEY} is 'high', not a number"):
        plot_run(tmp_path)
    source.write_text("{}\n")
    with pytest.raises(VerlCoreError, match=f"{METRICS_FILE}:1: not a metrics line"):
        plot_run(tmp_path)
    assert not (tmp_path / PLOT_FILE).exists()


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(VerlCoreError, match=r"needs matplotlib, which cannot be imported .*pip install"):
        plot_run(tmp_path)


def test_drawing_needs_no_display_and_leaves_pyplot_alone(tmp_path):
    write_run(tmp_path)
    code = (
        "import sys\nfrom verl_core.trainer.plot import plot_run\n"
        f"plot_run({str(tmp_path)!r})\nprint('matplotlib.pyplot' in sys.modules)"
    )
    env = {name: value for name, value in os.environ.items() if name not in ("DISPLAY", "MPLBACKEND")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "False"


# -- verl-core plot -------------------------------------------------------------------------------


def test_cli_plot_prints_the_png_path(tmp_path, capsys):
    write_run(tmp_path, critic=False)
    assert main(["plot", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{tmp_path / PLOT_FILE}\n"
    assert captured.err == ""
    assert png_size(tmp_path / PLOT_FILE) == panels_px(columns=2, rows=2)


def test_cli_plot_exits_2_with_the_reason(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"error: {tmp_path / METRICS_FILE}: no such file: {tmp_path} holds no {METRICS_FILE}; give the "
        f"run folder of a training run, where the trainer writes {METRICS_FILE}\n"
    )
    (tmp_path / METRICS_FILE).write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics in it yet" in capsys.readouterr().err


def test_cli_plot_without_run_dir_is_a_usage_error(capsys):
    assert main(["plot"]) == 2
    assert "RUN_DIR" in capsys.readouterr().err


def test_validation_series_pairs_each_score_with_the_training_seconds_before_it():
    records = [
        {"step": 0, VAL_SCORE_KEY: 0.1},
        {"step": 1, "perf/step_s": 0.5},
        {"step": 2, "perf/step_s": 0.25, VAL_SCORE_KEY: 0.2},
        {"step": 3, "perf/step_s": None},  # a step whose time was not a number: it adds nothing
        {"step": 4, "perf/step_s": 1.0, VAL_SCORE_KEY: 0.4},
    ]
    assert validation_series(records, "m") == ([0, 2, 4], [0.1, 0.2, 0.4], [0.0, 0.75, 1.75])
    with pytest.raises(VerlCoreError, match="m: no val/score/mean to compare"):
        validation_series(records[1:2], "m")


def test_cli_plot_of_several_runs_draws_their_comparison(tmp_path, capsys):
    for name in ("a", "b"):
        write_run(tmp_path / name, critic=False)
    out = tmp_path / "both.png"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    assert png_size(out) == panels_px(columns=2, rows=1)
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "nowhere/metrics.jsonl: no such file" in capsys.readouterr().err
