"""The rank side of the roles: what one process of a role's worker group holds and does.

``ActorWorker`` holds the policy engine (role ``lm``), its rollout in the same process, and, when a KL
term needs it, the reference policy (an engine that never steps its optimiser, or the policy's own
engine when it ``serves_reference``: LoRA's base model) and the colocated distillation teachers;
``CriticWorker`` holds a value engine; ``TeacherWorker`` a teacher of its own placement (an engine in
inference mode); ``SFTWorker`` the policy engine alone, for supervised fine-tuning. Each method works
on this rank's share of a batch and is called on every rank of the group together (the engines'
collectives line up); ``verl_core.workers.roles`` splits batches and collects results. Every update
is one loop (``update_engine``): epochs over contiguous mini-batches, one optimiser step each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from verl_core.algos.actor_loss import compute_actor_loss
from verl_core.algos.aggregation import TOKEN_MEAN, agg_loss
from verl_core.algos.distillation import gkd_loss
from verl_core.algos.policy_loss import rollout_log_prob_mismatch
from verl_core.algos.registry import get_policy_loss
from verl_core.algos.rollout_correction import rollout_mismatch_metrics
from verl_core.algos.value_loss import compute_value_loss
from verl_core.config.run import OldLogProbsSource, RunConfig
from verl_core.data.batch import (
    ADVANTAGES,
    CANDIDATE_LOG_PROBS,
    COMPUTE_ENTROPY,
    ENTROPY,
    LOG_PROBS,
    OLD_LOG_PROBS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_K_IDS,
    TEACHER_TOP_K_LOG_PROBS,
    TEMPERATURE,
    TOP_K,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
    VALUES,
    get_global_counts,
    select_rows,
)
from verl_core.descriptors import ModelRole
from verl_core.engine.base import BaseEngine, LossFn
from verl_core.engine.factory import build_engine
from verl_core.engine.topology import Topology
from verl_core.hookspecs import Kind
from verl_core.rollout.base import SamplingParams, unpacks_buckets_in_process
from verl_core.rollout.buckets import weight_buckets
from verl_core.workers.replicas import PublishedWeights, load_transport

#: The bucket size of ``ActorWorker.publish_weights`` when ``rollout.update_weights_bucket_megabytes`` is
#: 0 (separate replicas always take checked buckets).
DEFAULT_BUCKET_MEGABYTES = 512


def engine_topology(engine: BaseEngine) -> Topology:
    return Topology(engine.dp_rank, engine.dp_size, engine.is_output_rank)


def mini_batches(batch: TensorDict, count: int) -> list[TensorDict]:
    """``count`` contiguous mini-batches of this rank's share (every rank makes the same number, so
    global mini-batch ``j`` is the union of every rank's ``j``-th)."""
    return [select_rows(batch, index) for index in torch.arange(batch.batch_size[0]).tensor_split(count)]


def mean_metrics(steps: Sequence[dict[str, float]], prefix: str) -> dict[str, float]:
    names = sorted({name for step in steps for name in step})
    merged = {}
    for name in names:
        values = [step[name] for step in steps if name in step and step[name] is not None]
        key = name if "/" in name else f"{prefix}/{name}"
        merged[key] = sum(values) / len(values) if values else float("nan")
    return merged


def skipped_steps(steps: Sequence[dict[str, float]]) -> float:
    """How many optimizer steps the engine skipped (a non-finite ``grad_norm`` means no update)."""
    norms = [step.get("grad_norm") for step in steps]
    return float(sum(norm is None or not math.isfinite(norm) for norm in norms))


def update_engine(
    engine: BaseEngine, batch: TensorDict, loss_fn: LossFn, num_mini_batches: int, epochs: int, prefix: str
) -> dict[str, float]:
    """``epochs`` passes over this rank's share of ``batch``, ``num_mini_batches`` optimiser steps each:
    the steps' metrics averaged as ``<prefix>/<name>``, and ``<prefix>/skipped_steps``."""
    steps = []
    with engine.train_mode():
        for _ in range(epochs):
            for mini_batch in mini_batches(batch, num_mini_batches):
                steps.append(engine.train_batch(mini_batch, loss_fn))
    metrics = mean_metrics(steps, prefix)
    metrics[f"{prefix}/skipped_steps"] = skipped_steps(steps)
    return metrics


