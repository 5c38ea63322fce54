"""The run config: one attrs class per section of a training run's YAML file.

To extend a section, add a field with a default (and a validator from ``verl_core.config.validators``
where a range applies); to add a section, add a class here and a field to ``RunConfig``. Loading,
overrides, error reporting and unstructuring need no other change; list the key in docs/config.md
(a test checks the tables). Rules that relate fields go in a ``check()`` method yielding
``(relative.path, message)``; options that the run will ignore, given the other fields, in an
``ignored()`` method yielding the same, which become ``ConfigWarning`` s.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import attrs

from verl_core.config.algorithm import AlgorithmConfig, CriticLossConfig, PolicyLossConfig
from verl_core.config.engine import DtypeName, EngineConfig, ModelConfig
from verl_core.config.names import current_registry, functions_file_problem, registered, registered_list
from verl_core.config.validators import (
    InvalidValue,
    each_rule,
    in_range,
    non_empty,
    non_negative,
    positive,
    unit_interval,
)
from verl_core.descriptors import Choice, RolloutCapabilities
from verl_core.errors import VerlCoreError
from verl_core.hookspecs import Kind

if TYPE_CHECKING:
    from verl_core.plugins import Registry


class OldLogProbsSource(Choice):
    """Where a step's old log-probs come from (``RunConfig.old_log_probs_source`` says when each)."""

    #: Recomputed by the training engine before the update.
    ENGINE = "engine"
    #: The update's own forward pass, detached.
    UPDATE = "update"
    #: The rollout's log-probs of its sampled tokens.
    ROLLOUT = "rollout"


#: Whether the RL trainer's cross-section rules apply to the config being loaded: ``load_config``
#: switches them off for SFT (``rl_rules=False``), which reads no estimator, rollout group or PPO
#: mini-batch.
RL_RULES: contextvars.ContextVar[bool] = contextvars.ContextVar("rl_rules", default=True)


@attrs.define
class ActorConfig:
    """The ``actor`` section: the policy's engine, its loss, and how a batch becomes PPO updates."""

    engine: EngineConfig
    policy_loss: PolicyLossConfig = attrs.field(factory=PolicyLossConfig)
    #: Prompts per optimiser step (each with its ``rollout.n`` responses); divides ``data.train_batch_size``.
    ppo_mini_batch_size: int = attrs.field(default=8, validator=positive)
    #: Passes over each generated batch.
    ppo_epochs: int = attrs.field(default=1, validator=positive)


@attrs.define
class RefConfig:
    """The ``ref`` section: the frozen reference policy of the KL terms.

    ``engine: null`` (the default) gives the reference the actor's engine config; see
    ``RunConfig.ref_engine``. It is used only when a KL term is on. With a LoRA actor
    (``actor.engine.model.lora_rank``) and ``engine: null`` the actor's own engine serves the
    reference, its adapter disabled (docs/lora.md).
    """

    engine: EngineConfig | None = None


@attrs.define
class CriticConfig:
    """The ``critic`` section: the value model trained next to the actor (needed by ``gae``)."""

    enable: bool = False
    engine: EngineConfig | None = None
    loss: CriticLossConfig = attrs.field(factory=CriticLossConfig)

    def check(self) -> Iterator[tuple[str, str]]:
        if self.enable and self.engine is None:
            yield "engine", "required when critic.enable is true: give it backend and model like actor.engine"
        if self.engine is not None and (problem := self.engine.model.lora_role_problem("value")) is not None:
            key, message = problem
            yield f"engine.model.{key}", message

    def ignored(self) -> Iterator[tuple[str, str]]:
        if self.engine is not None and not self.enable:
            yield (
                "engine",
                "ignored: critic.enable is false, so no critic is trained; set critic.enable=true to "
                "train one, or remove critic.engine",
            )


def _tools_file(attribute: attrs.Attribute, value: str | None) -> None:
    problem = None if value is None else functions_file_problem(value)
    if problem is not None:
        raise InvalidValue(attribute.name, problem)


