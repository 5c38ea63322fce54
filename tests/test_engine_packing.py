"""Padding-free micro-batches: the packed forward gives the padded forward's outputs and gradients on
variable-length sequences, and attention never crosses from one packed sequence into another."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_core.config.engine import ModelConfig
from verl_core.data import (
    CANDIDATE_IDS,
    CANDIDATE_LOG_PROBS,
    COMPUTE_ENTROPY,
    TEMPERATURE,
    TOP_K,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
    responses_batch,
)
from verl_core.data.batch import UID, groups_without_one_prompt, join_prompts_and_responses
from verl_core.engine import top_k_option
from verl_core.testing import collate, make_samples, response_token_mask, save_tiny_models
from verl_core.testing.tiny import VOCAB_SIZE
from verl_core.toolkit import forward_micro_batch, load_hf_model, pack_sequences
from verl_core.toolkit.packing import prompt_groups
from verl_core.toolkit.varlen import VARLEN_SDPA, varlen_sdpa_attention

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp("tiny"))


def batch_of(seed: int, share_prompts: bool = False):
    batch = collate(make_samples(seed, share_prompts=share_prompts))
    batch.set_non_tensor(TEMPERATURE, 0.7)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    return batch


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("role", ["lm", "value"])
def test_packed_outputs_and_gradients_equal_the_padded_ones(dirs, role, attention, share_prompts) -> None:
    # sdpa models run packed attention padded (verl_core.toolkit.varlen) and pack a prompt shared by
    # several samples once; eager ones pack every prompt and attend through the block-diagonal mask
    # transformers builds from the restarting positions.
    batch = batch_of(3, share_prompts)
    mask = response_token_mask(batch)
    results = {}
    for packing in (False, True):
        config = ModelConfig(path=dirs.for_role(role), attn_implementation=attention)
        model = load_hf_model(config, role, packing=packing)
        expected = VARLEN_SDPA if packing and attention == "sdpa" else attention
        assert model.config._attn_implementation == expected
        outputs = forward_micro_batch(model, batch, role, packing=packing)
        loss = sum((value * mask).sum() for value in outputs.values())
        loss.backward()
        results[packing] = (outputs, {name: p.grad.clone() for name, p in model.named_parameters()})
    (padded, padded_grads), (packed, packed_grads) = results[False], results[True]
    assert set(packed) == set(padded)
    for name in padded:
        torch.testing.assert_close(packed[name] * mask, padded[name] * mask, atol=1e-5, rtol=1e-5, msg=name)
        assert (packed[name][~mask] == 0).all()  # padding gives 0, not garbage
    # eager's packed softmax runs over the whole masked row, summing in another order: the embedding
    # gradient (entries up to ~7) then differs by up to 4e-6.
    atol = 1e-6 if attention == "sdpa" else 1e-5
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=atol, rtol=1e-5, msg=name)


def test_packed_sequences_do_not_attend_to_each_other(dirs) -> None:
    model = load_hf_model(ModelConfig(path=dirs.lm), "lm", packing=True).eval()
    batch = batch_of(4)
    changed = batch.clone()
    # Another first sequence: with attention crossing sequences, the later ones' outputs would move.
    first_real = changed["attention_mask"][0].bool()
    changed["input_ids"][0, first_real] = (changed["input_ids"][0, first_real] % 100) + 1
    with torch.no_grad():
        before = forward_micro_batch(model, batch, "lm", packing=True)["log_probs"]
        after = forward_micro_batch(model, changed, "lm", packing=True)["log_probs"]
    torch.testing.assert_close(after[1:], before[1:], atol=1e-6, rtol=0)
    assert not torch.allclose(after[0], before[0])


def test_pack_sequences_finds_every_response_token() -> None:
    # Row 0: 2 prompt + 3 response tokens; row 1: 1 prompt + 1 response (left/right padding).
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    packed = pack_sequences(attention_mask, response_length=3)
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    # Response token t of row i is predicted at its start + prompt length + t - 1.
    assert packed.predicting.tolist() == [1, 2, 3, 5]
    assert packed.response_present.tolist() == [[True, True, True], [True, False, False]]
    assert packed.cu_seq_lens.tolist() == [0, 5, 7] and packed.longest == 5
    assert packed.rows.tolist() == [[0, 1, 2, 3, 4], [5, 6, 0, 0, 0]]  # 0 after the sample's end
    assert packed.slots.tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_samples_of_one_prompt_read_its_single_packed_copy() -> None:
    # Rows 0 and 2 share a 2-token prompt; row 1 has its own 1-token prompt.
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    packed = pack_sequences(attention_mask, response_length=3, groups=torch.tensor([0, 1, 0]))
    # Packed: row 0's prompt + response (4), row 1's (2), row 2's response only (3).
    assert packed.mask.tolist()[2] == [False, False, True, True, True]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4]]
    assert packed.rows.tolist() == [[0, 1, 2, 3, 0], [4, 5, 0, 0, 0], [0, 1, 6, 7, 8]]
    assert packed.slots.tolist() == [0, 1, 2, 3, 5, 6, 12, 13, 14]
    assert packed.predicting.tolist() == [1, 2, 4, 1, 6, 7]  # row 2's first token: the shared prompt's end
    assert packed.cu_seq_lens is None  # not contiguous sequences: variable-length kernels cannot run it


def test_prompt_groups_tell_identical_prompts_apart_from_others() -> None:
    input_ids = torch.tensor([[0, 7, 8, 1], [0, 7, 8, 2], [7, 7, 8, 3], [0, 7, 9, 4]])
    attention_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    groups = prompt_groups(input_ids, attention_mask, response_length=1).tolist()
    assert groups[0] == groups[1] and len({groups[0], groups[2], groups[3]}) == 3


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_varlen_attention_equals_each_sequence_attending_alone(sliding_window) -> None:
    # 3 sequences of 5, 1 and 7 tokens packed in one row; 4 query heads over 2 key/value heads (GQA).
    torch.manual_seed(0)
    lengths = [5, 1, 7]
    tokens = sum(lengths)
    query, key, value = (torch.randn(1, heads, tokens, 8) for heads in (4, 2, 2))
    boundaries = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    # The layout of three sequences packed one after another (all response: no prompt to share).
    attention_mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    layout = pack_sequences(attention_mask, response_length=max(lengths))
    output, _ = varlen_sdpa_attention(
        None, query, key, value, None, scaling=0.3, sliding_window=sliding_window,
        packed_rows=layout.rows, packed_slots=layout.slots,
    )  # fmt: skip
    assert output.shape == (1, tokens, 4, 8)
    for start, end in zip(boundaries[:-1].tolist(), boundaries[1:].tolist(), strict=True):
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
        offset = torch.arange(end - start)[:, None] - torch.arange(end - start)[None, :]
        allowed = (offset >= 0) & (offset < (sliding_window or tokens))
        weights = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf")).softmax(-1)
        expected = (weights @ v).transpose(1, 2)
        torch.testing.assert_close(output[:, start:end], expected, atol=1e-6, rtol=1e-5)


@st.composite
def prompt_groups_batch(draw):
    """GRPO-style rows: groups of samples with one prompt each (lengths, group sizes and padding
    drawn), every sample its own response (at least one token)."""
    tokens = st.integers(1, VOCAB_SIZE - 1)
    prompts, responses = [], []
    for _ in range(draw(st.integers(1, 3))):
        prompt = draw(st.lists(tokens, min_size=1, max_size=7))
        for _ in range(draw(st.integers(1, 4))):
            prompts.append(prompt)
            responses.append(draw(st.lists(tokens, min_size=1, max_size=6)))
    if draw(st.booleans()):  # the groups' rows interleaved, as after a shuffle
        order = draw(st.permutations(range(len(prompts))))
        prompts, responses = [prompts[i] for i in order], [responses[i] for i in order]
    batch = responses_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_token_id=0)
    batch.set_non_tensor(TEMPERATURE, 0.7)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    return batch


@pytest.fixture(scope="module")
def shared_and_padded(dirs):
    config = ModelConfig(path=dirs.lm)
    return load_hf_model(config, "lm", packing=True), load_hf_model(config, "lm", packing=False)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=prompt_groups_batch())
def test_shared_prompts_give_the_unshared_log_probs_and_gradients(shared_and_padded, batch) -> None:
    """Each group's prompt packed once (its samples' responses reading that copy) against every
    sample computed with its own prompt, padded: log-probs and entropy within 1e-5, gradients within 1e-6
    of each tensor's largest entry."""
    mask = response_token_mask(batch)
    results = []
    for model, packing in zip(shared_and_padded, (True, False), strict=True):
        model.zero_grad(set_to_none=True)
        outputs = forward_micro_batch(model, batch, "lm", packing=packing, share_prompts=True)
        sum((value * mask).sum() for value in outputs.values()).backward()
        results.append((outputs, {name: p.grad.clone() for name, p in model.named_parameters()}))
    (shared, shared_grads), (padded, padded_grads) = results
    for name in padded:
        torch.testing.assert_close(shared[name] * mask, padded[name] * mask, atol=1e-5, rtol=1e-5, msg=name)
    for name, grad in padded_grads.items():
        # float32 sums in another order: a shared prompt token's embedding gradient (entries up to ~9)
        # differed by 1.4e-6, two ulps, in 1 of 200 examples; 1e-6 of the tensor's largest entry holds.
        scale = max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-6 * scale, rtol=1e-5, msg=name)
    groups = prompt_groups(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[-1])
    packed = pack_sequences(batch["attention_mask"], batch["responses"].shape[-1], groups)
    prompt_tokens = batch["attention_mask"][:, : -batch["responses"].shape[-1]].sum(dim=-1)
    # Each distinct prompt was packed once: the packed tokens are the responses plus one prompt per group.
    distinct = sum(int(prompt_tokens[groups == g][0]) for g in groups.unique())
    assert int(packed.mask.sum()) == int(mask.sum()) + distinct