class ActorWorker:
    """One rank of the actor role. ``registry`` resolves backends (default: the installed plugins)."""

    def __init__(self, config: RunConfig, registry: Any = None):
        from verl_core.plugins.registry import registry_or_installed

        registry = registry_or_installed(registry)
        self.config = config
        self.registry = registry
        # Resolved once, in this worker's registry (an in-process run may pass its own).
        self.policy_loss = get_policy_loss(config.actor.policy_loss.loss_mode, registry)
        self.policy = build_engine(config.actor.engine, ModelRole.LM, registry, config_path="actor.engine")
        # The reference never steps: it exists only when a KL term reads its log-probs, and is the
        # policy's own engine when that serves it (LoRA: the adapter disabled), unless ref.engine is set.
        self.ref = None
        self.ref_in_policy = config.uses_kl and config.ref.engine is None and self.policy.serves_reference
        if config.uses_kl and not self.ref_in_policy:
            ref_path = "ref.engine" if config.ref.engine is not None else "actor.engine"
            self.ref = build_engine(config.ref_engine, ModelRole.LM, registry, config_path=ref_path)
        #: The distillation teachers placed in the actor's processes, by name.
        self.teachers = {
            name: build_teacher(config, name, registry)
            for name, teacher in config.distillation.teachers.items()
            if teacher.placement == "colocated"
        }
        #: How the weights travel to separate replicas (loaded when first needed).
        self.transport = None
        #: The colocated rollout; ``None`` with ``rollout.placement=separate`` (replicas of their own
        #: generate, and take the weights from ``publish_weights``).
        self.rollout = None
        #: Whether the rollout sleeps between its generations (``rollout.free_cache_engine``, and a
        #: backend that declares sleep).
        self.rollout_sleeps = False
        if config.rollout.placement == "colocated":
            entry = registry.entry(Kind.ROLLOUT_BACKENDS, config.rollout.backend, where="rollout.backend")
            self.rollout = entry.load("rollout")(
                config.rollout_model,
                config.rollout.options,
                device=str(self.policy.device),
                config_path="rollout",
            )
            self.rollout_sleeps = config.rollout.free_cache_engine and entry.descriptor.capabilities.sleep

    def initialize(self) -> Topology:
        self.policy.initialize()
        for engine in (self.ref, *self.teachers.values()):
            if engine is not None:
                engine.initialize()
        if self.rollout is None:
            return engine_topology(self.policy)
        self.rollout.initialize()
        if self.config.actor.engine.model.lora_adapter_path is not None:
            # The rollout loaded the base model; the policy is the base with the saved adapter.
            self.sync_weights()
        return engine_topology(self.policy)

    # -- generation --------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> TensorDict | None:
        """This rank's share of a generation; ``None`` for an empty share (fewer prompts than DP
        ranks), without asking the rollout, whose contract is at least one prompt."""
        if not prompts:
            return None
        if self.rollout_sleeps:  # waking a rollout that is awake does nothing (the contract)
            self.rollout.wake_up()
        try:
            return self.rollout.generate(prompts, sampling, seed)
        finally:
            if self.rollout_sleeps:  # its cache is free while the actor computes and trains
                self.rollout.sleep()

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's full weights on the CPU under Hugging Face names, on DP rank 0 (every rank
        must call it: gathering sharded weights is a collective)."""
        full = {
            name: tensor.detach().to("cpu").clone() for name, tensor in self.policy.get_per_tensor_param()
        }
        return full if self.policy.dp_rank == 0 and self.policy.is_output_rank else None

    def sync_weights(self) -> None:
        """The trained weights into the rollout (gathering them is a collective on sharded engines): in
        checked buckets of ``rollout.update_weights_bucket_megabytes`` to a rollout that sends them on
        from its own ``update_weights_from_buckets``; one tensor at a time with 0, or to a rollout that
        unpacks buckets here (``unpacks_buckets_in_process``: the built-in ``hf``). A sleeping rollout
        is woken first."""
        if self.rollout_sleeps:
            self.rollout.wake_up()
        params = self.policy.get_per_tensor_param()
        megabytes = self.config.rollout.update_weights_bucket_megabytes
        if megabytes and not unpacks_buckets_in_process(self.rollout):
            self.rollout.update_weights_from_buckets(weight_buckets(params, megabytes << 20))
        else:  # buckets only for a rollout that sends them on (a serving engine's own processes)
            self.rollout.update_weights(params)

    def publish_weights(self) -> PublishedWeights | None:
        """The policy's full weights for separate rollout replicas (``verl_core.workers.replicas``): on DP
        rank 0's output rank, checked buckets of ``rollout.update_weights_bucket_megabytes`` (the default
        size with 0; at most the transport's ``max_bucket_megabytes``) on the CPU, published by the run's
        weight transport (``rollout.weight_transport``), whose handle it returns; ``None`` on the other ranks (every rank must call it: gathering sharded
        weights is a collective)."""
        params = ((name, tensor.detach().to("cpu")) for name, tensor in self.policy.get_per_tensor_param())
        if not (self.policy.dp_rank == 0 and self.policy.is_output_rank):
            for _ in params:  # take part in the gathers
                pass
            return None
        if self.transport is None:
            self.transport = load_transport(self.config, self.registry)
        megabytes = self.config.rollout.update_weights_bucket_megabytes or DEFAULT_BUCKET_MEGABYTES
        megabytes = min(megabytes, self.transport.max_bucket_megabytes or megabytes)
        return self.transport.publish(weight_buckets(params, megabytes << 20))

    # -- log-probs ---------------------------------------------------------------------------------

    def compute_log_probs(self, batch: TensorDict) -> torch.Tensor | None:
        """The policy's log-probs of ``batch``'s responses at the rollout's temperature."""
        return self._log_probs(self.policy, batch)

    def compute_ref_log_probs(self, batch: TensorDict) -> torch.Tensor | None:
        if self.ref_in_policy:
            with self.policy.reference():
                return self._log_probs(self.policy, batch)
        if self.ref is None:
            raise RuntimeError(
                "no reference policy: no KL term is on (actor.policy_loss.use_kl_loss, algorithm.use_kl_in_reward)"
            )
        return self._log_probs(self.ref, batch)

    def compute_teacher_outputs(self, batch: TensorDict, name: str) -> TensorDict | None:
        """Teacher ``name``'s scores of ``batch`` (``teacher_outputs``), a teacher colocated here."""
        return teacher_outputs(self.teachers[name], batch, self.config, name)

    def _log_probs(self, engine: BaseEngine, batch: TensorDict) -> torch.Tensor | None:
        batch = batch.copy()
        batch.set_non_tensor(TEMPERATURE, self.config.rollout.temperature)
        batch.set_non_tensor(COMPUTE_ENTROPY, False)
        with engine.eval_mode():
            outputs = engine.infer_batch(batch).outputs
        return None if outputs is None else outputs[LOG_PROBS]

    # -- update ------------------------------------------------------------------------------------

    def update(self, batch: TensorDict, num_mini_batches: int) -> dict[str, float]:
        """``actor.ppo_epochs`` passes over this rank's share, ``num_mini_batches`` optimiser steps each."""
        policy_config = self.config.actor.policy_loss
        batch = batch.copy()
        batch.set_non_tensor(TEMPERATURE, self.config.rollout.temperature)
        batch.set_non_tensor(COMPUTE_ENTROPY, policy_config.entropy_coeff != 0)
        source = self.config.old_log_probs_source(num_mini_batches, self.registry)
        distillation = self.config.distillation
        gkd = distillation.enabled and distillation.loss == "gkd"

        def loss_fn(
            output: dict[str, torch.Tensor], micro_batch: TensorDict, dp_group: Any
        ) -> tuple[torch.Tensor, dict[str, float]]:
            keys = micro_batch.keys()
            old_log_prob = micro_batch[OLD_LOG_PROBS]
            mismatch = {}
            if source is OldLogProbsSource.UPDATE:  # on-policy, a rollout in another dtype: the engine's
                old_log_prob = output[LOG_PROBS].detach()  # own, before this step
                mismatch = rollout_log_prob_mismatch(
                    old_log_prob=old_log_prob,
                    rollout_log_probs=micro_batch[ROLLOUT_LOG_PROBS],
                    response_mask=micro_batch[RESPONSE_MASK],
                )
            if source is not OldLogProbsSource.ENGINE and ROLLOUT_LOG_PROBS in keys:
                # The trainer has no engine log-probs to compare the rollout's with: this forward pass
                # gives them (the policy that sampled, until the first optimiser step of the batch).
                mismatch |= rollout_mismatch_metrics(
                    old_log_prob=output[LOG_PROBS].detach(),
                    rollout_log_probs=micro_batch[ROLLOUT_LOG_PROBS],
                    response_mask=micro_batch[RESPONSE_MASK],
                )
            loss, metrics = compute_actor_loss(
                log_prob=output[LOG_PROBS],
                old_log_prob=old_log_prob,
                advantages=micro_batch[ADVANTAGES],
                response_mask=micro_batch[RESPONSE_MASK],
                config=policy_config,
                counts=get_global_counts(micro_batch),
                entropy=output.get(ENTROPY),
                ref_log_prob=micro_batch[REF_LOG_PROB] if REF_LOG_PROB in keys else None,
                rollout_log_probs=micro_batch[ROLLOUT_LOG_PROBS] if ROLLOUT_LOG_PROBS in keys else None,
                policy_loss=self.policy_loss,
            )
            if gkd:  # the student at the teacher's top-k ids (the batch's CANDIDATE_IDS), against the teacher
                divergence, gkd_metrics = gkd_loss(
                    candidate_log_probs=output[CANDIDATE_LOG_PROBS],
                    teacher_top_k_log_probs=micro_batch[TEACHER_TOP_K_LOG_PROBS],
                    response_mask=micro_batch[RESPONSE_MASK],
                    beta=distillation.beta,
                    loss_agg_mode=policy_config.loss_agg_mode,
                    counts=get_global_counts(micro_batch),
                )
                loss = loss + distillation.coef * divergence
                metrics |= gkd_metrics
            return loss, metrics | mismatch

        return update_engine(
            self.policy, batch, loss_fn, num_mini_batches, self.config.actor.ppo_epochs, "actor"
        )

    # -- checkpoints -------------------------------------------------------------------------------

    def save_checkpoint(self, path: str, global_step: int) -> None:
        self.policy.save_checkpoint(path, global_step)

    def load_checkpoint(self, path: str) -> int:
        step = self.policy.load_checkpoint(path)
        if self.rollout is not None:
            self.sync_weights()  # the rollout generates with the restored policy
        return step

    def save_hf_model(self, path: str) -> None:
        self.policy.save_hf_model(path)


