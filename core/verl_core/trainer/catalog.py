"""Descriptors of core's built-in metric sinks, by import string (nothing imported here)."""

from __future__ import annotations

from verl_core.descriptors import MetricSink


def _extra(name: str, sink: str, description: str, background: bool = True) -> MetricSink:
    """A sink that needs the package ``name``, installed with verl-core's extra of that name."""
    return MetricSink(
        name=name,
        sink=sink,
        description=description,
        background=background,
        requires=(name,),
        install=f'pip install "verl-core[{name}]"',
    )


METRIC_SINKS: tuple[MetricSink, ...] = (
    MetricSink(
        name="console",
        sink="verl_core.trainer.metrics:ConsoleSink",
        description="one line of the step's main metrics on stdout",
        background=False,
    ),
    _extra(
        "tensorboard",
        "verl_core.trainer.sinks:TensorBoardSink",
        "TensorBoard scalars under RUN_DIR/tensorboard",
        background=False,
    ),
    _extra(
        "wandb",
        "verl_core.trainer.trackers:WandbSink",
        "a Weights & Biases run (WANDB_MODE=offline keeps it on disk)",
    ),
    _extra(
        "mlflow",
        "verl_core.trainer.trackers:MlflowSink",
        "an MLflow run at trainer.tracking_uri (default RUN_DIR/mlflow.db)",
    ),
    _extra("trackio", "verl_core.trainer.trackers:TrackioSink", "a trackio run, local (trackio show)"),
)