# -- top-k and candidate log-probs (GKD's teacher and student) --------------------------------------


def plain_log_softmax(model, batch) -> torch.Tensor:
    """``log_softmax(logits / T)`` ``[b, R, V]`` at the positions predicting each response token,
    straight from the padded model: what the engine's top-k and candidate log-probs must equal."""
    response_length = batch["responses"].shape[-1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    ).logits[:, -response_length - 1 : -1]
    return torch.log_softmax(logits / 0.7, dim=-1)


#: (packing, logits_chunk_size): padded and packed (prompts shared), whole and 3 tokens a chunk.
TOP_K_LAYOUTS = [(False, None), (True, None), (False, 3), (True, 3)]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=prompt_groups_batch(), k=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_top_k_and_candidate_log_probs_equal_the_plain_log_softmax(shared_and_padded, batch, k, seed) -> None:
    """On every layout (padded or packed with shared prompts, whole or chunked logits): the top-k
    log-probs are the tempered log-softmax's ``k`` largest, descending, at their ids; the candidates'
    are the log-softmax at the given ids (duplicates included), and a loss on them has the plain
    log-softmax's gradients (within 1e-5: float32 sums of up to six weighted candidates per token);
    padding gives 0 (ids 0)."""
    generator = torch.Generator().manual_seed(seed)
    mask = response_token_mask(batch)
    real = batch["attention_mask"][:, -batch["responses"].shape[-1] :].bool()
    candidates = torch.randint(0, VOCAB_SIZE, (*mask.shape, k), generator=generator)
    weights = torch.randn(*mask.shape, k, generator=generator)
    batch[CANDIDATE_IDS] = candidates
    batch.set_non_tensor(TOP_K, k)

    def loss_of(candidate_log_probs, log_probs):
        return (weights * candidate_log_probs * mask[..., None]).sum() + (log_probs * mask).sum()

    shared, padded = shared_and_padded
    padded.zero_grad(set_to_none=True)
    plain = plain_log_softmax(padded, batch)
    loss_of(plain.gather(-1, candidates), plain.gather(-1, batch["responses"][..., None])[..., 0]).backward()
    expected_grads = {name: p.grad.clone() for name, p in padded.named_parameters()}
    plain = plain.detach()
    expected_top = plain.topk(k, dim=-1).values
    for packing, chunk_size in TOP_K_LAYOUTS:
        model = shared if packing else padded
        model.zero_grad(set_to_none=True)
        outputs = forward_micro_batch(model, batch, "lm", packing=packing, logits_chunk_size=chunk_size)
        layout = f"packing={packing}, logits_chunk_size={chunk_size}"
        top, ids = outputs[TOP_K_LOG_PROBS], outputs[TOP_K_IDS]
        assert ids.dtype == torch.int64 and not top.requires_grad, layout
        torch.testing.assert_close(top[real], expected_top[real], atol=1e-5, rtol=1e-5, msg=layout)
        torch.testing.assert_close(top[real], plain.gather(-1, ids)[real], atol=1e-5, rtol=1e-5, msg=layout)
        assert (top[..., :-1] >= top[..., 1:]).all(), layout
        assert (ids[real].sort(dim=-1).values.diff(dim=-1) > 0).all(), layout  # k distinct tokens
        expected_candidates = plain.gather(-1, candidates)
        candidate_log_probs = outputs[CANDIDATE_LOG_PROBS]
        torch.testing.assert_close(
            candidate_log_probs[real], expected_candidates[real], atol=1e-5, rtol=1e-5, msg=layout
        )
        for name in (TOP_K_LOG_PROBS, TOP_K_IDS, CANDIDATE_LOG_PROBS):
            assert (outputs[name][~real] == 0).all(), (layout, name)
        loss_of(candidate_log_probs, outputs["log_probs"]).backward()
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(
                parameter.grad,
                expected_grads[name],
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, where=f"{layout}: {name}": f"{where}: {m}",
            )


