"""Supervised fine-tuning: the masked negative log-likelihood of the responses of a prompt/response
dataset, on the RL run's engines, worker groups, checkpoints and feedback.

One training step, as ``train_step`` reads top to bottom: the sampler's next ``data.train_batch_size``
pairs of ``data.train_files`` (``SFTDataset``, in the seeded epoch order of ``EpochSampler``), as one
batch of the batch contract (prompts left-padded, responses right-padded with their eos,
``response_mask`` on the response tokens), and one optimiser step on it. ``fit`` runs the steps,
measures the validation loss on ``data.val_files`` every ``test_freq`` steps, saves a checkpoint
every ``save_freq`` steps (the RL trainer's ``global_step_N`` layout), resumes from the newest one,
and writes the Hugging Face export that an RL run starts from (``actor.engine.model.path``).

One optimiser step per batch, as verl's SFT trainer does: ``data.train_batch_size`` is the SFT batch
(sequences per optimiser step, over all ranks), accumulated over the engine's micro-batches. So the
run's steps are its optimiser steps, and a decaying learning rate's ``optim.total_steps: 0`` ("the
run's length") means what it says; ``actor.ppo_mini_batch_size`` and ``actor.ppo_epochs`` count PPO
updates of generated responses and are not read. The lengths are the rollout section's:
``rollout.prompt_length`` bounds the prompts, ``rollout.response_length`` the responses (eos
included), the same bounds the RL run generates within; longer pairs are dropped and counted
(``data.filter_overlong_prompts: true``) or an error naming the row (``false``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from verl_core.config.run import DataConfig, RolloutConfig, RunConfig
from verl_core.data.batch import RESPONSE_MASK, join_prompts_and_responses, left_pad
from verl_core.data.dataset import SFTDataset, SFTRow
from verl_core.data.sampler import sequential_batches
from verl_core.trainer import console
from verl_core.trainer.loop import Trainer, epoch_sampler, prepare_run, run_length, with_run_length
from verl_core.trainer.preflight import preflight
from verl_core.trainer.timing import Timer
from verl_core.workers.dispatch import check_divisible
from verl_core.workers.ranks import SFTWorker
from verl_core.workers.roles import SFT

#: The training loss (the step's token-mean NLL of the responses) and the validation set's.
SFT_LOSS_KEY = "sft/loss"
VAL_LOSS_KEY = "val/loss"
#: ``trainer_state.json``'s ``trainer``: what tells an SFT checkpoint from an RL run's.
TRAINER_KIND = "sft"


class SFTTrainer(Trainer):
    """``fit()`` fine-tunes the ``actor`` on ``train_data``, measuring the loss on ``val_data``, as
    ``config`` says; ``run_dir`` collects the metrics and the final export."""

    #: Whether its config is held to the RL trainer's cross-section rules (``load_config(rl_rules=...)``).
    kind = TRAINER_KIND
    uses_rl_rules = False
    summary_keys = (VAL_LOSS_KEY, SFT_LOSS_KEY)

    def __init__(
        self,
        config: RunConfig,
        *,
        actor: SFT,
        tokenizer: Any,
        train_data: SFTDataset,
        val_data: SFTDataset | None = None,
        show_progress: bool = True,
    ):
        self.config = config
        self.actor = actor
        self.tokenizer = tokenizer
        self.train_data, self.val_data = train_data, val_data
        self.run_dir = Path(config.trainer.run_dir)
        self.show_progress = show_progress
        self.sampler = epoch_sampler(config, len(train_data))
        self.total_steps = run_length(config, len(train_data))
        size = config.data.train_batch_size
        check_divisible({"data.train_batch_size": (size, f"{size} sequences per step")}, actor.dp_size)
        self.global_step = 0

    @classmethod
    def from_config(cls, config: RunConfig, registry: Any = None, **options: Any) -> SFTTrainer:
        """The trainer ``config`` describes: every pre-flight check passed (``preflight``), its folders
        held and the checkpoint to resume from chosen (``prepare_run``), tokenizer and datasets loaded, a
        decaying learning rate given the run's length, the SFT worker group started
        (``trainer.workers``) and its engines initialised. Raises ``NothingToTrain`` when the checkpoint
        it would resume from is at the run's last step and nothing after it is missing."""
        from verl_core.trainer.build import WorkerMaker, load_tokenizer, worker_group, workers_description

        preflight(config, TRAINER_KIND, registry)
        prepared = prepare_run(config, TRAINER_KIND)
        actor = None
        try:
            with console.phase("loading the tokenizer and the datasets"):
                tokenizer = load_tokenizer(config.actor.engine.model)
                train_data, val_data = load_sft_datasets(config.data, config.rollout, tokenizer)
            config, steps = with_run_length(config, len(train_data))  # one optimiser step per trainer step
            prepared.check_not_finished(config.trainer, steps)
            with console.phase(f"starting the SFT engines ({workers_description(config)})"):
                actor = SFT(
                    worker_group(
                        config, "sft", WorkerMaker(SFTWorker, config, registry), config.actor.engine.device
                    )
                )
            trainer = cls(
                config, actor=actor, tokenizer=tokenizer, train_data=train_data, val_data=val_data, **options
            )
        except BaseException:  # the worker group holds processes, the lock the folders: release them
            if actor is not None:
                actor.shutdown()
            prepared.lock.release()
            raise
        trainer.prepared = prepared
        return trainer

    def shutdown(self) -> None:
        """Release the worker group and the run's folders."""
        self.actor.shutdown()
        self.release()

    # -- the run ---------------------------------------------------------------------------------

    def data_summary(self) -> str:
        return dataset_summary(self.train_data, self.config.rollout)

    # -- one step --------------------------------------------------------------------------------

    def train_step(self, step: int = 0) -> dict[str, float]:
        timer = Timer()
        sampled = self.sampler.next_batch()
        batch = sft_batch(self.train_data.select(sampled.indices), self.tokenizer.pad_token_id)
        with timer.phase("update"):
            metrics = self.actor.update(batch, num_mini_batches=1, size_key="data.train_batch_size")

        return metrics | timer.step_metrics(batch[RESPONSE_MASK], sampled.epoch)

    # -- validation ------------------------------------------------------------------------------

    def validate(self, step: int = 0) -> dict[str, float]:
        """The token-mean NLL of every validation response (``val/loss``), forward only, in batches of
        ``data.val_batch_size`` pairs (all at once by default)."""
        nll, tokens = 0.0, 0
        for indices in sequential_batches(len(self.val_data), self.config.data.val_batch_size):
            rows = self.val_data.select(indices)
            batch = sft_batch(rows, self.tokenizer.pad_token_id, multiple_of=self.actor.dp_size)
            count = int(batch[RESPONSE_MASK].sum())
            loss = self.actor.compute_loss(batch, "data.val_batch_size")["loss"]
            nll += loss * count  # each batch's mean, weighted by its tokens
            tokens += count
        return {VAL_LOSS_KEY: nll / tokens}

    # -- checkpoints -----------------------------------------------------------------------------


