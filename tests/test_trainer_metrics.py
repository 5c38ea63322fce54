"""The trainer's feedback: phase timers (on a fake clock), throughput, peak memory, and the metric
sinks: ``metrics.jsonl`` line by line (NaN as null, resume truncation, damaged files), the console
line, TensorBoard scalars read back from the events file and the error when TensorBoard is missing,
unknown logger names, the progress bar, and ``write_jsonl`` for validation generations."""

from __future__ import annotations

import importlib.util
import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_core.errors import ConfigError, VerlCoreError
from verl_core.trainer import timing
from verl_core.trainer.metrics import (
    ACTOR_LOSS_KEY,
    CRITIC_LOSS_KEY,
    REWARD_KEY,
    VAL_SCORE_KEY,
    MetricsLogger,
    check_loggers,
)
from verl_core.trainer.run_files import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    read_records,
    validation_samples_path,
    write_jsonl,
)
from verl_core.trainer.timing import (
    PEAK_MEMORY_KEY,
    STEP_TIME_KEY,
    TOKENS_PER_S_KEY,
    Timer,
    peak_memory,
    perf_metrics,
    phase,
    tokens_per_s,
)


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def log_steps(run_dir: Path, steps, **kwargs) -> None:
    with MetricsLogger(run_dir, [], total_steps=10, **kwargs) as logger:
        for step in steps:
            logger.log(step, {REWARD_KEY: step / 10})


# -- timers, throughput, memory -------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """``time.perf_counter`` as seen by the metrics module, advanced by hand."""
    now = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def test_phase_records_wall_seconds_under_timing_prefix(clock):
    timings: dict[str, float] = {}
    with phase("generate", timings):
        clock[0] += 2.5
    assert timings == {"timing/generate": 2.5}


def test_repeated_phases_add_up_and_a_raising_block_still_counts(clock):
    timer = Timer()
    for seconds in (1.0, 0.5):
        with timer.phase("update"):
            clock[0] += seconds
    with pytest.raises(RuntimeError), timer.phase("reward"):
        clock[0] += 0.25
        raise RuntimeError("reward function failed")
    with timer.phase("step"):
        clock[0] += 4.0
    assert timer.metrics() == {"timing/update": 1.5, "timing/reward": 0.25, "timing/step": 4.0}
    timer.metrics()["timing/update"] = 0.0  # a copy
    assert timer.timings["timing/update"] == 1.5
    timer.reset()
    assert timer.metrics() == {}


def test_throughput():
    assert tokens_per_s(3000, 1.5) == 2000.0
    assert tokens_per_s(0, 0.0) == 0.0
    assert tokens_per_s(10, 0.0) == 0.0  # nothing measured


def test_peak_memory_without_cuda_is_the_peak_rss_in_mib():
    assert not torch.cuda.is_initialized()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak = peak_memory()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert before <= peak <= after
    assert set(perf_metrics(100, 2.0)) == {TOKENS_PER_S_KEY, PEAK_MEMORY_KEY}
    assert perf_metrics(100, 2.0)[TOKENS_PER_S_KEY] == 50.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_with_cuda_is_max_memory_allocated():
    block = torch.empty(64 * timing.MIB, dtype=torch.uint8, device="cuda")
    assert peak_memory() == torch.cuda.max_memory_allocated() / timing.MIB >= 64
    del block