def test_the_top_k_comparison_catches_ascending_ids_and_a_shifted_candidate(dirs) -> None:
    """The comparisons above fail on outputs that are wrong the two likeliest ways: the top-k in
    ascending order, and the candidates' log-probs read one position late."""
    model = load_hf_model(ModelConfig(path=dirs.lm), "lm", packing=False).eval()
    batch = batch_of(3)
    real = batch["attention_mask"][:, -batch["responses"].shape[-1] :].bool()
    batch[CANDIDATE_IDS] = torch.randint(
        0, VOCAB_SIZE, (*real.shape, 4), generator=torch.Generator().manual_seed(0)
    )
    batch.set_non_tensor(TOP_K, 4)
    with torch.no_grad():
        outputs = forward_micro_batch(model, batch, "lm")
        plain = plain_log_softmax(model, batch)
    top = outputs[TOP_K_LOG_PROBS]
    assert torch.allclose(top[real], plain.topk(4, dim=-1).values[real], atol=1e-5)
    assert not torch.allclose(top.flip(-1)[real], plain.topk(4, dim=-1).values[real], atol=1e-5)
    shifted = plain.roll(1, dims=1).gather(-1, batch[CANDIDATE_IDS])
    assert torch.allclose(
        outputs[CANDIDATE_LOG_PROBS][real], plain.gather(-1, batch[CANDIDATE_IDS])[real], atol=1e-5
    )
    assert not torch.allclose(outputs[CANDIDATE_LOG_PROBS][real], shifted[real], atol=1e-5)


