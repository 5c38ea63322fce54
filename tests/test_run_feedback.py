"""A run says what it does and survives the everyday mistakes: the start-up phases, which checkpoint it
resumed from, settings a resume cannot apply, a damaged newest checkpoint (any piece of it), a finished
run started again, a failing reward under ``on_error=zero``, SFT with a decaying rate over
``total_training_steps``, and the end-of-run summary; on a terminal, lines above the progress bar and
an export readable as the user's other files are. In process, on the demo's tiny model (each test
failed on the code before)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest
import torch
from fixtures.demo import build_small_demo, run_overrides

from verl_core.cli import main
from verl_core.config import load_config
from verl_core.errors import NothingToTrain
from verl_core.toolkit.checkpoint import MARKER_FILE
from verl_core.trainer.checkpoints import checkpoint_problems
from verl_core.trainer.rl import RLTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_small_demo(tmp_path_factory.mktemp("demo"), sft_size=32)


@pytest.fixture(scope="module")
def finished_run(demo, tmp_path_factory):
    """``verl-core train``: two RL steps with a checkpoint after each; ``(run folder, overrides, what
    it printed on stderr)``."""
    run = tmp_path_factory.mktemp("run")
    overrides = run_overrides(
        demo, run, **{"trainer.save_freq": 1, "trainer.test_freq": 2, "trainer.val_n": 2}
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", *overrides]) == 0
    return run, overrides, err.getvalue()


def rl_trainer(overrides: list[str], **changes) -> RLTrainer:
    changed = [*overrides, *(f"{key}={value}" for key, value in changes.items())]
    return RLTrainer.from_config(load_config([], changed), show_progress=False)


def test_a_run_talks_from_start_to_end(finished_run) -> None:
    _, _, err = finished_run
    for line in (
        "verl-core: loading the tokenizer and the datasets ...",
        "verl-core: starting the actor (in process: engines and rollout): done in",
        "verl-core: sample at step 0: ",  # validation generations on the console
        "verl-core: done: 2 step(s) in",
        "verl-core:   val/score/mean: ",
        "verl-core:   reward/mean: ",
        "verl-core:   checkpoints: ",
        "verl-core:   curves: ",
    ):
        assert line in err, (line, err)


def test_starting_a_finished_run_again_trains_nothing_and_starts_nothing(
    finished_run, capsys, monkeypatch
) -> None:
    from verl_core.trainer import build

    _, overrides, _ = finished_run
    monkeypatch.setattr(build, "build_roles", lambda *a, **k: pytest.fail("workers started for nothing"))
    assert main(["train", *overrides]) == 0
    assert "nothing to train: the checkpoint" in capsys.readouterr().err
    with pytest.raises(NothingToTrain, match="at step 2 of 2"):
        rl_trainer(overrides)


def test_a_resume_says_where_from_and_warns_about_settings_it_cannot_apply(finished_run, capsys) -> None:
    _, overrides, _ = finished_run
    trainer = rl_trainer(overrides, **{"trainer.total_training_steps": 3, "actor.engine.optim.lr": 0.5})
    try:
        assert trainer.resume() == 2
    finally:
        trainer.shutdown()
    err = capsys.readouterr().err
    assert "actor.engine.optim.lr: 0.001 in the checkpoint, 0.5 now" in err, err
    assert trainer.resumed_from.name == "global_step_2"


def test_a_damaged_newest_checkpoint_is_skipped_naming_the_file(finished_run, tmp_path, capsys) -> None:
    run, overrides, _ = finished_run
    checkpoints = shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    newest = checkpoints / "global_step_2" / "actor" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # a partial copy
    trainer = rl_trainer(
        overrides, **{"trainer.total_training_steps": 3, "trainer.checkpoint_dir": checkpoints}
    )
    try:
        assert trainer.resume() == 1
    finally:
        trainer.shutdown()
    err = capsys.readouterr().err
    assert (
        f"skipping the damaged checkpoint {newest.parents[1]} ({newest} is not a whole torch file" in err
    ), err
    assert trainer.resumed_from.name == "global_step_1"


def test_every_piece_of_a_checkpoint_a_resume_needs_is_checked(finished_run, tmp_path) -> None:
    """Each file of a real checkpoint, deleted or cut to half, is named by ``checkpoint_problems``:
    the trainer's state, the engine's marker and optimiser state as much as the weights. (Deleting
    the checkpoint's own marker unmarks it: it is no resume candidate then.)"""
    run, _, _ = finished_run
    source = run / "checkpoints" / "global_step_2"
    assert checkpoint_problems(source) == []
    files = sorted(path.relative_to(source) for path in source.rglob("*") if path.is_file())
    assert {Path("trainer_state.json"), Path("actor", MARKER_FILE), Path("actor", "optimizer.pt")} <= set(
        files
    )
    for number, relative in enumerate(files):
        for damage in ("deleted", "cut"):
            if damage == "deleted" and relative == Path(MARKER_FILE):
                continue
            copy = shutil.copytree(source, tmp_path / f"{number}-{damage}")
            if damage == "deleted":
                (copy / relative).unlink()
            else:
                (copy / relative).write_bytes(
                    (source / relative).read_bytes()[: (source / relative).stat().st_size // 2]
                )
            problems = checkpoint_problems(copy)
            assert any(problem.startswith(f"{copy / relative} ") for problem in problems), (
                relative,
                damage,
                problems,
            )


def test_a_newest_checkpoint_without_its_engine_marker_is_skipped_before_start(
    finished_run, tmp_path, capsys
) -> None:
    """Skipped with a warning naming the file, as a cut shard is, not loaded and failed on the ranks."""
    run, overrides, _ = finished_run
    folder = shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    marker = folder / "global_step_2" / "actor" / MARKER_FILE
    marker.unlink()
    trainer = rl_trainer(overrides, **{"trainer.total_training_steps": 3, "trainer.checkpoint_dir": folder})
    try:
        assert trainer.resume() == 1
    finally:
        trainer.shutdown()
    assert (
        f"skipping the damaged checkpoint {marker.parents[1]} ({marker} is missing" in capsys.readouterr().err
    )
    assert trainer.resumed_from.name == "global_step_1"


def test_resuming_by_path_from_a_damaged_checkpoint_is_an_error_before_start(
    finished_run, tmp_path, capsys, monkeypatch
) -> None:
    from verl_core.trainer import build

    run, overrides, _ = finished_run
    damaged = shutil.copytree(run / "checkpoints" / "global_step_2", tmp_path / "global_step_2")
    (damaged / "trainer_state.json").unlink()
    monkeypatch.setattr(
        build, "build_roles", lambda *a, **k: pytest.fail("workers started for a damaged checkpoint")
    )
    changes = {
        "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": damaged,
        "trainer.checkpoint_dir": tmp_path / "new",
        "trainer.total_training_steps": 3,
    }
    assert main(["train", *overrides, *(f"{key}={value}" for key, value in changes.items())]) == 2
    err = capsys.readouterr().err
    assert (
        f"trainer.resume_from_path: damaged checkpoint at {damaged}: {damaged / 'trainer_state.json'} is missing; "
        "resume from another checkpoint"
    ) in err, err


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr is in an interactive shell: a run shows its
    progress bar on it."""

    def isatty(self) -> bool:
        return True


def screen(text: str) -> list[str]:
    r"""The lines a terminal shows for ``text``: ``\r`` goes back to the start of the line, later
    characters overwrite earlier ones, ``\n`` ends the line (one bar needs no other control)."""
    lines, line, column = [], [], 0
    for char in text:
        if char == "\n":
            lines.append("".join(line).rstrip())
            line, column = [], 0
        elif char == "\r":
            column = 0
        else:
            line[column : column + 1] = [char]
            column += 1
    return [*lines, "".join(line).rstrip()]


@pytest.fixture(scope="module")
def run_on_a_terminal(demo, tmp_path_factory):
    """``verl-core train`` with its stderr on a terminal: one step, validated before and after,
    exported; ``(run folder, what stderr got)``."""
    run = tmp_path_factory.mktemp("terminal")
    overrides = run_overrides(
        demo,
        run,
        **{
            "trainer.total_training_steps": 1,
            "trainer.test_freq": 1,
            "trainer.val_n": 2,
            "trainer.save_hf_model": "true",
        },
    )
    terminal = Terminal()
    with contextlib.redirect_stderr(terminal):
        assert main(["train", *overrides]) == 0, terminal.getvalue()
    return run / "run", terminal.getvalue()


def test_validation_samples_are_printed_above_the_progress_bar(run_on_a_terminal) -> None:
    _, output = run_on_a_terminal
    lines = screen(output)
    assert any("%|" in line and "1/1" in line for line in lines), lines  # the bar showed
    samples = [line for line in lines if "verl-core: sample at step" in line]
    assert len(samples) == 4, lines  # two at step 0, two at step 1
    garbled = [line for line in samples if not line.startswith("verl-core: sample at step")]
    assert not garbled, garbled


def test_the_export_has_the_mode_the_umask_gives_every_other_file(run_on_a_terminal) -> None:
    run_dir, _ = run_on_a_terminal
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in (run_dir / "hf_model").iterdir()}
    assert "model.safetensors" in modes and modes == dict.fromkeys(modes, oct(0o666 & ~umask))


def test_a_failing_reward_under_on_error_zero_is_shown_once(demo, tmp_path, capsys) -> None:
    reward = tmp_path / "reward.py"
    reward.write_text("def score(prompt, response, extra):\n    raise ValueError('no answer found')\n")
    overrides = run_overrides(
        demo,
        tmp_path,
        **{"reward.function": f"{reward}:score", "reward.on_error": "zero", "trainer.test_freq": 0},
    )
    assert main(["train", *overrides]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "reward function failed" in line]
    assert len(warnings) == 1 and "ValueError: no answer found" in warnings[0], warnings


def test_sft_with_a_decaying_rate_over_total_training_steps(demo, tmp_path, capsys) -> None:
    overrides = run_overrides(
        demo,
        tmp_path,
        **{
            "data.train_files": f"[{demo.sft}]",
            "data.val_files": "[]",
            "data.train_batch_size": 8,
            "trainer.total_training_steps": 3,
            "actor.engine.optim.lr_scheduler": "cosine",
            "actor.engine.optim.lr_warmup_steps": 1,
        },
    )
    assert main(["sft", *overrides]) == 0, capsys.readouterr().err
    assert "done: 3 step(s)" in capsys.readouterr().err


def test_reward_failures_of_every_generation_round_are_counted(demo, tmp_path, monkeypatch) -> None:
    """Under dynamic sampling (DAPO's filter_groups) a step may generate several rounds: its
    ``reward/errors`` counted only the last one's."""
    reward = tmp_path / "reward.py"
    reward.write_text(
        "calls = 0\n"
        "def score(prompt, response, extra):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls <= 16:  # the whole first round (4 prompts x 4 responses): all 0, every group dropped\n"
        "        raise ValueError('not yet')\n"
        "    return len(response) % 3 / 2\n"
    )
    overrides = run_overrides(
        demo,
        tmp_path,
        **{
            "reward.function": f"{reward}:score",
            "reward.on_error": "zero",
            "algorithm.filter_groups.enable": "true",
            "trainer.total_training_steps": 1,
            "trainer.test_freq": 0,
        },
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        metrics = trainer.train_step(1)
    finally:
        trainer.shutdown()
    assert metrics["training/generation_rounds"] >= 2
    assert metrics["reward/errors"] == 16.0