def test_importing_the_module_loads_neither_torch_nor_tqdm():
    code = (
        "import sys, verl_core.trainer.metrics, verl_core.trainer.plot\n"
        "print(sorted(m for m in ('torch', 'tqdm', 'matplotlib', 'cattrs') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# -- metrics.jsonl --------------------------------------------------------------------------------


def test_one_json_object_per_step_flushed_as_it_is_logged(tmp_path):
    logger = MetricsLogger(tmp_path / "run", [], total_steps=10)
    logger.log(1, {REWARD_KEY: 0.5, "response_length/mean": 12, "reward/num_errors": 0})
    assert lines(tmp_path / "run") == [
        {"step": 1, REWARD_KEY: 0.5, "response_length/mean": 12, "reward/num_errors": 0}
    ]
    logger.log(2, {REWARD_KEY: torch.tensor(0.75), "ok": True, "n": torch.tensor(3)})
    assert lines(tmp_path / "run")[1] == {"step": 2, REWARD_KEY: 0.75, "ok": 1.0, "n": 3}
    logger.close()
    logger.close()  # twice is fine
    with pytest.raises(VerlCoreError, match="closed"):
        logger.log(3, {})


def test_nan_and_inf_are_written_as_null_with_a_note(tmp_path, capsys):
    with MetricsLogger(tmp_path, [], total_steps=3) as logger:
        logger.log(1, {ACTOR_LOSS_KEY: math.nan, "grad_norm": math.inf, REWARD_KEY: 1.0})
    assert lines(tmp_path) == [{"step": 1, ACTOR_LOSS_KEY: None, "grad_norm": None, REWARD_KEY: 1.0}]
    err = capsys.readouterr().err
    assert (
        f"note: step 1: {ACTOR_LOSS_KEY}=nan, grad_norm=inf: written as null in {tmp_path / METRICS_FILE}"
        in err
    )


def test_values_that_are_not_numbers_are_refused_by_name(tmp_path):
    with MetricsLogger(tmp_path, [], total_steps=3) as logger:
        with pytest.raises(TypeError, match="step 1: metric 'note' is str 'hello', not a number"):
            logger.log(1, {"note": "hello"})
        with pytest.raises(TypeError, match="metric 'scores' holds more than one number"):
            logger.log(1, {"scores": torch.ones(3)})
        with pytest.raises(ValueError, match="'step' is the line's own key"):
            logger.log(1, {"step": 1})


def test_a_resumed_run_drops_the_steps_after_its_checkpoint(tmp_path):
    log_steps(tmp_path, range(1, 6))
    log_steps(tmp_path, [4, 5], start_step=3)  # resumed from the checkpoint of step 3
    assert [line["step"] for line in lines(tmp_path)] == [1, 2, 3, 4, 5]
    assert lines(tmp_path)[3] == {"step": 4, REWARD_KEY: 0.4}


def test_a_fresh_run_starts_the_file_over(tmp_path):
    log_steps(tmp_path, [0, 1, 2])
    log_steps(tmp_path, [0, 1])
    assert [line["step"] for line in lines(tmp_path)] == [0, 1]


def test_truncate_after_keeps_earlier_steps_and_logging_continues(tmp_path):
    with MetricsLogger(tmp_path, [], total_steps=10) as logger:
        for step in (1, 2, 3):
            logger.log(step, {REWARD_KEY: 0.0})
        logger.truncate_after(1)
        logger.log(2, {REWARD_KEY: 1.0})
    assert lines(tmp_path) == [{"step": 1, REWARD_KEY: 0.0}, {"step": 2, REWARD_KEY: 1.0}]
    assert list(tmp_path.glob("*.partial")) == []


def test_a_last_line_cut_short_by_a_crash_is_dropped(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "a": 1}\n{"step": 2, "a"')
    log_steps(tmp_path, [2], start_step=1)
    assert lines(tmp_path) == [{"step": 1, "a": 1}, {"step": 2, REWARD_KEY: 0.2}]


@pytest.mark.parametrize(
    "damaged, problem",
    [
        ('{"step": 1}\nnot json\n{"step": 2}\n', "not JSON"),
        ('{"step": 1}\n{"stp": 2}\n', "not a metrics line"),
    ],
)
def test_a_damaged_line_is_an_error_naming_the_file_and_line(tmp_path, damaged, problem):
    (tmp_path / METRICS_FILE).write_text(damaged)
    with pytest.raises(VerlCoreError, match=f"{METRICS_FILE}:2: {problem}.*repair or delete that line"):
        MetricsLogger(tmp_path, [], total_steps=3, start_step=1)
    assert (tmp_path / METRICS_FILE).read_text() == damaged  # left as it was
    with pytest.raises(VerlCoreError, match=f"{METRICS_FILE}:2"):
        read_records(tmp_path / METRICS_FILE)


# -- the console line and the progress bar --------------------------------------------------------


def test_console_line_shows_the_key_metrics_and_counts_the_rest(tmp_path, capsys):
    step_metrics = {
        "zeta": 1.0,
        TOKENS_PER_S_KEY: 12345.6,
        STEP_TIME_KEY: 3.21,
        CRITIC_LOSS_KEY: 2.0,
        "alpha": 7,
        ACTOR_LOSS_KEY: 0.012345,
        VAL_SCORE_KEY: 0.5,
        REWARD_KEY: 0.25,
    }
    with MetricsLogger(tmp_path, ["console"], total_steps=100) as logger:
        logger.log(3, step_metrics)
    out = capsys.readouterr().out
    assert out == (
        "step 3/100 reward/mean=0.25 val/score/mean=0.5 actor/loss=0.01235 critic/loss=2 "
        "perf/tokens_per_s=12346 perf/step_s=3.21 (+2 more in metrics.jsonl)\n"
    )


def test_without_console_or_progress_nothing_is_printed(tmp_path, capsys):
    log_steps(tmp_path, [1, 2], show_progress=False)
    assert capsys.readouterr() == ("", "")  # stderr is no terminal here: no progress bar either


def test_forced_progress_bar_shows_step_total_reward_and_throughput(tmp_path, capsys):
    with MetricsLogger(tmp_path, ["console"], total_steps=10, force_progress=True, start_step=2) as logger:
        logger.log(3, {REWARD_KEY: 0.5, TOKENS_PER_S_KEY: 2048.0})
    captured = capsys.readouterr()
    assert "3/10" in captured.err
    assert "reward=0.5 tok/s=2048" in captured.err
    assert "step 3/10 reward/mean=0.5" in captured.out  # the console line, above the bar


def test_unknown_logger_names_are_errors_at_trainer_logger(tmp_path):
    with pytest.raises(ConfigError) as raised:
        MetricsLogger(tmp_path, ["console", "consol", "wandbb"], total_steps=3)
    assert [path for path, _ in raised.value.errors] == ["trainer.logger", "trainer.logger"]
    message = str(raised.value)
    assert "Unknown metric sink 'consol' (from trainer.logger) (did you mean 'console'?)" in message
    assert "Unknown metric sink 'wandbb' (from trainer.logger) (did you mean 'wandb'?)" in message
    assert "Installed metric sinks: console (verl-core" in message
    assert "metrics.jsonl in the run folder is written in any case" in message
    assert not (tmp_path / METRICS_FILE).exists()
    assert check_loggers("console") == ("console",)
    assert check_loggers([]) == ()


# -- TensorBoard ----------------------------------------------------------------------------------


def test_tensorboard_events_hold_every_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, ["tensorboard"], total_steps=3) as logger:
        logger.log(1, {REWARD_KEY: 0.25, ACTOR_LOSS_KEY: 1.5})
        logger.log(2, {REWARD_KEY: 0.75})
    events = list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    accumulator.Reload()
    assert set(accumulator.Tags()["scalars"]) == {REWARD_KEY, ACTOR_LOSS_KEY}
    assert [(e.step, e.value) for e in accumulator.Scalars(REWARD_KEY)] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in accumulator.Scalars(ACTOR_LOSS_KEY)] == [(1, 1.5)]


