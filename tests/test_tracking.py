"""The experiment trackers as metric sinks, against the real libraries and nothing on the network: wandb
offline (its run file read back with wandb's own protobuf records), MLflow in a local database and
against a real ``mlflow server`` on loopback, trackio in its local mode. Each trains 3 GRPO steps on the
demo, crashing once after step 2 was logged but before its checkpoint, and resuming: the tracker holds
every step once. A sink that fails or hangs never stops or slows training.

Each tracker is an extra (``pip install "verl-core[wandb]"``, ...): its tests are skipped without it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from fixtures.demo import run_overrides

from verl_core import MetricSink, hookimpl
from verl_core.config import load_config
from verl_core.plugins import Registry
from verl_core.trainer.metrics import REWARD_KEY, VAL_SCORE_KEY, MetricsLogger
from verl_core.trainer.rl import RLTrainer
from verl_core.trainer.sinks import BaseMetricSink

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    """The trackers' offline switches, and trackio's folder in the test's own."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path_factory.getbasetemp() / "trackio"))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def train_crash_and_resume(demo, tmp_path, sink: str, **changes) -> Path:
    """3 GRPO steps logged to ``sink``, validated before the first and after the last; the first try
    stops while saving step 2's checkpoint (step 2 already logged), the second resumes from step 1."""
    overrides = {
        "trainer.logger": f"[{sink}]",
        "trainer.total_training_steps": 3,
        "trainer.save_freq": 1,
        "trainer.test_freq": 3,
        "trainer.val_samples_logged": 2,
    } | changes
    config = load_config([], run_overrides(demo, tmp_path, **overrides))
    first = RLTrainer.from_config(config, show_progress=False)
    save = first.actor.save_checkpoint

    def crash_at_step_2(path, *args, **kwargs):
        if "global_step_2" in str(path):
            raise KeyboardInterrupt("stopped while saving step 2")
        return save(path, *args, **kwargs)

    first.actor.save_checkpoint = crash_at_step_2
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    first.shutdown()
    second = RLTrainer.from_config(config, show_progress=False)
    second.fit()
    second.shutdown()
    run_dir = tmp_path / "run"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
        2,
        3,
    ]
    return run_dir


# -- wandb ----------------------------------------------------------------------------------------


def test_wandb_offline_keeps_every_step_once_across_a_resume(demo, tmp_path) -> None:
    pytest.importorskip("wandb")
    from fixtures.wandb_records import history, of_type

    run_dir = train_crash_and_resume(demo, tmp_path, "wandb")
    run_id = json.loads((run_dir / "tracking" / "wandb.json").read_text())["run_id"]
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # the first try and the resumed one: one wandb run, continued
    rows = [row for path in files for row in history(path)]
    assert [row["_step"] for row in rows] == [0, 1, 2, 3]
    assert all(REWARD_KEY in row for row in rows[1:]) and VAL_SCORE_KEY in rows[3]
    assert [row["_step"] for row in rows if row.get("val/samples/_type") == "table-file"] == [0, 3]
    config = {item.key: json.loads(item.value_json) for item in of_type(files[0], "run")[0].config.update}
    assert config["trainer"]["total_training_steps"] == 3
    artifacts = of_type(files[1], "artifact")
    assert "curves.png" in [entry.path for artifact in artifacts for entry in artifact.manifest.contents]


# -- MLflow ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on loopback for the module's tests (its own database and files)."""
    pytest.importorskip("mlflow")
    folder = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
            "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
            "--artifacts-destination", str(folder / "artifacts"), "--workers", "1",
        ],
        stdout=(folder / "server.log").open("w"),
        stderr=subprocess.STDOUT,
        env=os.environ | {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield url
    server.terminate()
    server.wait(30)


def mlflow_steps(uri: str, run_dir: Path, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "tracking" / "mlflow.json").read_text())["run_id"]
    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


def check_mlflow_run(uri: str, run_dir: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run_id = json.loads((run_dir / "tracking" / "mlflow.json").read_text())["run_id"]
    assert [step for step, _ in mlflow_steps(uri, run_dir, REWARD_KEY)] == [1, 2, 3]
    assert [step for step, _ in mlflow_steps(uri, run_dir, VAL_SCORE_KEY)] == [0, 3]
    run = client.get_run(run_id)
    assert run.data.params["trainer.total_training_steps"] == "3"
    assert run.info.status == "FINISHED"
    assert {artifact.path for artifact in client.list_artifacts(run_id)} == {"curves.png", "validation"}
    tables = [artifact.path for artifact in client.list_artifacts(run_id, "validation")]
    assert tables == ["validation/step_0.json", "validation/step_3.json"]


def test_mlflow_local_database_keeps_every_step_once_across_a_resume(demo, tmp_path) -> None:
    pytest.importorskip("mlflow")
    run_dir = train_crash_and_resume(demo, tmp_path, "mlflow")
    check_mlflow_run(f"sqlite:///{run_dir / 'mlflow.db'}", run_dir)


def test_mlflow_server_on_loopback_keeps_every_step_once_across_a_resume(
    demo, tmp_path, mlflow_server
) -> None:
    run_dir = train_crash_and_resume(demo, tmp_path, "mlflow", **{"trainer.tracking_uri": mlflow_server})
    check_mlflow_run(mlflow_server, run_dir)


class Relay:
    """A TCP relay on loopback to ``port``, that ``cut`` stops: a tracking server gone mid-run."""

    def __init__(self, port: int) -> None:
        self.target, self.listener = port, socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self.listener.close()
        for connection in self.open:
            connection.close()


def test_a_tracking_server_gone_mid_run_is_warned_about_once_and_training_goes_on(
    demo, tmp_path, mlflow_server, capsys
) -> None:
    relay = Relay(int(mlflow_server.rsplit(":", 1)[1]))
    overrides = {"trainer.logger": "[mlflow]", "trainer.total_training_steps": 3}
    config = load_config([], run_overrides(demo, tmp_path, **overrides | {"trainer.tracking_uri": relay.url}))
    trainer = RLTrainer.from_config(config, show_progress=False)
    step = trainer.train_step

    def gone_after_step_1(number):
        if number == 2:
            time.sleep(2)  # the sink has sent step 1
            relay.cut()
        return step(number)

    trainer.train_step = gone_after_step_1
    trainer.fit()
    trainer.shutdown()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "metric sink 'mlflow'" in line]
    assert len(warnings) == 1, warnings
    assert relay.url in warnings[0] and "training goes on" in warnings[0]
    assert [step for step, _ in mlflow_steps(mlflow_server, tmp_path / "run", REWARD_KEY)] == [1]


