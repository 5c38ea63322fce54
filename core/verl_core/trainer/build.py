"""Building what a run needs from its config: the tokenizer and the roles' worker groups."""

from __future__ import annotations

from typing import Any

from verl_core.config.engine import ModelConfig
from verl_core.config.paths import absolute_paths
from verl_core.config.run import RunConfig
from verl_core.errors import ConfigError
from verl_core.workers.group import InProcessWorkerGroup, WorkerGroup
from verl_core.workers.ranks import ActorWorker, CriticWorker
from verl_core.workers.roles import Actor, Critic

#: Files that hold a tokenizer's vocabulary: a model folder needs one of them.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model")


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer saved beside the policy's weights (``actor.engine.model.path``), from the local
    folder only; a model without pad token pads with its EOS token."""
    from transformers import AutoTokenizer

    from verl_core.toolkit.model import check_model_dir

    path = check_model_dir(model.path, "actor.engine.model.path")
    if not any((path / name).is_file() for name in VOCABULARY_FILES):
        # transformers would build an empty tokenizer of the model's type instead of failing
        raise ConfigError(
            [
                (
                    "actor.engine.model.path",
                    f"{path} has no tokenizer files ({', '.join(VOCABULARY_FILES)}): save the tokenizer "
                    "beside the model (tokenizer.save_pretrained(path))",
                )
            ]
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=model.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as error:
        raise ConfigError(
            [
                (
                    "actor.engine.model.path",
                    f"{path} has no tokenizer the trainer can load ({error}); save the tokenizer beside the "
                    "model (tokenizer.save_pretrained(path))",
                )
            ]
        ) from error
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            [
                (
                    "actor.engine.model.path",
                    f"the tokenizer of {path} has no EOS token, so generation could never stop: set "
                    "tokenizer.eos_token and save it again",
                )
            ]
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def workers_description(config: RunConfig) -> str:
    """Where the roles run, for the console: ``in process``, ``2 rank(s) under a local Ray cluster``."""
    trainer = config.trainer
    if trainer.workers == "in_process":
        return "in process"
    cluster = f"the Ray cluster at {trainer.ray_address}" if trainer.ray_address else "a local Ray cluster"
    return f"{trainer.world_size} rank(s) each under {cluster}"


def worker_group(config: RunConfig, role: str, make_worker: Any, device: str = "cpu") -> WorkerGroup:
    """The worker group ``trainer.workers`` says for ``role``, whose engine computes on ``device``
    (an ``EngineConfig.device``: under Ray, a CUDA engine gets one GPU per rank and NCCL)."""
    (group,) = worker_groups(config, [(role, make_worker, device)])
    return group


def worker_groups(config: RunConfig, roles: list[tuple[str, Any, str]]) -> list[WorkerGroup]:
    """``worker_group`` for each ``(role, make_worker, device)``; under Ray the groups start side by side
    (``start_together``), not one after the other. If one fails, the others are released."""
    if config.trainer.workers == "in_process":
        return [InProcessWorkerGroup(role, make_worker) for role, make_worker, _ in roles]
    from verl_core.engine.device import device_type
    from verl_core.workers.ray_group import RayWorkerGroup, start_together

    groups = []
    try:
        for role, make_worker, device in roles:
            group = RayWorkerGroup(
                role,
                make_worker,
                world_size=config.trainer.world_size,
                address=config.trainer.ray_address,
                device=device_type(device, f"{role}.engine.device"),
                liveness_timeout_s=config.trainer.worker_timeout_s,
                wait=False,
            )
            groups.append(group)
        start_together(groups)
    except BaseException:
        for group in groups:
            group.shutdown()
        raise
    return groups


def build_roles(config: RunConfig, registry: Any = None) -> tuple[Actor, Critic | None]:
    """The actor and (with ``critic.enable``) the critic, their engines initialised on every rank."""
    roles = [("actor", WorkerMaker(ActorWorker, config, registry), config.actor.engine.device)]
    if config.critic.enable:
        roles.append(("critic", WorkerMaker(CriticWorker, config, registry), config.critic.engine.device))
    if config.trainer.workers == "in_process":  # one process: each role built and initialised in turn
        actor = Actor(worker_group(config, *roles[0]))
        try:
            return actor, Critic(worker_group(config, *roles[1])) if config.critic.enable else None
        except BaseException:
            actor.shutdown()
            raise
    groups = worker_groups(config, roles)
    try:
        actor = Actor(groups[0])
        critic = Critic(groups[1]) if config.critic.enable else None
    except BaseException:  # an engine that failed to initialise: release every rank
        for group in groups:
            group.shutdown()
        raise
    return actor, critic


class WorkerMaker:
    """A picklable ``make_worker`` for a worker class (Ray ships it to each rank's process).

    It holds ``config`` with every path made absolute here, on the driver: a rank's process may run
    in another folder (on a cluster started with ``ray start``, the folder where that ran)."""

    def __init__(self, worker_class: type, config: RunConfig, registry: Any):
        self.worker_class, self.config = worker_class, absolute_paths(config)
        # A registry is a process's own discovery: Ray ranks discover the installed plugins again.
        self.registry = registry if config.trainer.workers == "in_process" else None

    def __call__(self) -> Any:
        if self.config.trainer.workers == "ray":  # a rank's own process: the run's console is the driver's
            quiet_progress_bars()
        return self.worker_class(self.config, self.registry)


def quiet_progress_bars() -> None:
    """No ``transformers`` progress bars (loading weights, writing shards) in this process: a run's
    console says what it does in its own lines (``trainer.console``)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
