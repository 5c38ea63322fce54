"""A real ``verl-core train`` stopped the everyday ways. Under a local Ray cluster: Ctrl-C (SIGINT to
the terminal's process group) and SIGTERM (a scheduler stopping the job's processes). Each ends in a
few seconds with one line saying where the run stopped and how to resume it, exit 130 or 143, no
traceback, no Ray stack dump and no process left behind. The Ctrl-C run also checks that nothing of
a local run listens on, connects to or looks up anything but loopback: every process of the run's
session is listed with its listening sockets, and every Python process of the run records its
socket calls (a ``sitecustomize`` module on ``PYTHONPATH``, which Ray's processes inherit).

In process (the worker faults are not Ray's): Ctrl-C under ``nox``, which kills the run 0.5 s after
forwarding it (the stop line comes before the workers' release); ``kill -9`` while the final export
is written (the same command then writes it, and the curves) with a second run refused meanwhile
(its folders are held) and let in once the first is dead; a disk that fills at a checkpoint (a real
``ENOSPC``, on a small tmpfs mounted in a mount namespace of the run's own)."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import safetensors.torch
import torch
from fixtures.demo import build_small_demo, run_overrides
from fixtures.sockets import SOCKET_SPY

from verl_core.cli import main
from verl_core.trainer import checkpoints
from verl_core.trainer.run_files import exported_step
from verl_core.trainer.run_lock import LOCK_FILE

#: ``verl-core`` with a test's hooks, each switched on by its environment variable.
#: VERL_TEST_HOLD_EXPORT=<file>: the Hugging Face export stops once its weights are in the staging
#: folder, writes <file> and waits to be killed. VERL_TEST_ENDLESS_RELEASE=1: the release of the
#: workers after a stop never ends, as when ``nox`` kills the run (0.5 s after forwarding Ctrl-C)
#: before Ray's workers are released.
HOOKED_CLI = r"""
import os, sys, threading

from verl_core import cli
from verl_core.toolkit import export as hf_export

if os.environ.get("VERL_TEST_HOLD_EXPORT"):
    _export = hf_export.export_hf_model

    def _held(model, path, *args, also_write=None, **kwargs):
        def hold(staging):
            if also_write is not None:
                also_write(staging)
            with open(os.environ["VERL_TEST_HOLD_EXPORT"], "w") as note:
                note.write(str(staging))
            threading.Event().wait()

        return _export(model, path, *args, also_write=hold, **kwargs)

    hf_export.export_hf_model = _held
if os.environ.get("VERL_TEST_ENDLESS_RELEASE"):
    cli._release = lambda trainer: threading.Event().wait()
if os.environ.get("VERL_TEST_ENDLESS_EXIT"):  # a thread the interpreter's exit waits for, forever
    threading.Thread(target=threading.Event().wait, name="never-ends").start()
if os.environ.get("VERL_TEST_STOP_DEADLINE_S"):
    cli.STOP_DEADLINE_S = float(os.environ["VERL_TEST_STOP_DEADLINE_S"])
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_small_demo(tmp_path_factory.mktemp("demo"))


class Run:
    """``verl-core train`` in a session of its own (so that a signal can go to its process group, as
    a terminal's Ctrl-C does), its output in files, its socket calls recorded; with ``hooks``
    (environment variables of ``HOOKED_CLI``), the hooked command."""

    def __init__(self, demo, tmp_path: Path, hooks: dict[str, str] | None = None, **changes):
        self.tmp_path = tmp_path
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        self.socket_log = tmp_path / "sockets.jsonl"
        spy = tmp_path / "spy"
        spy.mkdir()
        (spy / "sitecustomize.py").write_text(SOCKET_SPY)
        self.overrides = run_overrides(
            demo,
            tmp_path,
            **{
                "trainer.workers": "ray",
                "trainer.total_training_steps": 500,
                "trainer.save_freq": 1,
                "trainer.logger": "[console]",
                **changes,
            },
        )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(spy), os.environ.get("PYTHONPATH", "")]),
            "VERL_TEST_SOCKET_LOG": str(self.socket_log),
            **(hooks or {}),
        }
        command = ["-m", "verl_core"]
        if hooks:
            (spy / "hooked_cli.py").write_text(HOOKED_CLI)
            command = [str(spy / "hooked_cli.py")]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, *command, "train", *self.overrides],
                stdout=out,
                stderr=err,
                env=env,
                cwd=tmp_path,
                start_new_session=True,
            )

    def wait_for_step(self, step: int, timeout: float = 400) -> None:
        self.wait_for(
            lambda: re.search(rf"^step {step}/", self.out.read_text(), re.MULTILINE), f"step {step}"
        )

    def wait_for(self, seen: Any, what: str, timeout: float = 400) -> None:
        """Until ``seen()`` is true, while the run lives (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while not seen():
            assert self.process.poll() is None, f"the run ended early: {self.err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s: {self.err.read_text()[-3000:]}"
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        """Every process of the run's session: the trainer, Ray's processes and the ranks."""
        found = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == self.process.pid:
                    found.append(process)
            except (ProcessLookupError, PermissionError):
                continue
        return found

    def stop(self, signal_number: int, timeout: float = 60) -> float:
        """Send ``signal_number`` to the run's process group; the seconds until the trainer exited."""
        started = time.monotonic()
        os.killpg(self.process.pid, signal_number)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            name = signal.Signals(signal_number).name
            raise AssertionError(
                f"the run still ran {timeout} s after {name}: {self.err.read_text()[-3000:]}"
            ) from None
        return time.monotonic() - started

    def leftovers(self, grace: float = 10) -> list[str]:
        """The run's processes still alive ``grace`` seconds after it ended (zombies excepted)."""
        deadline = time.monotonic() + grace
        while True:
            alive = []
            for process in self.processes():
                try:
                    if process.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{process.pid} {' '.join(process.cmdline())[:100]}")
                except psutil.NoSuchProcess:
                    continue
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)

    def kill_all(self) -> None:
        for process in self.processes():
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue


def listening_sockets(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """``(process, address, port)`` of every listening TCP socket and bound UDP socket."""
    found = []
    for process in processes:
        try:
            name = " ".join(process.cmdline())[:80] or process.name()
            for connection in process.net_connections(kind="inet"):
                listening = connection.status == psutil.CONN_LISTEN or connection.type == socket.SOCK_DGRAM
                if listening and connection.laddr:
                    found.append((name, connection.laddr.ip, connection.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def assert_stopped_in_time(run: Run, seconds: float) -> None:
    """Stopped in seconds, or, where the signal ended Ray's own processes before the ranks were
    released (seen once in CI: Ray's calls then wait for them), at the stop deadline, saying so."""
    from verl_core.cli import STOP_DEADLINE_S

    if "the run did not end within" in run.err.read_text():
        assert seconds < STOP_DEADLINE_S + 10, f"{seconds:.1f} s to stop"
    else:
        assert seconds < 15, f"{seconds:.1f} s to stop"


def stop_line(stderr: str, what: str) -> re.Match:
    """The one line a stopped run ends with; nothing like a traceback or a stack dump around it."""
    for marker in ("Traceback", "KeyboardInterrupt", "SIGTERM received", "*** ", "Aborted"):
        assert marker not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("verl-core: ") and what in line]
    assert len(lines) == 1, stderr[-3000:]
    match = re.fullmatch(
        rf"verl-core: {what} (?:during|while saving the checkpoint of|while validating after) step (\d+) "
        r"of 500; the last checkpoint is (\S+) \(step (\d+)\): "
        "run the same command to resume",
        lines[0],
    )
    assert match, lines[0]
    return match


@pytest.mark.distributed
def test_ctrl_c_stops_a_local_ray_run_in_seconds_and_nothing_leaves_loopback(demo, tmp_path) -> None:
    run = Run(demo, tmp_path, **{"trainer.world_size": 2, "actor.engine.backend": "fsdp"})
    try:
        run.wait_for_step(2)
        sockets = listening_sockets(run.processes())
        assert len({name for name, _, _ in sockets}) >= 4  # the trainer, Ray's servers, both ranks
        exposed = [entry for entry in sockets if not is_loopback(entry[1])]
        assert not exposed, f"listening beyond loopback: {exposed}"

        seconds = run.stop(signal.SIGINT)
        assert run.process.returncode == 130, run.err.read_text()[-3000:]
        assert_stopped_in_time(run, seconds)
        match = stop_line(run.err.read_text(), "interrupted")
        step, saved = int(match.group(1)), int(match.group(3))
        # The step running, or its checkpoint being saved: one that completed as the signal came (the line
        # read the stage, then the checkpoints) is the last one already.
        finished_saving = "while saving the checkpoint of" in match.group(0) and saved == step
        assert saved >= 1 and (saved < step <= saved + 2 or finished_saving), match.group(0)
        assert (tmp_path / match.group(2)).resolve() == tmp_path / "checkpoints" / f"global_step_{saved}"
        assert saved == checkpoints.complete_checkpoints(tmp_path / "checkpoints")[-1][0]
        assert not run.leftovers()
    finally:
        run.kill_all()
    calls = [json.loads(line) for line in run.socket_log.read_text().splitlines()]
    started = [call for call in calls if call["call"] == "start"]  # the spy runs in the trainer and the ranks
    assert run.process.pid in {call["pid"] for call in started}
    assert sum("default_worker" in call["argv"] for call in started) >= 2
    calls = [call for call in calls if call["call"] != "start"]
    assert not calls, "a process of the run reached beyond loopback:\n" + "\n".join(
        f"{call['argv']}: {call['call']} {call['address']}\n{''.join(call['stack'])}" for call in calls
    )


@pytest.mark.distributed
def test_sigterm_to_the_whole_run_stops_it_in_seconds_without_a_stack_dump(demo, tmp_path) -> None:
    run = Run(demo, tmp_path)
    try:
        run.wait_for_step(2)  # step 1's checkpoint is complete: the stop line names it
        seconds = run.stop(signal.SIGTERM)
        assert run.process.returncode == 143, run.err.read_text()[-3000:]
        assert_stopped_in_time(run, seconds)
        stop_line(run.err.read_text(), "stopped by SIGTERM")
        assert not run.leftovers()
    finally:
        run.kill_all()


def test_a_stop_between_updates_says_what_the_run_was_doing(tmp_path) -> None:
    """The stop line names the stage ``fit`` is in: a stop while step 2's checkpoint is written is not
    'during step 3' (the save is step 2's, and the last complete checkpoint is step 1's)."""
    from verl_core.cli import EXIT_INTERRUPTED, _stopped_message
    from verl_core.config import EngineConfig, ModelConfig, RunConfig
    from verl_core.config.run import ActorConfig, TrainerConfig
    from verl_core.trainer.loop import Trainer

    class Recording(Trainer):
        kind = "rl"

        def train_step(self, step):
            seen.append((step, "update", self.stage))
            return {"reward/mean": 0.5}

        def validate(self, step):
            seen.append((step, "validate", self.stage))
            return {"val/score/mean": 0.5}

        def data_summary(self):
            return "data"

        def resume(self):
            return 0

        def save_checkpoint(self, step):
            seen.append((step, "save", self.stage))
            message = _stopped_message(self.config, self, EXIT_INTERRUPTED)
            seen.append((step, "message", message))

    settings = TrainerConfig(
        test_freq=2,
        save_freq=2,
        save_hf_model=False,
        logger=[],
        checkpoint_dir=str(tmp_path / "ckpt"),
        resume_mode="auto",
        run_dir=str(tmp_path),
    )
    config = RunConfig(
        actor=ActorConfig(engine=EngineConfig(backend="ddp", model=ModelConfig(path="model"))),
        trainer=settings,
    )
    seen: list = []
    trainer = Recording()
    trainer.config, trainer.val_data, trainer.run_dir = config, object(), tmp_path
    trainer.total_steps, trainer.show_progress, trainer.global_step = 2, False, 0
    trainer.fit()
    assert seen[:3] == [
        (0, "validate", "while validating before the first step"),
        (1, "update", None),
        (2, "update", None),
    ]
    assert (2, "validate", "while validating after step 2 of 2") in seen
    assert (2, "save", "while saving the checkpoint of step 2 of 2") in seen
    assert (
        2,
        "message",
        "interrupted while saving the checkpoint of step 2 of 2; no checkpoint yet: "
        "the same command starts over",
    ) in seen
    assert trainer.stage is None


# -- in process: Ctrl-C under nox, a kill while exporting, two runs on one folder, a full disk -------------


def test_ctrl_c_under_nox_prints_the_stop_line_before_the_workers_are_released(demo, tmp_path) -> None:
    """``nox`` runs a command in its terminal's process group: Ctrl-C reaches both, and nox waits 0.3 s,
    sends SIGTERM, waits 0.2 s and kills the command (``nox.popen.shutdown_process``), long before
    Ray's workers are released. Here the release never ends: the line must come before it."""
    run = Run(demo, tmp_path, hooks={"VERL_TEST_ENDLESS_RELEASE": "1"}, **{"trainer.workers": "in_process"})
    try:
        run.wait_for_step(2)
        os.killpg(run.process.pid, signal.SIGINT)  # Ctrl-C: to the terminal's process group
        run.wait_for(lambda: "verl-core: interrupted" in run.err.read_text(), "stop line", timeout=120)
        run.process.terminate()  # then nox's SIGTERM, which a stopping run ignores, and its SIGKILL
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.process.wait(timeout=0.2)
        run.process.kill()
        assert run.process.wait(timeout=60) == -signal.SIGKILL, run.err.read_text()[-3000:]
    finally:
        run.kill_all()
    match = stop_line(run.err.read_text(), "interrupted")
    step, saved = int(match.group(1)), int(match.group(3))
    # Step 2's line is logged before its checkpoint is written: a stop then finds step 1's the last.
    assert saved >= 1 and saved < step <= saved + 2, match.group(0)
    assert Path(match.group(2)) == tmp_path / "checkpoints" / f"global_step_{saved}"


@pytest.mark.parametrize("endless", ["VERL_TEST_ENDLESS_RELEASE", "VERL_TEST_ENDLESS_EXIT"])
def test_a_stop_whose_release_never_ends_exits_at_the_deadline(demo, tmp_path, endless) -> None:
    """SIGTERM to a whole Ray run can end Ray's processes before the trainer releases its ranks, and
    Ray's calls then wait for them (once over a minute in CI); or what waits on them holds the
    interpreter's exit after the release (a thread that never ends: seen in CI after a SIGTERM while
    saving a checkpoint). Here the release, or the exit, never ends: the run exits STOP_DEADLINE_S after
    the signal (3 s here), with SIGTERM's code, saying so after the stop line."""
    hooks = {endless: "1", "VERL_TEST_STOP_DEADLINE_S": "3"}
    run = Run(demo, tmp_path, hooks=hooks, **{"trainer.workers": "in_process"})
    try:
        run.wait_for_step(2)
        seconds = run.stop(signal.SIGTERM)
    finally:
        run.kill_all()
    err = run.err.read_text()
    assert run.process.returncode == 143, err[-3000:]
    assert seconds >= 3, f"exited {seconds:.1f} s after the signal, before the deadline"
    stop_line(err, "stopped by SIGTERM")
    assert "the run did not end within 3 s of the stop" in err, err[-3000:]


@pytest.fixture(scope="module")
def killed_while_exporting(demo, tmp_path_factory):
    """A run killed (``kill -9``) while writing its final export, after its last checkpoint, and the
    same command started again while the first still ran: ``(run, the second's exit code, its stderr)``."""
    tmp_path = tmp_path_factory.mktemp("killed")
    exporting = tmp_path / "exporting.txt"
    run = Run(
        demo,
        tmp_path,
        hooks={"VERL_TEST_HOLD_EXPORT": str(exporting)},
        **{
            "trainer.workers": "in_process",
            "trainer.total_training_steps": 2,
            "trainer.save_hf_model": "true",
        },
    )
    try:
        run.wait_for(exporting.exists, "export")
        second = io.StringIO()
        with contextlib.redirect_stderr(second), contextlib.redirect_stdout(io.StringIO()):
            code = main(["train", *run.overrides])
        os.killpg(run.process.pid, signal.SIGKILL)
        run.process.wait(timeout=60)
    finally:
        run.kill_all()
    return run, code, second.getvalue()


def test_a_second_run_on_the_same_folders_is_refused_at_start_naming_the_first(
    killed_while_exporting,
) -> None:
    run, code, err = killed_while_exporting
    assert code == 2, err
    folder = run.tmp_path / "checkpoints"
    assert (
        f"error: trainer.checkpoint_dir {folder} is in use by another run: pid {run.process.pid} on "
        f"{socket.gethostname()}, started "
    ) in err, err
    assert "hooked_cli.py train" in err  # its command
    assert "loading the tokenizer" not in err  # refused before anything loads or starts


def test_a_run_killed_while_exporting_writes_its_export_and_curves_when_started_again(
    killed_while_exporting, capsys
) -> None:
    """A kill leaves the last checkpoint complete, the export half-written in its staging folder and
    no curves; the same command makes what is missing, and only then has nothing left to do. The
    lock file the dead run left holds nothing."""
    run, _, _ = killed_while_exporting
    run_dir, folder = run.tmp_path / "run", run.tmp_path / "checkpoints"
    assert [step for step, _ in checkpoints.complete_checkpoints(folder)] == [1, 2]
    assert (
        not (run_dir / "hf_model").exists() and (run_dir / ".hf_model.saving" / "model.safetensors").is_file()
    )
    assert not (run_dir / "curves.png").exists()
    assert f'"pid": {run.process.pid}' in (folder / LOCK_FILE).read_text()

    assert main(["train", *run.overrides]) == 0
    err = capsys.readouterr().err
    assert (
        f"verl-core: the checkpoint {folder / 'global_step_2'} is at the run's last step, but the run stopped "
        "before its Hugging Face export was written: writing it now"
    ) in err, err
    export = run_dir / "hf_model"
    assert exported_step(export) == 2
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {path.name for path in export.iterdir()}
    saved = torch.load(folder / "global_step_2" / "actor" / "model.pt", weights_only=True)
    exported = safetensors.torch.load_file(export / "model.safetensors")
    assert exported.keys() <= saved.keys()
    for name, tensor in exported.items():  # the trained weights of the last checkpoint
        assert torch.equal(tensor, saved[name]), name
    assert (run_dir / "curves.png").is_file()
    assert not (run_dir / ".hf_model.saving").exists()

    (run_dir / "curves.png").unlink()  # as if killed while drawing them
    assert main(["train", *run.overrides]) == 0
    err = capsys.readouterr().err
    assert (
        "verl-core: nothing to train: the checkpoint" in err and "curves (drawn now, missing before)" in err
    )
    assert (run_dir / "curves.png").is_file()


def test_a_full_disk_at_a_checkpoint_is_one_error_naming_the_folder_and_the_room_needed(
    demo, tmp_path
) -> None:
    """A real ``ENOSPC``: the checkpoint folder is a tmpfs with room for one checkpoint and a half,
    mounted in a user and mount namespace of the run's own (``unshare -Urm``, no root needed)."""
    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode
    ):
        pytest.skip(
            "no mount namespace of its own (unshare -Urm) to mount a small tmpfs in: a disk cannot be filled here"
        )
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    # A checkpoint holds the weights, AdamW's two moments and a little more: three times the weights.
    size = (Path(demo.model) / "model.safetensors").stat().st_size * 9 // 2
    overrides = run_overrides(
        demo, tmp_path, **{"trainer.save_freq": 1, "trainer.total_training_steps": 3, "trainer.test_freq": 0}
    )
    script = "\n".join(
        [
            f"mount -t tmpfs -o size={size} tmpfs {folder} || exit 99",
            f"{shlex.join([sys.executable, '-m', 'verl_core', 'train', *overrides])} 2> {tmp_path}/err.txt",
            f"echo $? > {tmp_path}/code.txt",
            f"ls -A {folder} > {tmp_path}/listing.txt",  # the tmpfs goes with the namespace
            f"find {folder}/global_step_1 -type f -printf '%s\\n' > {tmp_path}/sizes.txt",
        ]
    )
    assert (
        subprocess.run(
            ["unshare", "-Urm", "sh", "-c", script], timeout=600, stdout=subprocess.DEVNULL
        ).returncode
        == 0
    )
    err = (tmp_path / "err.txt").read_text()
    assert (tmp_path / "code.txt").read_text().strip() == "1", err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    checkpoint_bytes = sum(int(size) for size in (tmp_path / "sizes.txt").read_text().split())
    assert line.startswith(
        f"error: the disk of trainer.checkpoint_dir {folder} is full: saving the checkpoint of step 2 failed ("
    ), line
    assert f"A checkpoint of this run needs about {checkpoint_bytes} bytes (" in line
    assert (
        f"then run the same command to resume from {folder / 'global_step_1'} (step 1), the last complete checkpoint"
        in line
    )
    # The unfinished save was removed: nothing half-written is left to trust, and its room is free.
    assert sorted((tmp_path / "listing.txt").read_text().split()) == [LOCK_FILE, "global_step_1"]


def test_a_full_disk_is_recognised_through_what_wraps_it(tmp_path) -> None:
    """A rank's ``OSError`` reaches the trainer inside a ``WorkerError``, DCP's inside its per-rank
    failures, and one that crossed processes as text only; a stop or a bug on a disk with room is not
    a full disk."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from verl_core.workers.group import WorkerError

    def raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
        try:
            raise error from cause
        except BaseException as caught:
            return caught

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for error in (
        full,
        raised(WorkerError("actor rank 1 (pid 42 on 127.0.0.1) failed"), full),
        CheckpointException("save failed", {0: _wrap_exception(raised(full))}),
        raised(
            WorkerError("actor rank 0 failed: CheckpointException ranks:dict_keys([0])"),
            RuntimeError(f"OSError: [Errno 28] {os.strerror(errno.ENOSPC)}"),
        ),
        OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
    ):
        assert checkpoints.disk_full(error, tmp_path), repr(error)
    for error in (KeyboardInterrupt(), TypeError("a bug"), RuntimeError("unexpected pos 576 vs 534")):
        assert not checkpoints.disk_full(error, tmp_path), repr(error)  # room is left in tmp_path