@attrs.define
class AgentConfig:
    """The ``rollout.agent`` section: multi-turn rollouts with an environment (docs/agents.md).

    Off by default (no ``environment``): one model turn per response, as before.
    """

    #: A registered environment (``verl-core plugins --all``; core's ``tools`` runs the functions of
    #: ``tools``); ``None``: single-turn rollouts.
    environment: str | None = registered(Kind.ENVIRONMENTS, None)  # type: ignore[arg-type]
    #: For the ``tools`` environment: a ``.py`` file whose public functions are the tools the model
    #: may call (a relative path is relative to the working directory).
    tools: str | None = attrs.field(
        default=None, validator=lambda _, attribute, value: _tools_file(attribute, value)
    )
    #: Model turns per conversation at most (the environment answers between them).
    max_turns: int = attrs.field(default=4, validator=positive)
    #: Tokens one model turn may generate; 0: whatever is left of ``rollout.response_length``, the
    #: budget of the whole response (model and environment tokens).
    max_tokens_per_turn: int = attrs.field(default=0, validator=non_negative)
    #: An environment message that does not fit in the response budget: ``end`` the conversation
    #: without it, or ``truncate`` it to the tokens that fit (the conversation ends either way).
    on_overflow: Literal["end", "truncate"] = "end"
    #: Seconds one tool call may run; a call that takes longer is answered with an error message.
    tool_timeout_s: float = attrs.field(default=10.0, validator=positive)
    #: Environments that step at once, each in a thread of its own (the conversations of a step are
    #: independent; ``step`` is synchronous user code); 1: one after another.
    environment_threads: int = attrs.field(default=32, validator=positive)
    #: Seconds one environment ``step`` may run before the run ends with an error naming its conversation
    #: (a step that never returns would hold the run forever). Core's ``tools`` environment is bounded by
    #: ``tool_timeout_s`` per call instead.
    step_timeout_s: float = attrs.field(default=600.0, validator=positive)
    #: The environment's own options (the adapters' server ``url``, ``command``, ...: docs/agents.md), checked
    #: against the options class its descriptor names before the run starts.
    options: dict[str, Any] = attrs.field(factory=dict)

    def ignored(self) -> Iterator[tuple[str, str]]:
        if self.environment is None and self.tools is not None:
            yield "tools", "ignored: rollout.agent.environment is not set; set it to 'tools' to use them"
        if self.environment is None and self.options:
            yield "options", "ignored: rollout.agent.environment is not set"


