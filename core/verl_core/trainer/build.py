"""Building what a run needs from its config: the tokenizer and the roles' worker groups."""

from __future__ import annotations

from typing import Any

import attrs

from verl_core.config.engine import ModelConfig
from verl_core.config.paths import absolute_path, absolute_paths
from verl_core.config.run import RunConfig
from verl_core.errors import ConfigError
from verl_core.toolkit.allocator import keep_freed_memory
from verl_core.workers.group import InProcessWorkerGroup, WorkerGroup
from verl_core.workers.ranks import ActorWorker, CriticWorker, TeacherWorker
from verl_core.workers.replicas import REQUEST_CONCURRENCY, RolloutReplicas, RolloutReplicaWorker
from verl_core.workers.roles import Actor, Critic, Teacher

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
    """Where the roles run, for the console: ``in process``, ``2 rank(s) under a local Ray cluster``,
    with the separate rollout replicas."""
    trainer = config.trainer
    replicas = ""
    if config.rollout.placement == "separate":
        replicas = f" and {config.rollout.replicas} rollout replica(s)"
    if trainer.workers == "in_process":
        return f"in process{replicas}"
    cluster = f"the Ray cluster at {trainer.ray_address}" if trainer.ray_address else "a local Ray cluster"
    return f"{trainer.world_size} rank(s) each{replicas} under {cluster}"


@attrs.frozen
class GroupSpec:
    """One worker group to start: its role's name, how a rank builds its worker, the device its
    engine computes on (an ``EngineConfig.device``), its ranks, the Ray resources each asks for
    (``None``: ``rank_demand``'s default) and the config key that sets them, for messages."""

    role: str
    make_worker: Any
    device: str = "cpu"
    world_size: int | None = None
    resources: dict[str, float] | None = None
    resources_key: str = "trainer.world_size"
    #: Calls a rank serves at once under Ray (``RayWorkerGroup``).
    max_concurrency: int = 1


def worker_group(config: RunConfig, role: str, make_worker: Any, device: str = "cpu") -> WorkerGroup:
    """The worker group ``trainer.workers`` says for ``role``, whose engine computes on ``device``
    (an ``EngineConfig.device``: under Ray, a CUDA engine gets one GPU per rank and NCCL)."""
    (group,) = worker_groups(config, [GroupSpec(role, make_worker, device)])
    return group


def worker_groups(config: RunConfig, specs: list[GroupSpec]) -> list[WorkerGroup]:
    """The worker group of each spec (``trainer.world_size`` ranks unless it says); under Ray, the
    placement checked against the cluster first (``verl_core.workers.placement``: a ``ConfigError``
    at the key that sets the resources), then the groups started side by side (``start_together``),
    not one after the other. If one fails, the others are released."""
    if config.trainer.workers == "in_process":
        return [InProcessWorkerGroup(spec.role, spec.make_worker) for spec in specs]
    from verl_core.engine.device import device_type
    from verl_core.workers.placement import Demand, cluster_nodes, placement_problems
    from verl_core.workers.ray_group import RayWorkerGroup, ensure_ray, rank_demand, start_together

    devices = [device_type(spec.device, f"{spec.role}.engine.device") for spec in specs]
    sizes = [spec.world_size or config.trainer.world_size for spec in specs]
    demands = [
        Demand(f"{spec.role} rank {rank}", spec.resources_key, rank_demand(device, spec.resources))
        for spec, device, size in zip(specs, devices, sizes, strict=True)
        for rank in range(size)
    ]
    # The first call of the run: it starts a local cluster.
    ray = ensure_ray(config.trainer.ray_address, config.trainer.ray_object_store_megabytes)
    problems = placement_problems(demands, cluster_nodes(ray))
    if problems:
        raise ConfigError(problems)
    groups = []
    try:
        for spec, device, size in zip(specs, devices, sizes, strict=True):
            group = RayWorkerGroup(
                spec.role,
                spec.make_worker,
                world_size=size,
                address=config.trainer.ray_address,
                device=device,
                liveness_timeout_s=config.trainer.worker_timeout_s,
                wait=False,
                resources=spec.resources,
                max_concurrency=spec.max_concurrency,
            )
            groups.append(group)
        start_together(groups)
    except BaseException:
        for group in groups:
            group.shutdown()
        raise
    return groups


@attrs.frozen
class Roles:
    """A run's roles, their engines initialised on every rank: the actor, the critic (with
    ``critic.enable``), the separate rollout replicas (with ``rollout.placement=separate``) and the
    distillation teachers placed apart from the actor, by name."""

    actor: Actor
    critic: Critic | None = None
    replicas: RolloutReplicas | None = None
    teachers: dict[str, Teacher] = attrs.field(factory=dict)

    def shutdown(self) -> None:
        for role in (self.actor, self.critic, self.replicas, *self.teachers.values()):
            if role is not None:
                role.shutdown()