def build_teacher(config: RunConfig, name: str, registry: Any = None) -> BaseEngine:
    """Distillation teacher ``name``'s engine: an ``lm`` engine of its own backend and model, which only
    ever runs forward passes."""
    where = f"distillation.teachers.{name}.engine"
    return build_engine(config.distillation.teachers[name].engine, ModelRole.LM, registry, config_path=where)


def teacher_outputs(engine: BaseEngine, batch: TensorDict, config: RunConfig, name: str) -> TensorDict | None:
    """A teacher's scores of ``batch``'s responses at the rollout's temperature (the distribution the
    student sampled from): ``TEACHER_LOG_PROBS`` of the sampled tokens and, with its ``top_k``,
    ``TEACHER_TOP_K_LOG_PROBS`` / ``TEACHER_TOP_K_IDS`` (``None`` on ranks that own no outputs)."""
    top_k = config.distillation.teachers[name].top_k
    batch = batch.copy()
    batch.set_non_tensor(TEMPERATURE, config.rollout.temperature)
    batch.set_non_tensor(COMPUTE_ENTROPY, False)
    batch.set_non_tensor(TOP_K, top_k)
    with engine.eval_mode():
        outputs = engine.infer_batch(batch).outputs
    if outputs is None:
        return None
    scores = {TEACHER_LOG_PROBS: outputs[LOG_PROBS]}
    if top_k:
        scores |= {TEACHER_TOP_K_LOG_PROBS: outputs[TOP_K_LOG_PROBS], TEACHER_TOP_K_IDS: outputs[TOP_K_IDS]}
    return TensorDict(scores, batch_size=outputs.batch_size)