def test_a_forward_pass_without_top_k_or_candidates_returns_neither(dirs) -> None:
    model = load_hf_model(ModelConfig(path=dirs.lm), "lm", packing=True).eval()
    with torch.no_grad():
        outputs = forward_micro_batch(model, batch_of(3), "lm", packing=True)
    assert set(outputs) == {"log_probs", "entropy"}


@pytest.mark.parametrize(("value", "expected"), [(None, 0), (0, 0), (5, 5), (torch.tensor(3), 3)])
def test_the_top_k_option_is_read_with_its_default(value, expected) -> None:
    batch = batch_of(3)
    if value is not None:
        batch.set_non_tensor(TOP_K, value)
    assert top_k_option(batch) == expected


@pytest.mark.parametrize("value", [-1, 2.0, True, "4", torch.tensor(1.5)])
def test_a_top_k_that_is_not_a_count_is_refused_naming_the_key(value) -> None:
    batch = batch_of(3)
    batch.set_non_tensor(TOP_K, value)
    with pytest.raises(ValueError, match=r"the batch's 'top_k' is .*: it must be an int >= 0"):
        top_k_option(batch)


@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    rewritten=st.sets(st.integers(0, 15), max_size=4),
    prompt_width=st.integers(1, 4),
)
def test_groups_without_one_prompt_are_exactly_those_with_a_rewritten_sample(
    sizes, rewritten, prompt_width
) -> None:
    """Each group's samples hold its prompt; the rows in ``rewritten`` get another first prompt token: the
    groups reported are the ones holding such a row that is not its group's only row, each with all its
    rows; a group of one sample always holds one prompt."""
    uid = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    rows = len(uid)
    prompts = (uid[:, None] * 10 + torch.arange(prompt_width)[None]) % 97 + 1
    prompts[[row for row in rewritten if row < rows], 0] += 100
    responses = torch.ones(rows, 2, dtype=torch.long)
    batch = join_prompts_and_responses(
        prompts, torch.ones_like(prompts), responses, torch.ones_like(responses)
    )
    batch[UID] = uid
    expected = {}
    for group in range(len(sizes)):
        members = (uid == group).nonzero().flatten().tolist()
        changed = [row for row in members if row in rewritten]
        if 0 < len(changed) < len(members):
            expected[group] = members
    assert groups_without_one_prompt(batch) == expected
