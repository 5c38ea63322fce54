"""A real ``verl-core train`` under a local Ray cluster, stopped the everyday ways: Ctrl-C (SIGINT to
the terminal's process group) and SIGTERM (a scheduler stopping the job's processes). Each ends in a
few seconds with one line saying where the run stopped and how to resume it, exit 130 or 143, no
traceback, no Ray stack dump and no process left behind. The Ctrl-C run also checks that nothing of
a local run listens on, connects to or looks up anything but loopback: every process of the run's
session is listed with its listening sockets, and every Python process of the run records its
socket calls (a ``sitecustomize`` module on ``PYTHONPATH``, which Ray's processes inherit)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fixtures.demo import build_small_demo, run_overrides

from verl_core.trainer import checkpoints

pytestmark = pytest.mark.distributed

#: Records every socket call of a Python process that names an address other than loopback (or the
#: wildcard, for a bind), one JSON line each, into $VERL_TEST_SOCKET_LOG.
SOCKET_SPY = r"""
import json, os, socket, sys, traceback

_LOG = os.environ.get("VERL_TEST_SOCKET_LOG")
_LOCAL = {"localhost", "::1", "0:0:0:0:0:0:0:1", socket.gethostname()}


def _record(call, address):
    host = address[0] if isinstance(address, tuple) else address
    if not isinstance(host, str) or host.startswith(("127.", "::ffff:127.")) or host in _LOCAL:
        return
    if call != "bind" and host in ("", "0.0.0.0", "::"):
        return
    line = {"pid": os.getpid(), "argv": " ".join(sys.argv)[:200], "call": call, "address": repr(address),
            "stack": traceback.format_stack(limit=8)[:-2]}
    with open(_LOG, "a") as log:
        log.write(json.dumps(line) + "\n")


def _wrap(cls, name, call):
    original = getattr(cls, name)

    def wrapper(self, address, *args, **kwargs):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            _record(call, address if name != "sendto" else (args or (address,))[-1])
        return original(self, address, *args, **kwargs)

    setattr(cls, name, wrapper)


if _LOG:
    with open(_LOG, "a") as _log:  # which processes run with the spy
        _log.write(json.dumps({"pid": os.getpid(), "argv": " ".join(sys.argv)[:200], "call": "start"}) + "\n")
    for _name in ("connect", "connect_ex", "bind"):
        _wrap(socket.socket, _name, _name)
    _wrap(socket.socket, "sendto", "sendto")
    _getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if isinstance(host, bytes):
            host = host.decode()
        _record("getaddrinfo", (host,))
        return _getaddrinfo(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_small_demo(tmp_path_factory.mktemp("demo"))


class Run:
    """``verl-core train`` in a session of its own (so that a signal can go to its process group, as
    a terminal's Ctrl-C does), its output in files, its socket calls recorded."""

    def __init__(self, demo, tmp_path: Path, **changes):
        self.tmp_path = tmp_path
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        self.socket_log = tmp_path / "sockets.jsonl"
        spy = tmp_path / "spy"
        spy.mkdir()
        (spy / "sitecustomize.py").write_text(SOCKET_SPY)
        overrides = run_overrides(
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
        }
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "verl_core", "train", *overrides],
                stdout=out,
                stderr=err,
                env=env,
                cwd=tmp_path,
                start_new_session=True,
            )

    def wait_for_step(self, step: int, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(rf"^step {step}/", self.out.read_text(), re.MULTILINE):
            assert self.process.poll() is None, f"the run ended early: {self.err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"no step {step} after {timeout} s: {self.err.read_text()[-3000:]}"
            )
            time.sleep(0.5)

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
        self.process.wait(timeout=timeout)
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
        assert seconds < 15, f"{seconds:.1f} s to stop"
        match = stop_line(run.err.read_text(), "interrupted")
        step, saved = int(match.group(1)), int(match.group(3))
        assert saved >= 1 and saved < step <= saved + 2  # the step running, or its checkpoint being saved
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


def test_sigterm_to_the_whole_run_stops_it_in_seconds_without_a_stack_dump(demo, tmp_path) -> None:
    run = Run(demo, tmp_path)
    try:
        run.wait_for_step(2)  # step 1's checkpoint is complete: the stop line names it
        seconds = run.stop(signal.SIGTERM)
        assert run.process.returncode == 143, run.err.read_text()[-3000:]
        assert seconds < 15, f"{seconds:.1f} s to stop"
        stop_line(run.err.read_text(), "stopped by SIGTERM")
        assert not run.leftovers()
    finally:
        run.kill_all()


def test_a_stop_between_updates_says_what_the_run_was_doing(tmp_path) -> None:
    """The stop line names the stage ``fit`` is in: a stop while step 2's checkpoint is written is not
    'during step 3' (the save is step 2's, and the last complete checkpoint is step 1's)."""
    from types import SimpleNamespace

    from verl_core.cli import EXIT_INTERRUPTED, _stopped_message
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

    settings = SimpleNamespace(
        test_freq=2,
        save_freq=2,
        save_hf_model=False,
        logger=[],
        checkpoint_dir=str(tmp_path / "ckpt"),
        resume_mode="auto",
    )
    seen: list = []
    trainer = Recording()
    trainer.config, trainer.val_data, trainer.run_dir = SimpleNamespace(trainer=settings), object(), tmp_path
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