# -- data ---------------------------------------------------------------------------------------------


def load_sft_datasets(
    data: DataConfig, rollout: RolloutConfig, tokenizer: Any
) -> tuple[SFTDataset, SFTDataset | None]:
    """The training pairs of ``data.train_files`` and the validation pairs of ``data.val_files``
    (``None`` when there are none), within ``rollout.prompt_length`` and ``rollout.response_length``."""
    options = {
        "max_prompt_length": rollout.prompt_length,
        "max_response_length": rollout.response_length,
        "prompt_key": data.prompt_key,
        "response_key": data.response_key,
        "apply_chat_template": data.apply_chat_template,
        "overlong": "filter" if data.filter_overlong_prompts else "error",
    }
    train = SFTDataset.from_files(data.train_files, tokenizer, config_path="data.train_files", **options)
    val = None
    if data.val_files:
        val = SFTDataset.from_files(data.val_files, tokenizer, config_path="data.val_files", **options)
    return train, val


def dataset_summary(dataset: SFTDataset, rollout: RolloutConfig) -> str:
    """One line for the log: how many pairs were kept and how many filtered."""
    line = f"{dataset.config_path}: {len(dataset)} prompt/response pairs"
    if dataset.num_filtered:
        line += (
            f" ({dataset.num_filtered} of {dataset.num_rows} longer than rollout.prompt_length="
            f"{rollout.prompt_length} or rollout.response_length={rollout.response_length} filtered out)"
        )
    return line


def sft_batch(rows: Sequence[SFTRow], pad_token_id: int, multiple_of: int = 1) -> TensorDict:
    """The batch contract for ``rows``: prompts left-padded, responses (eos included) right-padded,
    ``response_mask`` 1 on the response tokens.

    With ``multiple_of`` (the DP size, for a validation batch of any length), copies of the first row
    with an empty ``response_mask`` fill the batch up to a multiple of it: they count in no loss.
    """
    filler = [rows[0]] * (-len(rows) % multiple_of)
    prompts, prompt_mask = left_pad([list(row.prompt_ids) for row in [*rows, *filler]], pad_token_id)
    # Right padding is left padding of the reversed sequences, flipped back.
    reversed_responses, reversed_mask = left_pad(
        [list(reversed(row.response_ids)) for row in [*rows, *filler]], pad_token_id
    )
    response_mask = reversed_mask.flip(-1)
    batch = join_prompts_and_responses(prompts, prompt_mask, reversed_responses.flip(-1), response_mask)
    batch[RESPONSE_MASK][len(rows) :] = 0
    return batch
