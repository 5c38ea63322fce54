"""The RL loop: GRPO, PPO with GAE, RLOO, REINFORCE++, DAPO and relatives, in verl's order.

One training step, as ``train_step`` reads top to bottom: generate ``rollout.n`` responses per prompt,
score them, the old log-probs (the rollout's own when provably exact: one mini-batch, one epoch, the
engine's dtype; otherwise recomputed, and compared with the rollout's: ``rollout/*``), the
reference log-probs (only with a KL term), the critic's values (only with a critic), the distillation
teachers' scores and signal (only with ``distillation.teachers``: ``verl_core.trainer.distillation``), KL
in the reward (optional), the rollout correction (with recomputed old log-probs: the ``rollout_corr/*`` metrics, and
the rejection and weights of ``actor.policy_loss.rollout_correction``), advantages by the configured
estimator, the critic's update, the actor's update, and the trained weights into the rollout. ``fit`` runs the steps, validates every ``test_freq`` steps, saves a
checkpoint every ``save_freq`` steps and resumes from the newest one.

The roles are ``verl_core.workers.roles.Actor`` / ``Critic`` over any worker group (Ray actors, or in
process); the trainer only ever holds whole batches and materialised results.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from tensordict import TensorDict

from verl_core.agents.loop import Conversation
from verl_core.agents.session import (
    build_agent_loop,
    close_environment_factory,
    conversation_metrics,
    import_tools_file,
    request_conversations,
    run_conversations,
    start_environment,
    turns,
)
from verl_core.algos.kl import apply_kl_penalty, build_kl_controller
from verl_core.algos.policy_loss import rollout_log_prob_mismatch
from verl_core.algos.registry import get_advantage_estimator
from verl_core.algos.rollout_correction import compute_rollout_correction
from verl_core.config.run import OldLogProbsSource, RunConfig
from verl_core.data.batch import (
    ADVANTAGES,
    ATTENTION_MASK,
    ENVIRONMENT_REWARDS,
    OLD_LOG_PROBS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RESPONSES,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_POLICY_VERSIONS,
    SCORES,
    TEACHER_LOG_PROBS,
    TOKEN_LEVEL_REWARDS,
    UID,
    VALUES,
    concat_batches,
    groups_without_one_prompt,
)
from verl_core.data.dataset import PromptDataset, PromptRow, load_prompt_datasets
from verl_core.data.sampler import sequential_batches
from verl_core.errors import TrainerError
from verl_core.reward import load_reward_function, score_responses
from verl_core.rollout.base import SamplingParams
from verl_core.seeds import derive_seed
from verl_core.trainer import console
from verl_core.trainer.asynchronous import GenerationPipeline, ReadyBatch
from verl_core.trainer.distillation import TEACHER_INDEX, Teachers
from verl_core.trainer.loop import Trainer, epoch_sampler, prepare_run, run_length, with_run_length
from verl_core.trainer.metrics import REWARD_KEY, VAL_SCORE_KEY
from verl_core.trainer.preflight import preflight
from verl_core.trainer.run_files import validation_samples_path, write_jsonl
from verl_core.trainer.timing import Timer
from verl_core.trainer.validation import summarize
from verl_core.workers.dispatch import check_divisible
from verl_core.workers.replicas import RolloutReplicas
from verl_core.workers.roles import Actor, Critic, Teacher

#: ``trainer_state.json``'s ``trainer``: what tells an RL run's checkpoint from an SFT run's.
TRAINER_KIND = "rl"
#: Responses whose reward function failed (scored 0 under ``reward.on_error: zero``), per step.
REWARD_ERRORS_KEY = "reward/errors"


@attrs.frozen
class Collected:
    """A step's scored responses: the batch (``SCORES`` and ``UID`` set, groups numbered from 0), the
    epoch of its first prompt, the generation rounds it took, and its reward metrics (with the
    conversations' ``agent/*`` metrics, multi-turn)."""

    batch: TensorDict
    epoch: int
    rounds: int
    reward_metrics: dict[str, float]
    #: The sampler's state once this batch's prompts were drawn: what a checkpoint after its step keeps
    #: (an asynchronous run draws the prompts of later batches before that step ends).
    sampler_state: dict[str, Any] = attrs.field(factory=dict)
    #: The wall seconds of the phases that made it (``timing/generate``, ``timing/reward``).
    timings: dict[str, float] = attrs.field(factory=dict)


class RLTrainer(Trainer):
    """``fit()`` trains the ``actor`` (and the ``critic``, for estimators that need values) on
    ``train_data``, validating on ``val_data``, as ``config`` says; ``run_dir`` collects the metrics,
    validation samples and the final export."""

    #: Whether its config is held to the RL trainer's cross-section rules (``load_config(rl_rules=...)``).
    kind = TRAINER_KIND
    uses_rl_rules = True
    summary_keys = (VAL_SCORE_KEY, REWARD_KEY)

    def __init__(
        self,
        config: RunConfig,
        *,
        actor: Actor,
        critic: Critic | None,
        tokenizer: Any,
        train_data: PromptDataset,
        val_data: PromptDataset | None = None,
        registry: Any = None,
        show_progress: bool = True,
        replicas: RolloutReplicas | None = None,
        teachers: dict[str, Teacher] | None = None,
        environment_factory: Any = None,
    ):
        """``environment_factory``: the started environment of ``rollout.agent`` (``start_environment``),
        started here unless given."""
        self.config = config
        self.actor, self.critic = actor, critic
        #: The distillation teachers placed apart from the actor, by name (``distillation.teachers``).
        self.separate_teachers = dict(teachers or {})
        self.teachers = (
            Teachers(config, actor, self.separate_teachers) if config.distillation.enabled else None
        )
        #: The separate rollout replicas (``rollout.placement=separate``), None when colocated.
        self.replicas = replicas
        #: The generation thread of an asynchronous run, while ``fit`` trains.
        self.pipeline: GenerationPipeline | None = None
        self._trained_sampler_state: dict[str, Any] | None = None
        self._generate = replicas.generate if replicas is not None else actor.generate
        self.tokenizer = tokenizer
        self.train_data, self.val_data = train_data, val_data
        self.registry = registry
        self.run_dir = Path(config.trainer.run_dir)
        self.show_progress = show_progress
        self.n = config.rollout.n
        self.sampler = epoch_sampler(config, len(train_data))
        self.total_steps = run_length(config, len(train_data))
        self.num_mini_batches = config.data.train_batch_size // config.actor.ppo_mini_batch_size
        _check_divides(config, actor.dp_size)
        self.estimator = get_advantage_estimator(config.algorithm.adv_estimator, registry)
        self.reward_function = load_reward_function(config.reward.function, registry)
        self.kl_controller = build_kl_controller(config.algorithm.kl_ctrl)
        self.sampling = _sampling(config.rollout.temperature, config, tokenizer)
        self.agent_loop = build_agent_loop(config, tokenizer, self.sampling, registry, environment_factory)
        self.global_step = 0
        self._reward_failure_shown = False
        self._mixed_prompts_shown = False
        #: The last step's whole batch (responses, scores, advantages), for inspection.
        self.last_batch: TensorDict | None = None

    @classmethod
    def from_config(cls, config: RunConfig, registry: Any = None, **options: Any) -> RLTrainer:
        """The trainer ``config`` describes: every pre-flight check passed (``preflight``: all problems
        at once, before anything starts), its folders held and the checkpoint to resume from chosen
        (``prepare_run``), tokenizer and datasets loaded, the roles' worker groups started
        (``trainer.workers``) and their engines initialised. Raises ``NothingToTrain`` when the
        checkpoint it would resume from is at the run's last step and nothing after it is missing."""
        from verl_core.trainer.build import build_roles, load_tokenizer, workers_description

        preflight(config, TRAINER_KIND, registry)
        import_tools_file(config.rollout.agent)  # it runs: here, not in preflight (verl-core config)
        prepared = prepare_run(config, TRAINER_KIND)
        roles = environment = None
        try:
            # An adapter's server is connected to before any worker starts: one that cannot serve is refused.
            environment = start_environment(config, registry)
            with console.phase("loading the tokenizer and the datasets"):
                tokenizer = load_tokenizer(config.actor.engine.model)
                train_data, val_data = load_prompt_datasets(config.data, config.rollout, tokenizer)
            config, steps = with_run_length(config, len(train_data), updates_per_step(config))
            prepared.check_not_finished(config.trainer, steps)
            with console.phase(
                f"starting the actor{' and the critic' if config.critic.enable else ''} "
                f"({workers_description(config)}: engines and rollout)"
            ):
                roles = build_roles(config, registry)
            trainer = cls(
                config,
                actor=roles.actor,
                critic=roles.critic,
                replicas=roles.replicas,
                teachers=roles.teachers,
                tokenizer=tokenizer,
                train_data=train_data,
                val_data=val_data,
                registry=registry,
                environment_factory=environment,
                **options,
            )
        except BaseException:  # the worker groups hold processes, the lock the folders: release them
            close_environment_factory(environment)
            if roles is not None:
                roles.shutdown()
            prepared.lock.release()
            raise
        trainer.prepared = prepared
        return trainer

    def shutdown(self) -> None:
        """Release the worker groups and the run's folders."""
        self._stop_pipeline()
        if self.agent_loop is not None:
            close_environment_factory(self.agent_loop.environment_factory)
        for role in (self.actor, self.critic, self.replicas, *self.separate_teachers.values()):
            if role is not None:
                role.shutdown()
        self.release()

    # -- the run ---------------------------------------------------------------------------------

    def data_summary(self) -> str:
        return self.train_data.summary()

    # -- one step --------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        timer = Timer()
        metrics: dict[str, float] = {}
        if self.pipeline is not None:  # generated ahead, on the pipeline's thread
            ready = self.pipeline.take(step)
            collected = ready.collected
            metrics |= pipeline_metrics(ready, collected.batch, step, self.pipeline.staleness)
        else:
            collected = self.collect(step)
        timer.timings |= collected.timings
        self._trained_sampler_state = collected.sampler_state
        batch = collected.batch
        metrics |= {"training/generation_rounds": float(collected.rounds), **collected.reward_metrics}
        batch[TOKEN_LEVEL_REWARDS] = outcome_rewards(batch[SCORES], batch[RESPONSE_MASK])
        generated_mask = batch[RESPONSE_MASK]  # before a rollout correction rejects any token
        with timer.phase("old_log_probs"):
            if self.recompute_old_log_probs:
                batch[OLD_LOG_PROBS] = self.actor.compute_log_probs(batch)
                if ROLLOUT_LOG_PROBS in batch.keys():  # the same weights, as each side computes them
                    metrics |= rollout_log_prob_mismatch(
                        old_log_prob=batch[OLD_LOG_PROBS],
                        rollout_log_probs=batch[ROLLOUT_LOG_PROBS],
                        response_mask=batch[RESPONSE_MASK],
                    )
            else:  # one mini-batch, one epoch: the rollout sampled from exactly the policy being updated
                # (in another dtype, the update takes them from its own forward pass: these stand in
                # until then, for what reads them before the update)
                batch[OLD_LOG_PROBS] = batch[ROLLOUT_LOG_PROBS]
        if self.config.uses_kl:
            with timer.phase("ref_log_probs"):
                batch[REF_LOG_PROB] = self.actor.compute_ref_log_probs(batch)
        if self.critic is not None:
            with timer.phase("values"):
                batch[VALUES] = self.critic.compute_values(batch)
        if self.teachers is not None:
            with timer.phase("teachers"):
                metrics |= self.teachers.distill(batch)
        # The engines score every token they read; environment tokens (multi-turn) keep none.
        for key in (OLD_LOG_PROBS, REF_LOG_PROB, VALUES, TEACHER_LOG_PROBS):
            if key in batch.keys():
                batch[key] = torch.where(batch[RESPONSE_MASK].bool(), batch[key], 0.0)

        if self.config.algorithm.use_kl_in_reward:
            batch[TOKEN_LEVEL_REWARDS], kl_metrics = apply_kl_penalty(
                token_level_scores=batch[TOKEN_LEVEL_REWARDS],
                old_log_probs=batch[OLD_LOG_PROBS],
                ref_log_prob=batch[REF_LOG_PROB],
                response_mask=batch[RESPONSE_MASK],
                kl_ctrl=self.kl_controller,
                kl_penalty_name=self.config.algorithm.kl_penalty,
            )
            metrics |= kl_metrics
        policy_loss = self.config.actor.policy_loss
        if self.recompute_old_log_probs and (
            ROLLOUT_LOG_PROBS in batch.keys() or policy_loss.correction.active
        ):
            # Once for the whole batch (the metrics are the batch's), where verl runs it: the rejected
            # tokens leave every loss from here on; the policy loss applies the importance weights.
            correction = compute_rollout_correction(
                old_log_prob=batch[OLD_LOG_PROBS],
                rollout_log_probs=batch.get(ROLLOUT_LOG_PROBS, None),
                response_mask=batch[RESPONSE_MASK],
                config=policy_loss,
            )
            batch[RESPONSE_MASK] = correction.response_mask
            metrics |= correction.metrics
        with timer.phase("advantages"):
            batch[ADVANTAGES], batch[RETURNS] = self.estimator(
                token_level_rewards=batch[TOKEN_LEVEL_REWARDS],
                response_mask=batch[RESPONSE_MASK],
                index=batch[UID],
                values=batch[VALUES] if self.critic is not None else None,
                config=self.config.algorithm,
            )
            if self.teachers is not None:
                self.teachers.add_to_advantages(batch)

        if self.critic is not None:
            with timer.phase("update_critic"):
                metrics |= self.critic.update(batch, self.num_mini_batches, "data.train_batch_size")
        with timer.phase("update_actor"):
            metrics |= self.actor.update(batch, self.num_mini_batches, "data.train_batch_size")
        with timer.phase("sync"):
            self.sync_weights(step)
        self.last_batch = batch  # the step's whole batch (responses, scores, advantages), for inspection

        return metrics | timer.step_metrics(generated_mask, collected.epoch)

    def collect(self, step: int) -> Collected:
        """The step's scored responses: ``rollout.n`` per prompt of the next ``data.train_batch_size``
        prompts. With ``algorithm.filter_groups`` (DAPO's dynamic sampling), groups whose responses all
        scored the same are dropped and more prompts are drawn until the batch is full; the reward
        metrics then cover every round's responses (``reward/errors`` counts them all), the scores'
        statistics the kept ones. Multi-turn rollouts add the conversations' ``agent/*`` metrics
        (``conversation_metrics``), over every round's conversations too. Each response token is tagged
        with the policy version that generated it (``ROLLOUT_POLICY_VERSIONS``)."""
        timer = Timer()
        wanted = self.config.data.train_batch_size
        filtering = self.config.algorithm.filter_groups
        kept: list[TensorDict] = []
        kept_rows: list[PromptRow] = []
        rounds, epoch = 0, None
        round_metrics: list[dict[str, float]] = []
        conversations: list[Conversation] = []
        while len(kept_rows) < wanted:
            if rounds == filtering.max_num_gen_batches:
                raise TrainerError(
                    f"algorithm.filter_groups: after {rounds} generation rounds only {len(kept_rows)} of "
                    f"{wanted} prompts had responses with different scores; raise "
                    "algorithm.filter_groups.max_num_gen_batches, or disable filter_groups"
                )
            sampled = self.sampler.next_batch()
            epoch = sampled.epoch if epoch is None else epoch
            rows = self.train_data.select(sampled.indices)
            seed = derive_seed("generation", self.config.trainer.seed, step, rounds)
            with timer.phase("generate"):
                batch, round_conversations = self._rollout(rows, self.sampling, seed, newer=self._newer(step))
            conversations += round_conversations
            with timer.phase("reward"):
                batch[SCORES], metrics = self.score(batch, rows)
            round_metrics.append(metrics)
            rounds += 1
            groups = range(len(rows))
            if filtering.enable:
                scores = batch[SCORES].view(len(rows), self.n)
                groups = [g for g in groups if bool((scores[g] != scores[g][0]).any())]
            groups = list(groups)[: wanted - len(kept_rows)]
            # A round kept whole (no filtering) is the batch as it is, not a copy of each group.
            kept += [batch] if len(groups) == len(rows) else [batch[batch[UID] == g] for g in groups]
            kept_rows += [rows[group] for group in groups]
        merged = concat_batches(kept, self.sampling.pad_token_id)
        merged[UID] = torch.arange(len(kept_rows)).repeat_interleave(self.n)
        if self.teachers is not None:
            merged[TEACHER_INDEX] = self.teachers.route(kept_rows, self.n)
        # Every round scored as many responses: the mean over the rounds that logged a metric is its
        # mean over their responses; failures add up.
        reward_metrics = {}
        for key in dict.fromkeys(key for metrics in round_metrics for key in metrics):
            values = [metrics[key] for metrics in round_metrics if key in metrics]
            reward_metrics[key] = sum(values) if key == REWARD_ERRORS_KEY else sum(values) / len(values)
        scores = merged[SCORES]
        reward_metrics |= {
            REWARD_KEY: float(scores.mean()),
            "reward/max": float(scores.max()),
            "reward/min": float(scores.min()),
        }
        if conversations:  # multi-turn: over every round's conversations, as the reward metrics
            reward_metrics |= conversation_metrics(conversations)
        # Colocated, the rollout holds the policy as the last step left it.
        if ROLLOUT_POLICY_VERSIONS not in merged.keys():  # partial rollouts tagged theirs token by token
            version = self.replicas.version if self.replicas is not None else step - 1
            merged[ROLLOUT_POLICY_VERSIONS] = torch.full(merged[RESPONSES].shape, version, dtype=torch.int64)
        return Collected(merged, epoch, rounds, reward_metrics, self.sampler.state_dict(), timer.metrics())

    # -- the weights, and the generation thread --------------------------------------------------

    def sync_weights(self, version: int) -> None:
        """The policy's weights, ``version`` updates in, into the rollout: the colocated one in memory;
        the replicas' through ``publish_weights`` (to the generation thread, which moves the replicas
        when a batch needs them, in an asynchronous run)."""
        if self.replicas is None:
            self.actor.sync_weights()
            return
        published = self.actor.publish_weights()
        if self.pipeline is not None:
            self.pipeline.publish(version, published)
        else:
            self.replicas.update_weights(published, version)

    def _train(self) -> dict[str, float]:
        if self.replicas is None:
            return super()._train()
        mode = self.config.async_training
        if mode.mode != "sync":
            self.pipeline = GenerationPipeline(
                self.collect,
                self.replicas,
                first_step=self.global_step,
                total_steps=self.total_steps,
                staleness=mode.staleness,
                save_freq=self.config.trainer.save_freq,
                partial_rollout=mode.partial_rollout,
            )
            self.pipeline.start()
        try:
            self.sync_weights(self.global_step)  # the replicas loaded the model, not the policy resumed
            return super()._train()
        finally:
            self._stop_pipeline()

    def _newer(self, step: int) -> Callable[[], Any] | None:
        """What offers batch ``step`` newer weights while it generates, with partial rollouts."""
        if self.pipeline is None or not self.pipeline.partial_rollout:
            return None
        pipeline, replicas = self.pipeline, self.replicas
        return lambda: pipeline.newer(step, replicas.version)

    def _stop_pipeline(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    @contextlib.contextmanager
    def _newest_weights(self, step: int) -> Iterator[None]:
        """Generate with the policy of step ``step`` (validation): the generation thread paused between
        two batches and the replicas moved to that version meanwhile."""
        if self.pipeline is None:
            yield
            return
        with self.pipeline.pause():
            if self.replicas.version != step:
                self.replicas.update_weights(self.pipeline.weights(step), step)
            yield

    def sampler_state(self) -> dict[str, Any]:
        if self._trained_sampler_state is not None:
            return self._trained_sampler_state
        return super().sampler_state()

    @property
    def recompute_old_log_probs(self) -> bool:
        """Whether the training engine recomputes the old log-probs before the update
        (``RunConfig.old_log_probs_source`` says when and why)."""
        return (
            self.config.old_log_probs_source(self.num_mini_batches, self.registry) is OldLogProbsSource.ENGINE
        )

    def generate(
        self, rows: list[PromptRow], sampling: SamplingParams, seed: int, n: int | None = None
    ) -> TensorDict:
        """``n`` responses per prompt (default ``rollout.n``), the prompt's index in ``UID``."""
        return self._rollout(rows, sampling, seed, n)[0]

    def _rollout(
        self,
        rows: list[PromptRow],
        sampling: SamplingParams,
        seed: int,
        n: int | None = None,
        newer: Callable[[], Any] | None = None,
    ) -> tuple[TensorDict, list[Conversation]]:
        """``generate``'s batch, and its conversations with an agent loop (none without); with ``newer``,
        partial rollouts that move to the newer weights it offers (``RolloutReplicas.generate_resumable``)."""
        n = self.n if n is None else n
        prompts = [row.prompt_ids for row in rows for _ in range(n)]
        conversations: list[Conversation] = []
        if newer is not None:
            batch = asyncio.run(self.replicas.generate_resumable(prompts, sampling, seed, newer))
        elif self.agent_loop is None:
            batch = self._generate(prompts, sampling, seed)
        elif self.replicas is not None:  # each conversation on its own, on its replica, turn after turn
            batch, conversations = asyncio.run(
                request_conversations(
                    self.agent_loop, self.replicas.generate_request, rows, n, sampling, seed
                )
            )
        else:
            batch, conversations = run_conversations(self.agent_loop, self._generate, rows, n, sampling, seed)
        batch[UID] = torch.arange(len(rows)).repeat_interleave(n)
        self._warn_groups_without_one_prompt(batch)
        return batch, conversations

    def _warn_groups_without_one_prompt(self, batch: TensorDict) -> None:
        """Once per run: the groups whose samples came back with different prompts (a rollout backend or
        collector that rewrote some), named with their rows; they train with their own prompts."""
        if self._mixed_prompts_shown:
            return
        mixed = groups_without_one_prompt(batch)
        if not mixed:
            return
        self._mixed_prompts_shown = True
        named = "; ".join(f"group {group}: rows {rows}" for group, rows in list(mixed.items())[:5])
        console.warn(
            f"{len(mixed)} group(s) of the rollout's responses do not share one prompt ({named}): their "
            "samples' prompt tokens differ, so each is trained with its own prompt instead of one shared "
            f"copy (slower, still exact). The rollout ({self.config.rollout.backend}) should return each "
            "prompt as it was given; later steps are not warned about."
        )

    def score(self, batch: TensorDict, rows: list[PromptRow]) -> tuple[torch.Tensor, dict[str, float]]:
        # rows[i] is the prompt of the responses whose UID is i.
        """Each response's score: its environment's reward where it gave one (multi-turn), else the reward
        function's (which then scores only those responses); and the step's reward metrics."""
        index = batch[UID].tolist()
        scores = torch.full((len(index),), float("nan"))
        if ENVIRONMENT_REWARDS in batch.keys():
            scores = batch[ENVIRONMENT_REWARDS].float().clone()
        unscored = scores.isnan().nonzero().flatten().tolist()
        result = score_responses(
            self.reward_function,
            [rows[index[i]].prompt_text for i in unscored],
            decode_responses(self.tokenizer, batch, unscored),
            [rows[index[i]].extra for i in unscored],
            on_error=self.config.reward.on_error,
            name=self.config.reward.function,
        )
        if result.first_error and not self._reward_failure_shown:  # reward.on_error=zero: once per run
            self._reward_failure_shown = True
            console.warn(
                f"the reward function failed on {result.num_errors} of {len(unscored)} sample(s), scored 0 "
                f"(reward.on_error=zero; later failures are counted in reward/errors only). The first: "
                f"{result.first_error}"
            )
        scores[unscored] = torch.tensor(result.scores, dtype=torch.float32)
        metrics = {
            **result.step_metrics(),  # the function's own metrics first: they cannot replace these
            REWARD_KEY: float(scores.mean()),
            "reward/max": float(scores.max()),
            "reward/min": float(scores.min()),
            REWARD_ERRORS_KEY: float(result.num_errors),
        }
        return scores, metrics

    # -- validation ------------------------------------------------------------------------------

    def validate(self, step: int) -> dict[str, float]:
        """``trainer.val_n`` responses per validation prompt at ``trainer.val_temperature``: mean@k and
        pass@k per data source; a few generations written to the run folder. Batches of
        ``data.val_batch_size`` prompts (all at once by default)."""
        k = self.config.trainer.val_n
        sampling = _sampling(self.config.trainer.val_temperature, self.config, self.tokenizer)
        by_prompt: list[list[float]] = []
        sources: list[str] = []
        samples: list[dict[str, Any]] = []
        batches = sequential_batches(len(self.val_data), self.config.data.val_batch_size)
        for number, indices in enumerate(batches):
            rows = self.val_data.select(indices)
            seed = derive_seed("validation", self.config.trainer.seed, step, number)
            with self._newest_weights(step):
                batch = self.generate(rows, sampling, seed=seed, n=k)
            scores, _ = self.score(batch, rows)
            by_prompt += scores.view(len(rows), k).tolist()
            sources += [str(row.extra.get("data_source", "default")) for row in rows]
            responses = decode_responses(self.tokenizer, batch)
            room = self.config.trainer.val_samples_logged - len(samples)
            samples += [
                {
                    "step": step,
                    "prompt": rows[i // k].prompt_text,
                    "response": responses[i],
                    "score": scores[i].item(),
                    **({"turns": turns(self.tokenizer, batch, i)} if self.agent_loop is not None else {}),
                }
                for i in range(min(room, len(responses)))
            ]
        write_jsonl(validation_samples_path(self.run_dir, step), samples)
        console.samples(step, samples)
        return summarize(by_prompt, sources, k)

    # -- checkpoints -----------------------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_controller.value}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.kl_controller.value = state["kl_coef"]


# -- helpers ------------------------------------------------------------------------------------------


def _check_divides(config: RunConfig, dp_size: int) -> None:
    """Every update splits its responses, and every mini-batch, evenly over the DP ranks: refuse
    sizes that cannot, before the first step runs (generation and validation take any size)."""
    n = config.rollout.n
    check_divisible(
        {
            key: (prompts * n, f"{prompts} prompts x rollout.n={n} = {prompts * n} responses")
            for key, prompts in (
                ("data.train_batch_size", config.data.train_batch_size),
                ("actor.ppo_mini_batch_size", config.actor.ppo_mini_batch_size),
            )
        },
        dp_size,
    )


def updates_per_step(config: RunConfig) -> int:
    """Optimiser steps per training step: every mini-batch of every epoch (the critic's too)."""
    return config.data.train_batch_size // config.actor.ppo_mini_batch_size * config.actor.ppo_epochs


def _sampling(temperature: float, config: RunConfig, tokenizer: Any) -> SamplingParams:
    rollout = config.rollout
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return SamplingParams(
        max_new_tokens=rollout.response_length,
        eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos),
        pad_token_id=pad,
        temperature=temperature,
        top_k=rollout.top_k,
        top_p=rollout.top_p,
    )


def pipeline_metrics(ready: ReadyBatch, batch: TensorDict, step: int, staleness: int) -> dict[str, float]:
    """An asynchronous step's metrics (docs/training.md): the samples' staleness (policy versions behind
    the policy that trains on them: its mean, its largest, and the share of samples at each staleness
    from 0 to ``staleness``), the batches ready when the trainer took this one (``async/buffer_depth``),
    the share of its generation the trainer did not wait for (``async/overlap``), and the seconds each
    role waited for the other (``timing/idle/trainer``, ``timing/idle/rollout``)."""
    versions = batch[ROLLOUT_POLICY_VERSIONS].masked_fill(~batch[RESPONSE_MASK].bool(), step - 1)
    behind = (step - 1) - versions.amin(dim=-1)  # a sample is as stale as its oldest token
    metrics = {
        "async/staleness/mean": float(behind.float().mean()),
        "async/staleness/max": float(behind.max()),
        **{f"async/staleness/{k}": float((behind == k).float().mean()) for k in range(staleness + 1)},
        "async/buffer_depth": float(ready.buffer_depth),
        "timing/idle/trainer": ready.trainer_idle_s,
        "timing/idle/rollout": ready.rollout_idle_s,
    }
    if ready.generation_s > 0:
        overlapped = max(0.0, ready.generation_s - ready.trainer_idle_s) / ready.generation_s
        metrics["async/overlap"] = min(1.0, overlapped)
    return metrics


def outcome_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` token-level rewards: each response's score on its last model token (the last
    ``response_mask`` 1: a multi-turn response has environment tokens between the model's), 0 elsewhere."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    mask = response_mask.bool()
    has_tokens = mask.any(dim=-1)
    columns = torch.arange(mask.shape[-1]).expand_as(mask)
    last = torch.where(mask, columns, -1).amax(dim=-1)
    rows = torch.arange(response_mask.shape[0])[has_tokens]
    rewards[rows, last[has_tokens]] = scores[has_tokens]
    return rewards


def decode_responses(tokenizer: Any, batch: TensorDict, rows: Sequence[int] | None = None) -> list[str]:
    """Each response's text (of ``rows`` only, when given), padding and special tokens (the EOS)
    removed. A multi-turn response is the whole conversation after the prompt: the model's turns and
    the environment's messages."""
    responses = batch[RESPONSES]
    mask = batch[ATTENTION_MASK][:, -responses.shape[-1] :].bool()
    rows = range(len(responses)) if rows is None else rows
    if not rows:  # batch_decode([]) is not [] for every tokenizer
        return []
    return tokenizer.batch_decode([responses[i][mask[i]].tolist() for i in rows], skip_special_tokens=True)
