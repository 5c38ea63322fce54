"""The shared micro-batch loop: same loss, gradients and outputs whatever the split, on 1 and 2 ranks.

The reference is one plain PyTorch forward/backward over the whole batch in a single process.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from verl_core.config.engine import MicroBatchConfig
from verl_core.data import batch as keys
from verl_core.data.batch import get_global_counts
from verl_core.engine import run_micro_batches
from verl_core.testing.spawn import Rank, SpawnError, spawn

PROMPT = 2
RESPONSE = 6
VOCAB = 16


class ToyScorer(torch.nn.Module):
    """A per-token score of each response token: enough to exercise the loop's mechanics."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, 4, generator=generator))
        self.head = torch.nn.Parameter(torch.randn(4, generator=generator))

    def forward(self, responses: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"log_probs": torch.tanh(self.embed[responses]) @ self.head}


def toy_batch(response_lengths: list[int], seed: int = 0) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    count = len(response_lengths)
    response_mask = torch.zeros(count, RESPONSE, dtype=torch.int64)
    for row, length in enumerate(response_lengths):
        response_mask[row, :length] = 1
    attention_mask = torch.cat([torch.ones(count, PROMPT, dtype=torch.int64), response_mask], dim=1)
    input_ids = torch.randint(1, VOCAB, (count, PROMPT + RESPONSE), generator=generator) * attention_mask
    return TensorDict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: input_ids[:, PROMPT:],
            keys.RESPONSE_MASK: response_mask,
            keys.ADVANTAGES: torch.randn(count, RESPONSE, generator=generator),
        },
        batch_size=[count],
    )


def token_mean_loss(output, micro_batch, dp_group):
    """Token-mean over the whole step: global token count, scaled by the DP size."""
    counts = get_global_counts(micro_batch)
    masked = output["log_probs"] * micro_batch[keys.ADVANTAGES] * micro_batch[keys.RESPONSE_MASK]
    return masked.sum() / counts.num_tokens * counts.dp_size, {
        "tokens": micro_batch[keys.RESPONSE_MASK].sum()
    }


def reference(batch: TensorDict) -> tuple[float, list[torch.Tensor], torch.Tensor]:
    """Loss, gradients and outputs of one full-batch pass, written out directly."""
    model = ToyScorer()
    scores = model(batch[keys.RESPONSES])["log_probs"]
    mask = batch[keys.RESPONSE_MASK]
    loss = (scores * batch[keys.ADVANTAGES] * mask).sum() / mask.sum()
    loss.backward()
    return float(loss.detach()), [p.grad for p in model.parameters()], scores.detach()


class CountingNoSync:
    """A ``no_sync`` factory that counts how often the loop enters it."""

    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        yield


configs = st.one_of(
    st.builds(MicroBatchConfig, micro_batch_size=st.integers(min_value=1, max_value=14)),
    st.builds(
        MicroBatchConfig, use_dynamic_bsz=st.just(True), max_token_len=st.integers(min_value=1, max_value=60)
    ),
)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=RESPONSE), min_size=1, max_size=12),
    config=configs,
)
def test_loss_gradients_and_outputs_do_not_depend_on_the_split(lengths, config) -> None:
    batch = toy_batch(lengths)
    expected_loss, expected_grads, expected_scores = reference(batch)
    model, no_sync = ToyScorer(), CountingNoSync()
    result = run_micro_batches(
        batch,
        forward=lambda micro: model(micro[keys.RESPONSES]),
        loss_fn=token_mean_loss,
        forward_only=False,
        micro_batch_config=config,
        no_sync=no_sync,
    )
    assert result.loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    for parameter, expected in zip(model.parameters(), expected_grads, strict=True):
        torch.testing.assert_close(parameter.grad, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.outputs["log_probs"], expected_scores)
    micro_batches = len(result.metrics["tokens"])
    assert sum(result.metrics["tokens"]) == sum(lengths)  # one metric entry per micro-batch
    assert no_sync.entered == micro_batches - 1  # gradients synchronise on the last one only