class TeacherWorker:
    """One rank of a distillation teacher placed apart from the actor (``placement: separate``)."""

    def __init__(self, config: RunConfig, registry: Any = None, name: str = ""):
        self.config, self.name = config, name
        self.engine = build_teacher(config, name, registry)

    def initialize(self) -> Topology:
        self.engine.initialize()
        return engine_topology(self.engine)

    def compute_outputs(self, batch: TensorDict) -> TensorDict | None:
        return teacher_outputs(self.engine, batch, self.config, self.name)


class CriticWorker:
    """One rank of the critic role: a value engine."""

    def __init__(self, config: RunConfig, registry: Any = None):
        self.config = config
        self.engine = build_engine(
            config.critic.engine, ModelRole.VALUE, registry, config_path="critic.engine"
        )

    def initialize(self) -> Topology:
        self.engine.initialize()
        return engine_topology(self.engine)

    def compute_values(self, batch: TensorDict) -> torch.Tensor | None:
        with self.engine.eval_mode():
            outputs = self.engine.infer_batch(batch).outputs
        return None if outputs is None else outputs[VALUES]

    def update(self, batch: TensorDict, num_mini_batches: int) -> dict[str, float]:
        loss_config = self.config.critic.loss

        def loss_fn(
            output: dict[str, torch.Tensor], micro_batch: TensorDict, dp_group: Any
        ) -> tuple[torch.Tensor, dict[str, float]]:
            return compute_value_loss(
                vpreds=output[VALUES],
                values=micro_batch[VALUES],
                returns=micro_batch[RETURNS],
                response_mask=micro_batch[RESPONSE_MASK],
                config=loss_config,
                counts=get_global_counts(micro_batch),
            )

        return update_engine(
            self.engine, batch, loss_fn, num_mini_batches, self.config.actor.ppo_epochs, "critic"
        )

    def save_checkpoint(self, path: str, global_step: int) -> None:
        self.engine.save_checkpoint(path, global_step)

    def load_checkpoint(self, path: str) -> int:
        return self.engine.load_checkpoint(path)