def _resources(attribute: attrs.Attribute, value: dict[str, float]) -> None:
    for name, amount in value.items():
        if not name:
            raise InvalidValue(attribute.name, "a resource needs a name (CPU, GPU or a custom resource)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
            raise InvalidValue(f"{attribute.name}.{name}", f"must be a number >= 0, got {amount!r}")


@attrs.define
class RolloutConfig:
    """The ``rollout`` section: how responses are generated, and by which rollout backend.

    Like an engine section, the backend's own options sit under a key named after it (``hf: {...}``)
    and are structured into its config class (``RolloutBackend.config``).
    """

    #: Name of a registered rollout backend (``verl-core plugins --all`` lists them).
    backend: str = "hf"
    #: The backend's own options: an instance of its config class; ``None`` (in Python): its defaults.
    options: Any = None
    #: Responses per prompt.
    n: int = attrs.field(default=1, validator=positive)
    temperature: float = attrs.field(default=1.0, validator=positive)
    top_p: float = attrs.field(default=1.0, validator=in_range(0, 1, include_low=False))
    #: Sample among the ``top_k`` most likely tokens; 0 disables.
    top_k: int = attrs.field(default=0, validator=non_negative)
    #: Longest prompt, in tokens (longer ones are filtered out); generated tokens per response at most.
    prompt_length: int = attrs.field(default=512, validator=positive)
    response_length: int = attrs.field(default=512, validator=positive)
    #: The dtype the rollout's model generates in (``float32``, ``bfloat16``, ``float16``); ``None``:
    #: the actor's, ``actor.engine.model.dtype``. In another dtype than the actor's, the rollout samples
    #: from a slightly different distribution than the engine trains, so the old log-probs are the
    #: engine's (``RunConfig.old_log_probs_source``).
    dtype: DtypeName | None = None
    #: The weight sync after every update: the engine's weights travel to the rollout in buckets of about
    #: this many MiB, each checked on arrival (``verl_core.rollout.buckets``; verl's key of the same name);
    #: a tensor larger than a bucket travels alone. 0: one tensor at a time (``update_weights``), unchecked.
    update_weights_bucket_megabytes: int = attrs.field(default=512, validator=non_negative)
    #: Put the rollout to sleep after it generates (``BaseRollout.sleep``: a backend that declares ``sleep``
    #: frees its KV cache, and where it can its weights, while the actor trains) and wake it before the
    #: weight sync or its next generation (verl's key of the same name). Others do nothing on it.
    free_cache_engine: bool = True
    #: Multi-turn rollouts with an environment (tools); off unless ``agent.environment`` is set.
    agent: AgentConfig = attrs.field(factory=AgentConfig)
    #: Where the rollout runs: ``colocated``, in the actor's processes (it generates while the actor's
    #: engines wait, and takes the weights in memory), or ``separate``, as ``replicas`` processes of its
    #: own (Ray actors; threads of the driver with ``trainer.workers=in_process``) that the weights travel
    #: to after every update. ``async_training`` needs ``separate``.
    placement: Literal["colocated", "separate"] = "colocated"
    #: How the weights travel to separate replicas (``verl-core plugins --all`` lists the transports);
    #: ``None``: ``object_store`` under Ray, ``memory`` in process.
    weight_transport: str | None = registered(Kind.WEIGHT_TRANSPORTS, None)  # type: ignore[arg-type]
    #: Separate rollout processes; the prompts of a generation are split over them as over DP ranks.
    replicas: int = attrs.field(default=1, validator=positive)
    #: The Ray resources each replica asks for (``CPU``, ``GPU``, or a custom resource a node was
    #: started with, to choose its node); the placement is checked against the cluster before anything
    #: starts.
    replica_resources: dict[str, float] = attrs.field(
        factory=lambda: {"CPU": 1.0}, validator=lambda _, attribute, value: _resources(attribute, value)
    )

    def ignored(self) -> Iterator[tuple[str, str]]:
        if self.placement == "colocated":
            for key in ("replicas", "replica_resources", "weight_transport"):
                default = attrs.fields_dict(RolloutConfig)[key].default
                default = default.factory() if isinstance(default, attrs.Factory) else default
                if getattr(self, key) != default:
                    yield key, "ignored: rollout.placement is 'colocated'; set it to 'separate' for replicas"


@attrs.define
class DataConfig:
    """The ``data`` section: the prompt datasets and how they are batched (docs/training.md)."""

    #: ``.parquet`` or ``.jsonl`` files, read in order (a relative path is relative to the working directory).
    train_files: list[str] = attrs.field(factory=list)
    val_files: list[str] = attrs.field(factory=list)
    #: Prompts per training step, over all data-parallel ranks (each prompt gets ``rollout.n`` responses).
    train_batch_size: int = attrs.field(default=8, validator=positive)
    #: Prompts per validation batch; ``None``: the whole validation set at once.
    val_batch_size: int | None = attrs.field(default=None, validator=positive)
    #: Column holding the prompt: a string, or a list of chat messages; the other columns reach the reward.
    prompt_key: str = attrs.field(default="prompt", validator=non_empty)
    #: Column holding the response of SFT datasets.
    response_key: str = attrs.field(default="response", validator=non_empty)
    #: Render prompts with the tokenizer's chat template (a string prompt becomes one user message).
    apply_chat_template: bool = False
    #: Drop prompts longer than ``rollout.prompt_length`` (counted in the log); ``False``: such a prompt
    #: is an error naming its row.
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    #: Seed of the shuffling order.
    seed: int = 0


#: The default object store of a local Ray cluster (Ray's own would take 30% of the machine's memory).
LOCAL_OBJECT_STORE_MEGABYTES = 256


@attrs.define
class TrainerConfig:
    """The ``trainer`` section: run length, evaluation, checkpoints, logging."""

    total_epochs: int = attrs.field(default=1, validator=positive)
    #: Stop after this many steps; ``None`` runs ``total_epochs`` full epochs.
    total_training_steps: int | None = attrs.field(default=None, validator=positive)
    #: Save a checkpoint / validate every this many steps; 0 disables.
    save_freq: int = attrs.field(default=0, validator=non_negative)
    test_freq: int = attrs.field(default=0, validator=non_negative)
    checkpoint_dir: str = attrs.field(default="checkpoints", validator=non_empty)
    #: ``auto``: resume from the latest checkpoint in ``checkpoint_dir`` if any; ``disable``: start
    #: fresh; ``resume_path``: resume from ``resume_from_path``.
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    #: Keep the newest this many checkpoints in ``checkpoint_dir``; 0 keeps all.
    max_checkpoints: int = attrs.field(default=0, validator=non_negative)
    seed: int = 0
    #: Metric sinks besides ``run_dir/metrics.jsonl`` (always written), each a registered sink
    #: (``verl-core plugins --all``): ``console``, ``tensorboard``, ``wandb``, ``mlflow``, ``trackio``.
    logger: list[str] = registered_list(Kind.METRIC_SINKS, ["console"])
    #: The run folder: ``metrics.jsonl``, TensorBoard events, validation samples, ``curves.png``, the final export.
    run_dir: str = attrs.field(default="runs/latest", validator=non_empty)
    #: Where the roles run: ``ray`` (a worker group of Ray actors) or ``in_process`` (one rank, no Ray).
    workers: Literal["ray", "in_process"] = "ray"
    #: Ranks (processes) per role's worker group under Ray: the engines' world size.
    world_size: int = attrs.field(default=1, validator=positive)
    #: An existing Ray cluster to join (``ray://host:port`` or ``host:port``); ``None`` starts a local one.
    ray_address: str | None = None
    #: Under Ray, the resources each rank of the actor and the critic asks for (``CPU``, ``GPU``, or a
    #: custom resource a node was started with, to choose its node); ``None``: one GPU per rank of an
    #: engine on CUDA and nothing else (the ranks share a node's cores).
    rank_resources: dict[str, float] | None = attrs.field(
        default=None, validator=lambda _, attribute, value: value is None or _resources(attribute, value)
    )
    #: Recompute the old log-probs with the training engine before the update even with one update per
    #: batch (one mini-batch, one epoch), where the rollout's own (or, with ``rollout.dtype`` set, the
    #: update's) are the same policy's. A recompute also logs how far the rollout's are from them.
    recompute_old_log_probs: bool = False
    #: Validation: responses per prompt (``k`` of mean@k and pass@k) and their sampling temperature
    #: (0: greedy).
    val_n: int = attrs.field(default=1, validator=positive)
    val_temperature: float = attrs.field(default=0.0, validator=non_negative)
    #: Validation generations written to ``run_dir/validation/step_N.jsonl`` each time.
    val_samples_logged: int = attrs.field(default=8, validator=non_negative)
    #: Write a Hugging Face export of the policy to ``run_dir/hf_model`` at the end of the run.
    save_hf_model: bool = True
    #: Under Ray, a rank that does not answer a liveness check for this many seconds (a stopped or
    #: hung process) stops the run, naming its role and rank; 0 waits for ever.
    worker_timeout_s: float = attrs.field(default=30.0, validator=non_negative)
    #: The object store of the local Ray cluster a run starts (not of one at ``ray_address``, which has
    #: its own), in MiB: the weights travel to separate rollout replicas through it, a policy version
    #: per batch generated ahead (``async_training.max_staleness`` + 1 at most); what does not fit
    #: spills to disk.
    ray_object_store_megabytes: int = attrs.field(default=LOCAL_OBJECT_STORE_MEGABYTES, validator=positive)
    #: The experiment trackers' project (wandb's project, MLflow's experiment, trackio's project).
    project_name: str = attrs.field(default="verl-core", validator=non_empty)
    #: The run's name in the trackers; ``None``: the run folder's name.
    experiment_name: str | None = None
    #: Where the ``mlflow`` sink records: a tracking server (``http://127.0.0.1:5000``) or a store
    #: (``sqlite:////path/mlflow.db``); ``None``: ``run_dir/mlflow.db``.
    tracking_uri: str | None = None
    #: Each worker process's memory allocator keeps freed memory for the next allocation instead of
    #: giving large blocks back to the OS (``verl_core.toolkit.allocator``; Linux with glibc): a step then
    #: reuses the last one's pages rather than page-faulting its tensors anew (10% of a CPU update's
    #: forward and backward on SmolLM2-135M); the process's resident memory stays at its peak.
    #: ``auto``: where the actor's engine runs on the CPU (on a GPU node the host's freed memory, a
    #: gathered checkpoint's say, is given back).
    reuse_freed_memory: Literal["auto", True, False] = "auto"

    def reuses_freed_memory(self, device: str) -> bool:
        """Whether worker processes keep freed memory, for a run whose actor computes on ``device``."""
        return device == "cpu" if self.reuse_freed_memory == "auto" else bool(self.reuse_freed_memory)

    def check(self) -> Iterator[tuple[str, str]]:
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            yield (
                "resume_from_path",
                "required when resume_mode is 'resume_path': set the checkpoint to resume",
            )

    def ignored(self) -> Iterator[tuple[str, str]]:
        # Warnings, not errors: one override (trainer.workers=in_process) switches a Ray config.
        if self.workers == "in_process" and self.world_size != 1:
            yield (
                "world_size",
                f"ignored: in-process workers run one rank, not {self.world_size}; set trainer.workers=ray "
                f"for {self.world_size} ranks",
            )
        if self.workers == "in_process" and self.ray_address:
            yield (
                "ray_address",
                "ignored: trainer.workers is 'in_process' (no Ray); set trainer.workers=ray to join the cluster",
            )
        if self.ray_address and self.ray_object_store_megabytes != LOCAL_OBJECT_STORE_MEGABYTES:
            yield (
                "ray_object_store_megabytes",
                "ignored: the cluster at trainer.ray_address has its own object store "
                "(ray start --object-store-memory on its nodes)",
            )
        if self.resume_from_path and self.resume_mode != "resume_path":
            yield (
                "resume_from_path",
                f"ignored: resume_mode is {self.resume_mode!r}; set trainer.resume_mode=resume_path to "
                "resume from this checkpoint, or remove it",
            )


@attrs.define
class RewardConfig:
    """The ``reward`` section: how generated responses are scored.

    ``function`` is checked when the config loads without running or importing anything: a name is
    looked up in the registry, a file is parsed for the function.
    """

    #: A registered reward function (``verl-core plugins --all``), or a function in your own file,
    #: ``path/to/file.py:function_name`` (a relative path is relative to the working directory).
    function: str = registered(Kind.REWARD_FUNCTIONS, "exact_match", files=True)
    #: A reward function that raises: ``fail`` stops the run naming the sample; ``zero`` scores it 0.
    on_error: Literal["fail", "zero"] = "fail"


@attrs.define
class AsyncTrainingConfig:
    """The ``async_training`` section: whether generation waits for training (docs/training.md, "Asynchronous
    training"). Off-policy modes need ``rollout.placement=separate``: the replicas generate the next
    batches while the actor trains on this one.

    Staleness is counted in policy versions (the number of updates behind the weights a sample was
    generated with): batch ``s`` is trained by the update from version ``s - 1``, and generated from
    version ``max(s - 1 - max_staleness, c)``, where ``c`` is the last checkpointed step before ``s`` (a
    checkpoint is a barrier: the batch after it is generated from the checkpoint's weights, in the run
    as after a resume from it, which makes resume exact).
    """

    #: ``sync``: generate, then train (staleness 0); ``one_step_off``: generate batch s+1 while batch s
    #: trains (staleness 1); ``async``: generate up to ``max_staleness`` batches ahead of training.
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    #: In ``async`` mode, how many policy versions behind the trained policy the samples are (exactly:
    #: batch ``s`` comes from version ``s - 1 - max_staleness``, see above); 0 is ``sync``'s run, bitwise.
    max_staleness: int = attrs.field(default=1, validator=non_negative)
    #: Partial rollouts: the responses still generating when newer weights are published are aborted
    #: and resumed under them (each token keeps the version that generated it), and each batch starts
    #: from the newest weights it may use, so a batch is at most, not exactly, the staleness behind. The
    #: run then depends on timing: it is not reproducible, and resume is not exact. Needs a rollout backend
    #: that declares ``abort_resume``; single-turn rollouts only.
    partial_rollout: bool = False

    @property
    def staleness(self) -> int:
        """The policy versions a batch lags in this mode (before barriers)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    def ignored(self) -> Iterator[tuple[str, str]]:
        if self.mode == "sync" and self.partial_rollout:
            yield (
                "partial_rollout",
                "ignored: async_training.mode is 'sync', whose batches never wait for weights",
            )
        if self.mode != "async" and self.max_staleness != 1:
            yield (
                "max_staleness",
                f"ignored: async_training.mode is {self.mode!r} (staleness {self.staleness}); set it to "
                "'async' for a staleness of your choice",
            )


@attrs.define
class TeacherConfig:
    """One teacher of ``distillation.teachers``: a model the student learns from, served by any engine
    backend in inference mode (forward passes only: it never steps, so its optimiser holds no state, and
    it has no reference). Its tokenizer must be the student's (docs/distillation.md)."""

    #: The teacher's backend and model, as ``actor.engine`` (``engine.model.path``: its folder).
    engine: EngineConfig
    #: GKD: the teacher's ``top_k`` likeliest tokens at each response position, which the student's
    #: distribution is compared over (needs a backend that declares ``EngineBackend(top_k_log_probs=True)``).
    #: 0: its log-probs of the sampled tokens only (``distillation.loss: reverse_kl``).
    top_k: int = attrs.field(default=0, validator=non_negative)
    #: ``colocated``: in the actor's processes (as the reference policy); ``separate``: ranks of its
    #: own (``trainer.world_size`` of them under Ray, with ``trainer.rank_resources``).
    placement: Literal["colocated", "separate"] = "colocated"


@attrs.define
class DistillationConfig:
    """The ``distillation`` section: on-policy distillation from one or more teachers (docs/distillation.md).

    The student samples as in RL; each teacher scores the sampled responses of the rows routed to it.
    ``loss: reverse_kl`` gives every sampled token ``coef * (log pi_teacher - log pi_student)``: added to
    its advantage after the estimator (``reverse_kl_as: advantage``), or to its reward before it
    (``reward``); ``loss: gkd`` adds ``coef`` times GKD's generalised Jensen-Shannon divergence over the
    teacher's ``top_k`` tokens to the actor's loss. The task reward (``reward.function``) counts
    ``task_reward_coef`` times; 0 distills alone.
    """

    #: The teachers by name; none (the default): no distillation.
    teachers: dict[str, TeacherConfig] = attrs.field(factory=dict)
    loss: Literal["reverse_kl", "gkd"] = "reverse_kl"
    #: The weight of the distillation signal (the per-token reverse KL, or the GKD loss).
    coef: float = attrs.field(default=1.0, validator=non_negative)
    #: The weight of the task reward beside it: of its advantages (with ``reverse_kl_as: advantage`` and
    #: GKD), or of its rewards (``reward``); 1 mixes both signals, 0 distills alone.
    task_reward_coef: float = attrs.field(default=1.0, validator=non_negative)
    #: ``reverse_kl``'s per-token signal: ``advantage`` adds it to each token's advantage after the
    #: estimator (each token judged by its own log-ratio, as tinker-cookbook and slime do); ``reward``
    #: adds it to the token-level rewards before the estimator, which then treats it like any reward (an
    #: outcome estimator such as ``grpo`` sums a response's, which favours short responses).
    reverse_kl_as: Literal["advantage", "reward"] = "advantage"
    #: GKD's interpolation: 0 the forward KL(teacher || student), 1 the reverse KL(student || teacher).
    beta: float = attrs.field(default=0.5, validator=unit_interval)
    #: A data column naming each row's teacher (a key of ``teachers``): required with several teachers;
    #: ``null`` with one, which scores every row.
    route_by: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.teachers)

    def check(self) -> Iterator[tuple[str, str]]:
        if self.loss == "gkd":
            for name, teacher in self.teachers.items():
                if teacher.top_k == 0:
                    yield (
                        f"teachers.{name}.top_k",
                        "0: distillation.loss gkd compares the student with the teacher over the teacher's "
                        "top_k likeliest tokens: set top_k (e.g. 32), or use distillation.loss=reverse_kl",
                    )
            sizes = {teacher.top_k for teacher in self.teachers.values()}
            if len(sizes) > 1:
                yield (
                    "teachers",
                    f"top_k differs between teachers ({', '.join(f'{n}: {t.top_k}' for n, t in self.teachers.items())}): "
                    "GKD compares every row over the same number of tokens; give every teacher one top_k",
                )
        if len(self.teachers) > 1 and self.route_by is None:
            yield (
                "route_by",
                f"required with several teachers ({', '.join(self.teachers)}): name the data column whose "
                "value names each row's teacher (e.g. distillation.route_by=data_source)",
            )

    def ignored(self) -> Iterator[tuple[str, str]]:
        if not self.teachers:
            if self.route_by is not None:
                yield "route_by", "ignored: distillation.teachers is empty, so nothing distills"
            return
        if self.loss == "reverse_kl":
            if self.beta != 0.5:
                yield "beta", "ignored: it is GKD's (distillation.loss=gkd); reverse_kl has no beta"
            for name, teacher in self.teachers.items():
                if teacher.top_k:
                    yield (
                        f"teachers.{name}.top_k",
                        "ignored: distillation.loss reverse_kl reads the teacher's log-probs of the sampled "
                        "tokens only; set it to 0, or use distillation.loss=gkd",
                    )
        elif self.reverse_kl_as != "advantage":
            yield (
                "reverse_kl_as",
                "ignored: it is reverse_kl's (distillation.loss=reverse_kl); gkd adds a loss",
            )