def test_forward_only_builds_no_graph_and_skips_no_sync() -> None:
    batch = toy_batch([3, 6, 1, 4])
    _, _, expected_scores = reference(batch)
    model, no_sync = ToyScorer(), CountingNoSync()
    seen_counts = []

    def loss_fn(output, micro_batch, dp_group):
        seen_counts.append(get_global_counts(micro_batch))
        assert not output["log_probs"].requires_grad
        return token_mean_loss(output, micro_batch, dp_group)

    result = run_micro_batches(
        batch,
        forward=lambda micro: model(micro[keys.RESPONSES]),
        loss_fn=loss_fn,
        forward_only=True,
        micro_batch_config=MicroBatchConfig(micro_batch_size=1),
        no_sync=no_sync,
    )
    assert no_sync.entered == 0 and all(p.grad is None for p in model.parameters())
    assert [(c.num_tokens, c.num_seqs, c.dp_size) for c in seen_counts] == [(14, 4, 1)] * 4
    assert keys.GLOBAL_COUNTS not in batch.keys()  # the caller's batch is left as it was
    torch.testing.assert_close(result.outputs["log_probs"], expected_scores)

    inference = run_micro_batches(
        batch,
        forward=lambda micro: model(micro[keys.RESPONSES]),
        loss_fn=None,
        forward_only=True,
        micro_batch_config=MicroBatchConfig(use_dynamic_bsz=True, max_token_len=9),
    )
    assert inference.loss is None and inference.metrics == {}
    torch.testing.assert_close(inference.outputs["log_probs"], expected_scores)


def test_backward_without_a_loss_function_is_refused() -> None:
    with pytest.raises(ValueError, match="a backward pass needs a loss_fn"):
        run_micro_batches(
            toy_batch([1]), lambda m: {}, None, forward_only=False, micro_batch_config=MicroBatchConfig()
        )


# -- two gloo ranks ---------------------------------------------------------------------------------

#: Rank 0 holds long responses, rank 1 short ones: under a token budget of 12 (prompts included)
#: rank 0 needs four micro-batches and rank 1 two, so the loop must equalise the count (else DDP
#: would hang).
RANK_LENGTHS = ([6, 6, 5, 4], [1, 2, 1, 1])


def _two_rank_worker(rank: Rank) -> None:
    full = toy_batch([*RANK_LENGTHS[0], *RANK_LENGTHS[1]])
    expected_loss, expected_grads, expected_scores = reference(full)
    share = full[rank.rank * 4 : (rank.rank + 1) * 4]
    model = torch.nn.parallel.DistributedDataParallel(ToyScorer())
    no_sync = CountingNoSync()
    result = run_micro_batches(
        share,
        forward=lambda micro: model(micro[keys.RESPONSES]),
        loss_fn=token_mean_loss,
        forward_only=False,
        micro_batch_config=MicroBatchConfig(use_dynamic_bsz=True, max_token_len=12),
        dp_group=dist.group.WORLD,
        no_sync=model.no_sync,
    )
    assert len(result.metrics["tokens"]) == 4, result.metrics  # both ranks: the busiest rank's count
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    for parameter, expected in zip(model.parameters(), expected_grads, strict=True):
        torch.testing.assert_close(parameter.grad, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        result.outputs["log_probs"], expected_scores[rank.rank * 4 : (rank.rank + 1) * 4]
    )

    # A rank with fewer sequences than the group's micro-batch count: every rank refuses together.
    uneven = full[:4] if rank.rank == 0 else full[4:5]
    with pytest.raises(ValueError, match="a rank of the data-parallel group has 1 sequence"):
        run_micro_batches(
            uneven,
            forward=lambda micro: model(micro[keys.RESPONSES]),
            loss_fn=token_mean_loss,
            forward_only=True,
            micro_batch_config=MicroBatchConfig(use_dynamic_bsz=True, max_token_len=12),
            dp_group=dist.group.WORLD,
            no_sync=no_sync,
        )


@pytest.mark.distributed
def test_two_ranks_with_unequal_tokens_match_the_single_process_reference(tmp_path) -> None:
    try:
        spawn(_two_rank_worker, world_size=2, workdir=tmp_path, timeout_s=180)
    except SpawnError as error:  # the ranks' tracebacks or, for a hang, their stacks
        pytest.fail(str(error), pytrace=False)