def test_missing_tensorboard_is_a_clear_error_before_anything_is_written(tmp_path, monkeypatch):
    if importlib.util.find_spec("tensorboard") is None:  # the registry refuses it, naming the extra
        with pytest.raises(
            ConfigError, match=r'needs the module .tensorboard.*pip install "verl-core\[tensorboard\]"'
        ):
            MetricsLogger(tmp_path / "run", ["console", "tensorboard"], total_steps=3)
        assert not (tmp_path / "run").exists()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # ``import`` raises ImportError
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())  # installed, broken
    with pytest.raises(VerlCoreError) as raised:
        MetricsLogger(tmp_path / "run", ["console", "tensorboard"], total_steps=3, registry=fresh_registry())
    message = str(raised.value)
    assert "trainer.logger names 'tensorboard', but TensorBoard cannot be imported" in message
    assert "pip install tensorboard" in message
    assert "remove 'tensorboard' from trainer.logger" in message
    assert isinstance(raised.value.__cause__, ImportError)
    assert not (tmp_path / "run").exists()


def fresh_registry():
    from verl_core.plugins.registry import Registry

    return Registry.from_plugins()


# -- validation generations -----------------------------------------------------------------------


def test_write_jsonl_keeps_text_readable_and_non_finite_numbers_null(tmp_path):
    path = validation_samples_path(tmp_path, 20)
    assert path == tmp_path / "validation" / "step_20.jsonl"
    records = [
        {"prompt": "2+2=?", "response": "4 ✓", "score": 1.0, "data_source": "arith"},
        {"prompt": "x", "response": "", "score": math.nan, "extra": {"values": [1.0, -math.inf]}},
    ]
    assert write_jsonl(path, records) == path
    text = path.read_text(encoding="utf-8")
    assert "4 ✓" in text
    assert [json.loads(line) for line in text.splitlines()] == [
        records[0],
        {"prompt": "x", "response": "", "score": None, "extra": {"values": [1.0, None]}},
    ]
    write_jsonl(path, records[:1])  # replaced, not appended
    assert len(path.read_text().splitlines()) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_20.jsonl"]