@attrs.define
class RunConfig:
    """A whole training run; ``verl_core.config.load_config`` builds it from YAML and overrides."""

    actor: ActorConfig
    ref: RefConfig = attrs.field(factory=RefConfig)
    critic: CriticConfig = attrs.field(factory=CriticConfig)
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    reward: RewardConfig = attrs.field(factory=RewardConfig)
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    data: DataConfig = attrs.field(factory=DataConfig)
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig)
    async_training: AsyncTrainingConfig = attrs.field(factory=AsyncTrainingConfig)
    distillation: DistillationConfig = attrs.field(factory=DistillationConfig)

    @property
    def ref_engine(self) -> EngineConfig:
        """The reference policy's engine config: ``ref.engine``, or else the actor's."""
        return self.ref.engine if self.ref.engine is not None else self.actor.engine

    @property
    def rollout_model(self) -> ModelConfig:
        """The model the rollout is built with: the actor's, in ``rollout.dtype`` when that is set."""
        model = self.actor.engine.model
        dtype = self.rollout.dtype
        return model if dtype is None or dtype == model.dtype else attrs.evolve(model, dtype=dtype)

    def old_log_probs_source(
        self, num_mini_batches: int, registry: Registry | None = None
    ) -> OldLogProbsSource:
        """Where a step's old log-probs (PPO's ratio denominator) come from, with ``num_mini_batches``
        optimiser steps per batch and epoch (``registry`` resolves ``rollout.backend``; default: the
        installed plugins):

        - ``ENGINE``: recomputed by the training engine before the update. Off-policy training
          (``async_training`` with a staleness): the rollout sampled from an older policy, and the
          engine's log-probs are decoupled PPO's proximal policy (the rollout's, the behaviour policy's,
          weigh them with ``rollout_correction``). Several updates per batch
          (mini-batches, epochs) move the policy away from the rollout's before some of them; a rollout
          correction (``actor.policy_loss.rollout_correction``: importance weights or rejection) weighs
          the engine's against the rollout's; a KL penalty in the reward reads them before the update;
          or ``trainer.recompute_old_log_probs`` asks for it.
        - ``UPDATE``: one update, and a rollout whose log-probs are not the engine's
          (``_rollout_matches_engine``: another dtype, ``rollout.dtype``, or an inference engine such as
          vLLM): the update's own forward pass, detached (the policy being updated is the one that
          sampled; the rollout's log-probs differ from the engine's by rounding, which PPO's ratio would
          count as policy change and clip). As TRL and verl do on-policy; it saves a forward pass.
        - ``ROLLOUT``: one update, a rollout that matches the engine: the rollout's own log-probs. And
          always with ``rollout_correction.bypass_mode``, which asks for exactly that.
        """
        correction = self.actor.policy_loss.correction
        if correction.bypass_mode:
            return OldLogProbsSource.ROLLOUT
        mismatch = not self._rollout_matches_engine(registry)
        if (
            self.trainer.recompute_old_log_probs
            or self.async_training.staleness > 0
            or num_mini_batches > 1
            or self.actor.ppo_epochs > 1
            or correction.active
            or (self.algorithm.use_kl_in_reward and mismatch)
        ):
            return OldLogProbsSource.ENGINE
        return OldLogProbsSource.UPDATE if mismatch else OldLogProbsSource.ROLLOUT

    def _rollout_matches_engine(self, registry: Registry | None) -> bool:
        """Whether the rollout's log-probs are the engine's up to float32 rounding: the engine's dtype,
        and a backend that declares the contract's distribution within the built-in decoder's bound
        (``RolloutCapabilities``' defaults). An inference engine declares a looser one (its own kernels,
        batch-dependent reductions); a backend that cannot be looked up counts as not matching."""
        from verl_core.plugins.registry import registry_or_installed

        if self.rollout_model.dtype != self.actor.engine.model.dtype:
            return False
        try:
            backend = registry_or_installed(registry).get(Kind.ROLLOUT_BACKENDS, self.rollout.backend)
        except VerlCoreError:
            return False
        capabilities = backend.capabilities
        exact = RolloutCapabilities()
        return (
            capabilities.log_prob_semantics is exact.log_prob_semantics
            and capabilities.log_prob_tolerance <= exact.log_prob_tolerance
        )

    @property
    def uses_kl(self) -> bool:
        """Whether a KL term to the reference policy is on (in the loss or in the reward)."""
        return self.actor.policy_loss.use_kl_loss or self.algorithm.use_kl_in_reward

    def check(self) -> Iterator[tuple[str, str]]:
        if not RL_RULES.get():
            return
        # Independent rules: each runs on what structured, even when another section has errors.
        yield from each_rule(
            self._mini_batches_divide_the_batch,
            self._groups_to_compare,
            self._values_have_a_critic,
            self._rollout_options_fit_its_model,
            self._rollout_generates_in_its_dtype,
            self._bypass_recomputes_nothing,
            self._off_policy_needs_separate_rollout,
            self._partial_rollouts_abort_and_resume,
            self._transport_works_with_the_workers,
        )

    def _mini_batches_divide_the_batch(self) -> Iterator[tuple[str, str]]:
        batch, mini_batch = self.data.train_batch_size, self.actor.ppo_mini_batch_size
        if batch % mini_batch:
            yield (
                "actor.ppo_mini_batch_size",
                f"must divide data.train_batch_size ({batch}) into whole mini-batches, got {mini_batch}",
            )

    def _estimator(self) -> Any:
        """The descriptor of ``algorithm.adv_estimator``, or None when the name does not resolve (its
        own error is reported at that key)."""
        try:
            return current_registry().get(Kind.ADVANTAGE_ESTIMATORS, self.algorithm.adv_estimator)
        except VerlCoreError:
            return None

    def _groups_to_compare(self) -> Iterator[tuple[str, str]]:
        # One response per prompt leaves a group estimator nothing to compare (zero advantages, or a
        # division by zero).
        estimator = self.algorithm.adv_estimator
        if getattr(self._estimator(), "needs_groups", False) and self.rollout.n < 2:
            yield (
                "rollout.n",
                f"adv_estimator '{estimator}' compares the responses to each prompt: set rollout.n >= 2",
            )

    def _values_have_a_critic(self) -> Iterator[tuple[str, str]]:
        estimator = self.algorithm.adv_estimator
        if getattr(self._estimator(), "needs_values", False) and not self.critic.enable:
            yield (
                "critic.enable",
                f"adv_estimator '{estimator}' needs a critic's values: set critic.enable=true and a "
                "critic.engine, or choose an estimator without a critic (algorithm.adv_estimator=grpo)",
            )

    def _rollout_options_fit_its_model(self) -> Iterator[tuple[str, str]]:
        # A rollout backend's options may check themselves against the model the rollout loads
        # (``check_model``: the built-in hf rollout's forced weight layout against the dtype); the
        # config knows no backend, so it asks any options class that has the method.
        check_model = getattr(self.rollout.options, "check_model", None)
        if check_model is not None:
            dtype_key = "rollout.dtype" if self.rollout.dtype else "actor.engine.model.dtype"
            for key, message in check_model(self.rollout_model.dtype, dtype_key):
                yield f"rollout.{self.rollout.backend}.{key}", message

    def _rollout_generates_in_its_dtype(self) -> Iterator[tuple[str, str]]:
        # A backend declares the dtypes it generates in (RolloutCapabilities.dtypes): another is refused
        # here, before any worker loads a model.
        try:
            backend = current_registry().get(Kind.ROLLOUT_BACKENDS, self.rollout.backend)
        except VerlCoreError:
            return  # an unknown backend is reported at rollout.backend
        dtype, dtypes = self.rollout_model.dtype, backend.capabilities.dtypes
        if dtype not in dtypes:
            key = "rollout.dtype" if self.rollout.dtype else "actor.engine.model.dtype"
            yield (
                key,
                f"rollout backend '{self.rollout.backend}' generates in {', '.join(dtypes)}, not {dtype}: "
                f"set rollout.dtype to one of them (the rollout may differ from the actor's dtype)",
            )

    def _bypass_recomputes_nothing(self) -> Iterator[tuple[str, str]]:
        if self.actor.policy_loss.rollout_correction.bypass_mode and self.trainer.recompute_old_log_probs:
            yield (
                "trainer.recompute_old_log_probs",
                "contradicts actor.policy_loss.rollout_correction.bypass_mode, which takes the rollout's "
                "log-probs as the old ones instead of recomputing them: set one of the two to false",
            )

    def _partial_rollouts_abort_and_resume(self) -> Iterator[tuple[str, str]]:
        if not self.async_training.partial_rollout or self.async_training.mode == "sync":
            return
        if self.rollout.agent.environment is not None:
            yield (
                "async_training.partial_rollout",
                "not available with multi-turn rollouts (rollout.agent) yet: a conversation's turns would need "
                "resuming across a weight update; set it to false",
            )
        try:
            backend = current_registry().get(Kind.ROLLOUT_BACKENDS, self.rollout.backend)
        except VerlCoreError:
            return  # an unknown backend is reported at rollout.backend
        if not backend.capabilities.abort_resume:
            yield (
                "async_training.partial_rollout",
                f"rollout backend '{self.rollout.backend}' does not declare abort_resume (stopping a request "
                "between decoding steps and returning its tokens), which partial rollouts need: choose a "
                "backend that does (hf, vllm), or set it to false",
            )

    @property
    def weight_transport(self) -> str:
        """The weight transport separate replicas use: ``rollout.weight_transport``, or by default
        ``object_store`` under Ray and ``memory`` in process."""
        if self.rollout.weight_transport is not None:
            return self.rollout.weight_transport
        return "object_store" if self.trainer.workers == "ray" else "memory"

    def _transport_works_with_the_workers(self) -> Iterator[tuple[str, str]]:
        if self.rollout.placement != "separate" or self.rollout.weight_transport is None:
            return
        try:
            transport = current_registry().get(Kind.WEIGHT_TRANSPORTS, self.rollout.weight_transport)
        except VerlCoreError:
            return  # an unknown transport is reported at its key
        if self.trainer.workers not in transport.workers:
            yield (
                "rollout.weight_transport",
                f"weight transport '{transport.name}' works with trainer.workers {', '.join(transport.workers)}, "
                f"not {self.trainer.workers}: choose another, or leave it unset for the default",
            )

    def _off_policy_needs_separate_rollout(self) -> Iterator[tuple[str, str]]:
        mode = self.async_training.mode
        if mode != "sync" and self.rollout.placement != "separate":
            yield (
                "async_training.mode",
                f"{mode!r} generates while the actor trains, which a rollout in the actor's processes cannot: "
                "set rollout.placement=separate (and rollout.replicas), or async_training.mode=sync",
            )

    def ignored(self) -> Iterator[tuple[str, str]]:
        if self.ref.engine is not None and not self.uses_kl:
            yield (
                "ref.engine",
                "ignored: no KL term is on (actor.policy_loss.use_kl_loss and algorithm.use_kl_in_reward "
                "are false), so no reference policy runs; turn one on, or remove ref.engine",
            )
