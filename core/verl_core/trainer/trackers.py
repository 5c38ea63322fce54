"""The experiment trackers among core's metric sinks: ``wandb``, ``mlflow`` and ``trackio``
(docs/tracking.md). Each imports its library when a run names it, and each is an extra of verl-core
(``pip install "verl-core[wandb]"``, ...). They run behind ``verl_core.trainer.sinks.SinkChannel``:
what raises here is warned about once and ends the sink, never the run.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_core.trainer.sinks import BaseMetricSink, SinkRun, finite, flat_params

#: Columns of the validation samples' table, in order (the rows' other keys follow).
SAMPLE_COLUMNS = ("step", "prompt", "response", "score")
#: The ``mlflow`` sink's database in the run folder when ``trainer.tracking_uri`` is not set.
MLFLOW_DB = "mlflow.db"
#: Seconds a tracking server has to answer the check made when a sink starts.
SERVER_CHECK_TIMEOUT_S = 5.0


def sample_table(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` of the validation samples: ``SAMPLE_COLUMNS`` first, values that are not
    text or numbers (the turns of a conversation) as their JSON text."""
    columns = [column for column in SAMPLE_COLUMNS if any(column in row for row in rows)]
    columns += sorted({key for row in rows for key in row} - set(columns))

    def cell(value: Any) -> Any:
        return value if value is None or isinstance(value, str | int | float) else json.dumps(value)

    return columns, [[cell(row.get(column)) for column in columns] for row in rows]


class WandbSink(BaseMetricSink):
    """Weights & Biases: a run in ``trainer.project_name`` named ``trainer.experiment_name``, its files
    under ``RUN_DIR/wandb/``. ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later).
    A resumed run continues the same wandb run (its id kept in ``RUN_DIR/tracking/wandb.json``)."""

    def __init__(self, run: SinkRun) -> None:
        super().__init__(run)
        import wandb

        self._wandb = wandb
        self.where = str(run.run_dir / "wandb")
        (run.run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=run.project,
            name=run.name,
            dir=str(run.run_dir),
            config=dict(run.config),
            id=run.resume_id,
            resume="allow" if run.resume_id else None,
            settings=wandb.Settings(console="off", x_disable_stats=True),
            reinit="create_new",
        )
        self.run_id = self._run.id
        if self._run.settings.mode not in ("offline", "disabled"):
            self.where = self._run.url or self.where

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(finite(metrics), step=step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns, data = sample_table(rows)
        self._run.log({"val/samples": self._wandb.Table(columns=columns, data=data)}, step=step)

    def log_artifact(self, path: Path) -> None:
        artifact = self._wandb.Artifact(f"{self.run_id}-{path.stem}", type="plot")
        artifact.add_file(str(path))
        self._run.log_artifact(artifact)

    def close(self) -> None:
        self._run.finish()


#: Characters MLflow accepts in a metric's name; any other becomes ``_`` (``val/pass@4`` -> ``val/pass_4``).
_MLFLOW_NAME = re.compile(r"[^\w\-. /]")


class MlflowSink(BaseMetricSink):
    """MLflow: a run in the experiment ``trainer.project_name`` named ``trainer.experiment_name``, at
        ``trainer.tracking_uri`` (a tracking server's ``http://host:port``, or a store such as
        ``sqlite:////path/mlflow.db``), by default the database ``RUN_DIR/mlflow.db`` (files in
    ``RUN_DIR/mlartifacts``). The resolved config is its parameters, the
        validation samples a table per validation, the curves an artifact. A tracking server that does not
        answer when the run starts is named in the sink's warning. A resumed run continues the same MLflow
        run (its id kept in ``RUN_DIR/tracking/mlflow.json``)."""

    def __init__(self, run: SinkRun) -> None:
        super().__init__(run)
        uri = run.tracking_uri or f"sqlite:///{(run.run_dir / MLFLOW_DB).resolve()}"
        self.where = uri
        if uri.startswith(("http://", "https://")):
            check_server(uri.rstrip("/") + "/health", uri)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        if run.resume_id is not None:
            self.run_id = client.get_run(run.resume_id).info.run_id
            client.update_run(self.run_id, status="RUNNING")
            return
        experiment = client.get_experiment_by_name(run.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(run.project, artifact_location=self._artifacts(uri))
        )
        self.run_id = client.create_run(experiment_id, run_name=run.name).info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in flat_params(run.config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            client.log_batch(self.run_id, params=params[start : start + 100])

    def _artifacts(self, uri: str) -> str | None:
        """Where a new experiment's files go: beside a local database in the run folder
        (``RUN_DIR/mlartifacts``), the server's or the store's choice otherwise."""
        return (
            (self.run.run_dir / "mlartifacts").resolve().as_uri() if self.run.tracking_uri is None else None
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(_MLFLOW_NAME.sub("_", key), float(value), now, step)
            for key, value in finite(metrics).items()
        ]
        self._client.log_batch(self.run_id, metrics=batch)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns, data = sample_table(rows)
        table = {column: [row[i] for row in data] for i, column in enumerate(columns)}
        self._client.log_table(self.run_id, data=table, artifact_file=f"validation/step_{step}.json")

    def log_artifact(self, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class TrackioSink(BaseMetricSink):
    """trackio, in its local mode: a run in the project ``trainer.project_name`` named
    ``trainer.experiment_name``, kept in trackio's folder (``TRACKIO_DIR``, by default
    ``~/.cache/huggingface/trackio``; ``trackio show`` opens its dashboard). A resumed run continues the
    run of the same name."""

    def __init__(self, run: SinkRun) -> None:
        super().__init__(run)
        import trackio

        self._trackio = trackio
        self._run = trackio.init(
            project=run.project,
            name=run.name,
            config=flat_params(run.config),
            resume="allow" if run.resume_id else "never",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )
        self.run_id = run.name
        from trackio.utils import TRACKIO_DIR

        self.where = str(TRACKIO_DIR)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(finite(metrics), step=step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns, data = sample_table(rows)
        self._run.log({"val/samples": self._trackio.Table(columns=columns, data=data)}, step=step)

    def log_artifact(self, path: Path) -> None:
        self._run.log_artifact(path, name=path.stem, type="plot")

    def close(self) -> None:
        self._run.finish()


def check_server(url: str, shown: str) -> None:
    """Raise ``ConnectionError`` naming ``shown`` when nothing answers ``url`` within
    ``SERVER_CHECK_TIMEOUT_S`` (a tracking server that is down, or an address that is wrong)."""
    try:
        with urllib.request.urlopen(url, timeout=SERVER_CHECK_TIMEOUT_S) as answer:  # noqa: S310 - the user's URL
            answer.read()
    except (OSError, urllib.error.URLError) as error:
        reason = getattr(error, "reason", error)
        raise ConnectionError(f"no tracking server answers at {shown} ({reason})") from None