def test_without_a_terminal_or_console_lines_a_plain_progress_line_every_tenth(tmp_path, capsys) -> None:
    """Under a pipe (nox, a CI log) with ``trainer.logger: []`` a run would say nothing for its length."""
    with MetricsLogger(tmp_path, [], total_steps=20) as logger:
        for step in range(1, 21):
            logger.log(step, {REWARD_KEY: step / 20})
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verl-core: step ")]
    assert [line.split()[2] for line in lines] == [f"{step}/20" for step in range(2, 21, 2)]
    assert "(100%)" in lines[-1] and "reward/mean=1" in lines[-1] and "s left" in lines[-1]
    with MetricsLogger(tmp_path, ["console"], total_steps=20) as logger:  # console lines say it already
        logger.log(1, {REWARD_KEY: 0.5})
    assert "verl-core: step" not in capsys.readouterr().err


def test_a_ctrl_c_while_an_inline_sink_writes_stops_the_run_and_a_failure_does_not(tmp_path):
    """A sink's own failure is warned about and ends the sink only; a KeyboardInterrupt that lands while
    an inline sink (the console) writes is the user's, and reaches the trainer."""
    from verl_core.trainer.sinks import BaseMetricSink, SinkChannel, SinkRun

    class Raising(BaseMetricSink):
        raised: BaseException = RuntimeError("disk full")

        def __init__(self, run):
            self.where = "here"

        def log_metrics(self, step, metrics):
            raise self.raised

    run = SinkRun(tmp_path, "p", "n", None, {}, 0, 3)
    channel = SinkChannel("raising", Raising, run, background=False)
    channel.send("log_metrics", 1, {"a": 1.0})
    assert channel.failed
    Raising.raised = KeyboardInterrupt()
    channel = SinkChannel("raising", Raising, run, background=False)
    with pytest.raises(KeyboardInterrupt):
        channel.send("log_metrics", 1, {"a": 1.0})