def replica_specs(config: RunConfig, registry: Any = None) -> list[GroupSpec]:
    """The worker groups of ``rollout.replicas`` separate rollout replicas, one rank each."""
    return [
        GroupSpec(
            f"rollout replica {replica}",
            WorkerMaker(RolloutReplicaWorker, config, registry),
            world_size=1,
            resources=dict(config.rollout.replica_resources),
            resources_key="rollout.replica_resources",
            max_concurrency=REQUEST_CONCURRENCY,
        )
        for replica in range(config.rollout.replicas)
    ]


def build_roles(config: RunConfig, registry: Any = None) -> Roles:
    """The actor, the critic (with ``critic.enable``), the rollout replicas (with
    ``rollout.placement=separate``) and the distillation teachers placed apart from the actor, their
    engines and rollouts initialised."""
    ranks = {"resources": config.trainer.rank_resources, "resources_key": "trainer.rank_resources"}
    specs = [
        GroupSpec("actor", WorkerMaker(ActorWorker, config, registry), config.actor.engine.device, **ranks)
    ]
    if config.critic.enable:
        specs.append(
            GroupSpec(
                "critic", WorkerMaker(CriticWorker, config, registry), config.critic.engine.device, **ranks
            )
        )
    trained = len(specs)  # the groups that write checkpoints and the export
    separate_teachers = [
        name for name, teacher in config.distillation.teachers.items() if teacher.placement == "separate"
    ]
    specs += [
        GroupSpec(
            f"teacher {name}",
            WorkerMaker(TeacherWorker, config, registry, name),
            config.distillation.teachers[name].engine.device,
            **ranks,
        )
        for name in separate_teachers
    ]
    separate = config.rollout.placement == "separate"
    if separate:
        specs += replica_specs(config, registry)
    groups: list[WorkerGroup] = []
    try:
        if config.trainer.workers == "in_process":  # one process: each role built and initialised in turn
            for spec in specs:
                groups += worker_groups(config, [spec])
        else:
            groups = worker_groups(config, specs)
        if config.trainer.workers == "ray":
            check_shared_folders(config, groups[:trained])
        # Group shutdowns are idempotent: on a failure below, every group is released once more.
        actor = Actor(groups[0])
        critic = Critic(groups[1]) if config.critic.enable else None
        teachers = {
            name: Teacher(group)
            for name, group in zip(
                separate_teachers, groups[trained : trained + len(separate_teachers)], strict=True
            )
        }
        replicas = RolloutReplicas(groups[len(specs) - config.rollout.replicas :]) if separate else None
    except BaseException:  # an engine that failed to initialise: release every rank
        for group in groups:
            group.shutdown()
        raise
    return Roles(actor, critic, replicas, teachers)


def check_shared_folders(config: RunConfig, groups: list[Any]) -> None:
    """On a cluster of several nodes, the folders the ranks of ``groups`` write into (checkpoint shards,
    the export) must be the driver's: a ``ConfigError`` at the key of a folder a node does not see
    (``verl_core.workers.shared_files``)."""
    from verl_core.workers.placement import cluster_nodes
    from verl_core.workers.ray_group import ensure_ray
    from verl_core.workers.shared_files import unshared_folders, writing_nodes

    ray = ensure_ray(config.trainer.ray_address)
    if len(cluster_nodes(ray)) < 2:
        return
    trainer = config.trainer
    folders = {}
    if trainer.save_freq:
        folders["trainer.checkpoint_dir"] = absolute_path(trainer.checkpoint_dir)
    if trainer.save_hf_model:
        folders["trainer.run_dir"] = absolute_path(trainer.run_dir)
    problems = unshared_folders(ray, folders, writing_nodes(groups)) if folders else []
    if problems:
        raise ConfigError(problems)


class WorkerMaker:
    """A picklable ``make_worker`` for a worker class (Ray ships it to each rank's process).

    It holds ``config`` with every path made absolute here, on the driver: a rank's process may run
    in another folder (on a cluster started with ``ray start``, the folder where that ran)."""

    def __init__(self, worker_class: type, config: RunConfig, registry: Any, *args: Any):
        self.worker_class, self.config, self.args = worker_class, absolute_paths(config), args
        # A registry is a process's own discovery: Ray ranks discover the installed plugins again.
        self.registry = registry if config.trainer.workers == "in_process" else None

    def __call__(self) -> Any:
        if self.config.trainer.workers == "ray":  # a rank's own process: the run's console is the driver's
            quiet_progress_bars()
        if self.config.trainer.reuses_freed_memory(self.config.actor.engine.device):
            keep_freed_memory()
        return self.worker_class(self.config, self.registry, *self.args)


def quiet_progress_bars() -> None:
    """No ``transformers`` progress bars (loading weights, writing shards) in this process: a run's
    console says what it does in its own lines (``trainer.console``)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