def test_an_unreachable_tracking_server_at_start_is_a_warning_naming_its_url(tmp_path, capsys) -> None:
    pytest.importorskip("mlflow")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with MetricsLogger(tmp_path, ["mlflow"], total_steps=2, show_progress=False, tracking_uri=url) as logger:
        logger.log(1, {REWARD_KEY: 0.5})
    err = capsys.readouterr().err
    assert (
        f"metric sink 'mlflow' could not start (ConnectionError: no tracking server answers at {url}" in err
    )
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, REWARD_KEY: 0.5}


# -- trackio --------------------------------------------------------------------------------------


def test_trackio_local_keeps_every_step_once_across_a_resume(demo, tmp_path) -> None:
    pytest.importorskip("trackio")
    import trackio

    run_dir = train_crash_and_resume(demo, tmp_path, "trackio", **{"trainer.experiment_name": tmp_path.name})
    logs = trackio.SQLiteStorage.get_logs("verl-core", tmp_path.name)
    metrics = [row for row in logs if "val/samples" not in row]
    assert [row["step"] for row in metrics] == [0, 1, 2, 3]
    assert all(REWARD_KEY in row for row in metrics[1:]) and VAL_SCORE_KEY in metrics[3]
    assert [row["step"] for row in logs if "val/samples" in row] == [0, 3]
    config = trackio.SQLiteStorage.get_run_config("verl-core", tmp_path.name)
    assert config["trainer.total_training_steps"] == 3
    del run_dir


# -- nothing beyond loopback ------------------------------------------------------------------------

#: Trains argv[1]'s overrides in process.
TRAIN = """
import json, sys
from verl_core.config import load_config
from verl_core.trainer.rl import RLTrainer

trainer = RLTrainer.from_config(load_config([], json.loads(sys.argv[1])), show_progress=False)
try:
    trainer.fit()
finally:
    trainer.shutdown()
"""


def test_a_run_logging_to_every_tracker_reaches_nothing_beyond_loopback(
    demo, tmp_path, mlflow_server
) -> None:
    """One GRPO step logged to wandb (offline), MLflow (the server on loopback) and trackio (local) at
    once, the trainer under the socket spy of tests/test_everyday_faults.py, which records every socket
    call of its Python processes naming another address. wandb's own service (``wandb-core``) is a Go
    binary the spy cannot see: offline mode keeps it to its files."""
    pytest.importorskip("wandb")
    pytest.importorskip("trackio")
    from fixtures.sockets import describe, recorded, run_script, spied_environment

    env, log = spied_environment(tmp_path)
    overrides = run_overrides(
        demo,
        tmp_path,
        **{
            "trainer.logger": "[console,wandb,mlflow,trackio]",
            "trainer.tracking_uri": mlflow_server,
            "trainer.total_training_steps": 1,
        },
    )
    done = run_script(TRAIN, json.dumps(overrides), env=env)
    assert "verl-core: warning:" not in done.stderr, done.stderr[-3000:]  # no sink failed: each logged
    started, calls = recorded(log)
    assert any(line["argv"].startswith("-c ") for line in started)  # the spy ran in the trainer
    assert not calls, "a process reached beyond loopback:\n" + describe(calls)


# -- failing and slow sinks, with no tracker library -------------------------------------------------


class GatedSink(BaseMetricSink):
    """Records what it gets; each record waits for ``GATE`` (a tracker that hangs); step 2 raises."""

    GATE = threading.Event()
    received: list[int] = []

    def log_metrics(self, step, metrics):
        GatedSink.GATE.wait(30)
        if step == 2:
            raise OSError(28, "No space left on device")
        GatedSink.received.append(step)


class GatedPlugin:
    @hookimpl
    def verl_metric_sinks(self):
        return [MetricSink(name="gated", sink=GatedSink)]


def test_a_hanging_sink_never_holds_a_step_and_a_failing_one_is_warned_about_once(tmp_path, capsys) -> None:
    registry = Registry.from_plugins([GatedPlugin()])
    GatedSink.GATE.clear()
    GatedSink.received.clear()
    logger = MetricsLogger(tmp_path, ["gated"], total_steps=4, show_progress=False, registry=registry)
    for step in range(1, 5):
        logger.log(step, {REWARD_KEY: step / 4})  # returns with the sink stuck on its first record
    assert GatedSink.received == []
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    GatedSink.GATE.set()
    logger.close()
    assert GatedSink.received == [1]  # dropped after the failure at step 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if "metric sink 'gated'" in line]
    assert len(warnings) == 1
    assert "failed in log_metrics at step 2 (OSError: [Errno 28] No space left on device)" in warnings[0]
