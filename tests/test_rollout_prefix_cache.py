"""The built-in rollout's prefix cache across requests (``rollout.hf.prefix_cache_sequences``): a
conversation's next turn, served from the previous turn's KV cache, samples what the same request
served by a rollout without the cache samples (the same tokens for the same seed, log-probs within
1e-5 in float32) while prefilling only the tokens after the cached prefix; the cache is bounded, and
serves nothing computed under weights that have changed since. Deliberately broken caches (kept
across a weight update; new tokens one position off) fail the same comparison.

The rollout kit's ``prefix_caching`` check sees the same from outside (tests/test_rollout_kit.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import attrs
import pytest
import torch
from fixtures.rollouts import ShiftedExtensionRollout, StaleRequestPrefixCacheRollout
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.config.engine import ModelConfig
from verl_core.config.loading import load_config
from verl_core.errors import ConfigError
from verl_core.rollout import HFRollout, RolloutRequest, RolloutResponse, SamplingParams, weight_buckets
from verl_core.rollout.config import HFRolloutConfig
from verl_core.rollout.prefix_cache import common_prefix
from verl_core.testing import save_rollout_model
from verl_core.testing.tiny import TinyModelSpec

torch.set_num_threads(1)

EOS = 2
VOCAB = 128
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_rollout_model(tmp_path_factory.mktemp("prefix") / "llama", TinyModelSpec(arch="llama"))


def rollout_of(model_dir: str, cls: type[HFRollout] = HFRollout, **options) -> HFRollout:
    rollout = cls(ModelConfig(path=model_dir, dtype="float32"), HFRolloutConfig(**options))
    rollout.initialize()
    return rollout


@pytest.fixture(scope="module", params=[True, False], ids=["lean", "hf-forward"])
def pair(request, model_dir) -> tuple[HFRollout, HFRollout]:
    """A rollout with the prefix cache and one without, the same model and decoder."""
    lean = request.param
    return rollout_of(model_dir, lean_decoder=lean), rollout_of(
        model_dir, lean_decoder=lean, prefix_cache_sequences=0
    )


def sampling(max_new_tokens: int = 6) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, eos_token_ids=(EOS,), pad_token_id=0, temperature=1.0
    )


def serve(rollout: HFRollout, prompt, seed: int, max_new_tokens: int = 6, **fields) -> RolloutResponse:
    request = RolloutRequest(prompt, sampling(max_new_tokens), seed=seed, **fields)
    return asyncio.run(rollout.generate_request(request))


def served_alike(cached: RolloutResponse, reference: RolloutResponse) -> float:
    """The largest log-prob difference of two responses that must have the same tokens."""
    assert cached.token_ids == reference.token_ids
    assert cached.finish_reason == reference.finish_reason
    return max((abs(a - b) for a, b in zip(cached.log_probs, reference.log_probs, strict=True)), default=0.0)


def counted(rollout: HFRollout, prompt, seed: int, **kwargs) -> tuple[RolloutResponse, int, int]:
    """The response, and the prompt tokens it prefilled and reused."""
    prefilled, reused = rollout.prefilled_tokens, rollout.reused_tokens
    response = serve(rollout, prompt, seed, **kwargs)
    return response, rollout.prefilled_tokens - prefilled, rollout.reused_tokens - reused


def forget(rollout: HFRollout) -> None:
    rollout.sleep()  # frees the prefix cache
    rollout.wake_up()


def tokens(draw, low: int, high: int) -> list[int]:
    return draw(st.lists(st.integers(1, VOCAB - 1), min_size=low, max_size=high))


@st.composite
def conversations(draw) -> tuple[list[int], int, list[int], int]:
    """A first prompt, the tokens of its response kept in the next prompt, the tokens after them (an
    environment's message), and the next turn's new tokens."""
    return tokens(draw, 1, 12), draw(st.integers(0, 8)), tokens(draw, 0, 6), draw(st.integers(1, 6))


@settings(max_examples=25, deadline=None)
@given(conversation=conversations(), seed=st.integers(0, 2**16))
def test_a_next_turn_from_the_cache_samples_what_a_full_prefill_samples_prefilling_only_new_tokens(
    pair, conversation, seed
) -> None:
    with_cache, without = pair
    forget(with_cache)
    prompt, kept, message, new_tokens = conversation
    first, prefilled, reused = counted(with_cache, prompt, seed)
    assert (prefilled, reused) == (len(prompt), 0)
    assert served_alike(first, serve(without, prompt, seed)) == 0.0  # the same path, bit for bit
    # The next prompt keeps the first `kept` tokens of the response (all of it, or fewer: an
    # environment may rewrite the end of a reply), then the message.
    following = [*prompt, *first.token_ids[:kept], *message]
    second, prefilled, reused = counted(with_cache, following, seed + 1, max_new_tokens=new_tokens)
    # What the cache holds: the first prompt and every response token but the last (never run).
    ran = [*prompt, *first.token_ids[:-1]]
    shared = next((i for i, (a, b) in enumerate(zip(ran, following, strict=False)) if a != b), None)
    expected_reuse = min(min(len(ran), len(following)) if shared is None else shared, len(following) - 1)
    assert (prefilled, reused) == (len(following) - expected_reuse, expected_reuse)
    assert served_alike(second, serve(without, following, seed + 1, max_new_tokens=new_tokens)) <= TOLERANCE


def test_the_second_turn_prefills_its_new_tokens_only_and_a_third_continues_the_second(pair) -> None:
    with_cache, without = pair
    forget(with_cache)
    prompt, message = [5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]
    first = serve(with_cache, prompt, 3, max_new_tokens=5)
    turn = [*prompt, *first.token_ids, *message]
    second, prefilled, reused = counted(with_cache, turn, 4)
    # The reply's last token (sampled, never run) and the message.
    assert (prefilled, reused) == (1 + len(message), len(turn) - 1 - len(message))
    assert served_alike(second, serve(without, turn, 4)) <= TOLERANCE
    third_turn = [*turn, *second.token_ids, *message]
    third, prefilled, reused = counted(with_cache, third_turn, 5)
    assert prefilled == 1 + len(message)
    assert served_alike(third, serve(without, third_turn, 5)) <= TOLERANCE
    # Each turn's entry replaced the one it continued.
    assert len(with_cache._prefix_cache) == 1


def conversations_in(rollout: HFRollout, order: list[tuple[int, int]]) -> dict[int, list[RolloutResponse]]:
    """Conversations sharing their opening (as the ``n`` responses of a prompt do), each turn the
    previous prompt, response and a message, their turns served in ``order`` (conversation, turn)."""
    prompts = {conversation: [4, 5, 6, 7, 8] for conversation, _ in order}
    replies: dict[int, list[RolloutResponse]] = {conversation: [] for conversation in prompts}
    for conversation, turn in order:
        response = serve(rollout, prompts[conversation], 100 * conversation + turn)
        replies[conversation].append(response)
        prompts[conversation] = [*prompts[conversation], *response.token_ids, 30, 31]
    return replies


def test_conversations_served_in_any_order_sample_the_same_tokens(pair) -> None:
    """Which prefix a request finds cached depends on the requests before it (a sibling's prompt, its
    own previous turn): its log-probs to float rounding only."""
    with_cache, without = pair
    by_turn = [(conversation, turn) for turn in range(3) for conversation in range(3)]
    by_conversation = [(conversation, turn) for conversation in (2, 1, 0) for turn in range(3)]
    forget(with_cache)
    first = conversations_in(with_cache, by_turn)
    forget(with_cache)
    second = conversations_in(with_cache, by_conversation)
    reference = conversations_in(without, by_turn)
    for replies in (first, second):
        for conversation, responses in replies.items():
            for response, expected in zip(responses, reference[conversation], strict=True):
                assert served_alike(response, expected) <= TOLERANCE


def test_a_resumed_request_runs_only_its_last_partial_token(pair) -> None:
    with_cache, without = pair
    forget(with_cache)
    prompt = [9, 8, 7, 6, 5]
    cut = attrs.evolve(serve(with_cache, prompt, 11, max_new_tokens=3), finish_reason="aborted")
    resumed, prefilled, _ = counted(with_cache, prompt, 11, max_new_tokens=8, resume_from=cut)
    assert prefilled == 1
    assert served_alike(resumed, serve(without, prompt, 11, max_new_tokens=8, resume_from=cut)) <= TOLERANCE


def test_the_cache_keeps_the_most_recent_sequences_and_0_keeps_none(model_dir) -> None:
    rollout = rollout_of(model_dir, prefix_cache_sequences=2)
    conversations = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(3)]
    firsts = [serve(rollout, prompt, i) for i, prompt in enumerate(conversations)]
    kept = [
        len(prompt) + len(first.token_ids) - 1 for prompt, first in zip(conversations, firsts, strict=True)
    ]
    assert (len(rollout._prefix_cache), rollout._prefix_cache.tokens) == (2, kept[1] + kept[2])
    # The first conversation's sequence was the least recently used: its next turn prefills whole.
    following = [[*prompt, *first.token_ids, 99] for prompt, first in zip(conversations, firsts, strict=True)]
    _, prefilled, reused = counted(rollout, following[0], 7)
    assert (prefilled, reused) == (len(following[0]), 0)
    _, prefilled, reused = counted(rollout, following[2], 7)
    assert prefilled == 2
    off = rollout_of(model_dir, prefix_cache_sequences=0)
    serve(off, conversations[0], 0)
    _, prefilled, reused = counted(off, [*conversations[0], 99], 1)
    assert (prefilled, reused, len(off._prefix_cache)) == (5, 0, 0)


# -- weights that change: the cache must not serve them ------------------------------------------------


def other_weights(rollout: HFRollout) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in rollout.model.state_dict().items()
    }


def next_turn_after(rollout: HFRollout, change) -> tuple[list[int], RolloutResponse, int]:
    """A first turn, ``change(rollout)``, then the next turn: its prompt, response and prefilled tokens."""
    forget(rollout)
    prompt = [3, 1, 4, 1, 5, 9, 6, 6]
    first = serve(rollout, prompt, 21)
    change(rollout)
    turn = [*prompt, *first.token_ids, 50, 51]
    second, prefilled, _ = counted(rollout, turn, 22)
    return turn, second, prefilled


UPDATES = {
    "update_weights": lambda rollout, weights: rollout.update_weights(weights.items()),
    "update_weights_from_buckets": lambda rollout, weights: rollout.update_weights_from_buckets(
        weight_buckets(iter(weights.items()), 4096)
    ),
    "a write to the model's weights": lambda rollout, weights: rollout.model.load_state_dict(weights),
}


@pytest.mark.parametrize("update", list(UPDATES))
def test_after_the_weights_change_a_next_turn_prefills_whole_under_the_new_weights(model_dir, update) -> None:
    with_cache, without = rollout_of(model_dir), rollout_of(model_dir, prefix_cache_sequences=0)
    weights = other_weights(with_cache)
    turn, second, prefilled = next_turn_after(with_cache, lambda rollout: UPDATES[update](rollout, weights))
    assert prefilled == len(turn)
    UPDATES[update](without, weights)
    assert served_alike(second, serve(without, turn, 22)) <= TOLERANCE


def test_sleep_frees_the_cache(model_dir) -> None:
    rollout = rollout_of(model_dir)
    turn, _, prefilled = next_turn_after(rollout, lambda rollout: rollout.wake_up())
    assert prefilled < len(turn) and len(rollout._prefix_cache) == 1
    rollout.sleep()
    assert len(rollout._prefix_cache) == 0


def test_a_cache_kept_across_a_weight_update_is_caught(model_dir) -> None:
    stale, without = rollout_of(model_dir, StaleRequestPrefixCacheRollout), rollout_of(model_dir)
    weights = other_weights(stale)
    turn, second, prefilled = next_turn_after(stale, lambda rollout: rollout.update_weights(weights.items()))
    assert prefilled < len(turn)  # served from keys and values of the old weights
    without.update_weights(weights.items())
    reference = serve(without, turn, 22)
    assert second.token_ids != reference.token_ids or served_alike(second, reference) > 100 * TOLERANCE


def test_new_tokens_one_position_off_are_caught(model_dir) -> None:
    shifted, without = rollout_of(model_dir, ShiftedExtensionRollout), rollout_of(model_dir)
    prompt = [7, 7, 1, 2, 3, 4]
    first = serve(shifted, prompt, 31)
    turn = [*prompt, *first.token_ids, 60, 61, 62]
    second, prefilled, _ = counted(shifted, turn, 32)
    assert prefilled == 4
    reference = serve(without, turn, 32)
    assert second.token_ids != reference.token_ids or served_alike(second, reference) > 100 * TOLERANCE


# -- the option, and the cache's matching ---------------------------------------------------------------


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny_ddp.yaml"


@pytest.mark.parametrize(
    ("value", "problem"),
    [("-1", "must be >= 0, got -1"), ("1.5", "expected int, got 1.5"), ("true", "expected int, got True")],
)
def test_a_size_that_is_not_a_count_is_refused_at_its_key(value, problem) -> None:
    override = f"rollout.hf.prefix_cache_sequences={value}"
    with pytest.raises(ConfigError) as raised:
        load_config([EXAMPLE], [override])
    assert raised.value.errors == [
        ("rollout.hf.prefix_cache_sequences", f"{problem} (from override '{override}')")
    ]


def test_the_default_keeps_128_sequences_and_0_is_accepted() -> None:
    assert load_config([EXAMPLE], []).rollout.options.prefix_cache_sequences == 128
    assert (
        load_config([EXAMPLE], ["rollout.hf.prefix_cache_sequences=0"]).rollout.options.prefix_cache_sequences
        == 0
    )


@settings(max_examples=200, deadline=None)
@given(
    shared=st.lists(st.integers(0, 3), max_size=300),
    a=st.lists(st.integers(0, 3), max_size=70),
    b=st.lists(st.integers(0, 3), max_size=70),
)
def test_common_prefix_is_the_first_difference(shared, a, b) -> None:
    a, b = shared + a, shared + b  # long shared runs: across the blocks compared at once
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert common_prefix(tuple(a), tuple(b)) == expected