# -- supervised fine-tuning ---------------------------------------------------------------------------


def nll_loss(
    output: dict[str, torch.Tensor], micro_batch: TensorDict, dp_group: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """The SFT loss contract: this micro-batch's share of the step's token-mean NLL of the responses."""
    loss = agg_loss(
        -output[LOG_PROBS], micro_batch[RESPONSE_MASK], TOKEN_MEAN, get_global_counts(micro_batch)
    )
    return loss, {}


def _teacher_forced(batch: TensorDict) -> TensorDict:
    """``batch`` (a shallow copy) set for the log-likelihood of its own tokens: temperature 1, no entropy."""
    batch = batch.copy()
    batch.set_non_tensor(TEMPERATURE, 1.0)
    batch.set_non_tensor(COMPUTE_ENTROPY, False)
    return batch


class SFTWorker:
    """One rank of the SFT role. ``registry`` resolves backends (default: the installed plugins)."""

    def __init__(self, config: RunConfig, registry: Any = None):
        self.config = config
        self.policy = build_engine(config.actor.engine, ModelRole.LM, registry, config_path="actor.engine")

    def initialize(self) -> Topology:
        self.policy.initialize()
        return engine_topology(self.policy)

    def update(self, batch: TensorDict, num_mini_batches: int) -> dict[str, float]:
        """``num_mini_batches`` optimiser steps over this rank's share: ``sft/loss``, ``sft/grad_norm``,
        ``sft/lr`` (means over the steps) and ``sft/skipped_steps`` (non-finite gradient norms)."""
        return update_engine(self.policy, _teacher_forced(batch), nll_loss, num_mini_batches, 1, "sft")

    def compute_loss(self, batch: TensorDict) -> dict[str, float]:
        """Forward only: ``loss``, the token-mean NLL of the responses of the whole batch (all ranks)."""
        with self.policy.eval_mode():
            result = self.policy.infer_batch(_teacher_forced(batch), nll_loss)
        return {"loss": result.loss}

    # -- checkpoints and export --------------------------------------------------------------------

    def save_checkpoint(self, path: str, global_step: int) -> None:
        self.policy.save_checkpoint(path, global_step)

    def load_checkpoint(self, path: str) -> int:
        return self.policy.load_checkpoint(path)

    def save_hf_model(self, path: str) -> None:
        self.policy.save_hf_model(path)
