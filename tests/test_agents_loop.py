"""The agent loop, token in / token out, against independent references.

- Over random conversations (hypothesis), the prompt and response built turn by turn are exactly the
  chat template's rendering of the whole conversation, encoded at once; ``response_mask`` is 1 exactly
  on the model's spans, found in that rendering (after each generation prompt, up to and including the
  end-of-turn token); no environment token has a log-prob.
- With a real model, the log-probs the rollout reported equal a plain forward pass over the final
  sequence at every model token. A loop that re-encodes the decoded reply (kept below) fails that check:
  the chat tokenizer merges ``a`` ``b`` into ``ab``.
- Templates that are not append-only, and ones whose end of turn is no EOS, are refused by name.
- ``run_requests`` (each conversation a coroutine sending its own requests) equals a reference written
  out here: conversation after conversation, one ``generate_request`` of the real rollout per turn, the
  environment's ids from the chat template's rendering of the whole conversation; whatever order the
  requests are served in. A loop that shares one environment between conversations fails it.
"""

from __future__ import annotations

import asyncio
import random
import types

import attrs
import pytest
import torch
from fixtures.chat import COUNTING, END, START, build_chat_model_dir, build_chat_tokenizer, scripted_generate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from verl_core.agents import AgentLoop, StepResult, TurnTemplate
from verl_core.agents.session import conversation_metrics
from verl_core.config.run import AgentConfig
from verl_core.data.batch import (
    ATTENTION_MASK,
    INPUT_IDS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    join_prompts_and_responses,
    left_pad,
)
from verl_core.errors import AgentError
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.requests import FinishReason, RolloutRequest, RolloutResponse, one_prompt_call
from verl_core.seeds import derive_seed

TOKENIZER = build_chat_tokenizer()
TEMPLATE = TurnTemplate(TOKENIZER, [TOKENIZER.eos_token_id])
EOS = TOKENIZER.eos_token_id
SAMPLING = SamplingParams(max_new_tokens=1, eos_token_ids=(EOS,), pad_token_id=TOKENIZER.pad_token_id)


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class ScriptedEnvironment:
    """Answers turn ``k`` with ``answers[k]``; ends after the last."""

    def __init__(self, answers: list[list[dict]]):
        self.answers = answers
        self.turn = 0

    def reset(self, row) -> None:
        self.turn = 0

    def step(self, model_text: str) -> StepResult:
        if self.turn == len(self.answers):
            return StepResult(done=True, reward=1.0)
        answer = self.answers[self.turn]
        self.turn += 1
        return StepResult(observation=answer)


def model_spans_of(ids: list[int]) -> list[int]:
    """The reference mask: 1 from after each ``<|im_start|>assistant\\n`` to its ``<|im_end|>`` inclusive."""
    opener = [TOKENIZER.convert_tokens_to_ids(START), *encode("assistant\n")]
    mask, inside, position = [0] * len(ids), False, 0
    while position < len(ids):
        if not inside and ids[position : position + len(opener)] == opener:
            position += len(opener)
            inside = True
            continue
        if inside:
            mask[position] = 1
            inside = ids[position] != EOS
        position += 1
    return mask


texts = st.text(alphabet="abtoreXY 12+=,.", min_size=1, max_size=8).filter(lambda t: t.strip() == t)
turn = st.tuples(texts, st.lists(st.tuples(st.sampled_from(["tool", "user"]), texts), min_size=1, max_size=2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(question=texts, turns=st.lists(turn, min_size=1, max_size=3), final=texts)
def test_turn_by_turn_ids_are_the_whole_conversation_rendered_at_once(question, turns, final) -> None:
    prompt = [{"role": "user", "content": question}]
    replies = [encode(reply) + [EOS] for reply, _ in turns] + [encode(final) + [EOS]]
    answers = [[{"role": role, "content": text} for role, text in messages] for _, messages in turns]
    loop = AgentLoop(TEMPLATE, lambda config: ScriptedEnvironment(answers), AgentConfig(max_turns=10), 4096)
    prompt_ids = encode(TEMPLATE.render(prompt, add_generation_prompt=True))
    batch, (conversation,) = loop.run(
        scripted_generate([replies]), [prompt_ids], [None], [prompt], SAMPLING, 0
    )

    whole = list(prompt)
    for (reply, _), messages in zip(turns, answers, strict=True):
        whole += [{"role": "assistant", "content": reply}, *messages]
    whole.append({"role": "assistant", "content": final})
    rendered = TOKENIZER.apply_chat_template(whole, tokenize=False)
    expected = encode(rendered.removesuffix("\n"))  # the conversation ends at the model's EOS
    real = batch[ATTENTION_MASK][0].bool()
    assert batch[INPUT_IDS][0][real].tolist() == expected
    response = expected[len(prompt_ids) :]
    assert batch[RESPONSE_MASK][0].tolist() == model_spans_of(expected)[len(prompt_ids) :]
    log_probs = batch[ROLLOUT_LOG_PROBS][0]
    assert torch.equal(log_probs, -torch.tensor(response).float() * batch[RESPONSE_MASK][0])
    assert conversation.reward == 1.0 and conversation.turns == len(turns) + 1


def test_the_reference_mask_can_fail() -> None:
    ids = encode(TEMPLATE.render([{"role": "user", "content": "q"}], add_generation_prompt=True)) + encode(
        "ab"
    )
    assert model_spans_of(ids + [EOS]) == [0] * (len(ids) - 1) + [1, 1]  # "ab" is one token


def test_a_turn_cut_short_is_closed_by_the_template_and_the_budget_holds() -> None:
    answers = [[{"role": "tool", "content": "42"}]] * 3
    config = AgentConfig(max_turns=3, max_tokens_per_turn=4)
    loop = AgentLoop(TEMPLATE, lambda c: ScriptedEnvironment(answers), config, response_length=30)
    replies = [[encode("abcdef"), encode("xy") + [EOS], encode("z") + [EOS]]]
    batch, (conversation,) = loop.run(scripted_generate(replies), [[5]], [None], [[]], SAMPLING, 0)
    roles = [role for _, _, role in conversation.spans]
    # 4 model tokens (cut), the whole end of turn (no EOS was sampled) and the tool message; then the
    # second reply; the second tool message does not fit in 30 tokens: the conversation ends.
    assert roles == ["assistant", "template", "tool", "assistant"]
    assert conversation.spans[1][1] - conversation.spans[1][0] == len(TEMPLATE.end_of_turn_ids)
    assert len(conversation.response_ids) <= 30 and batch[RESPONSES].shape[1] <= 30
    assert batch[RESPONSE_MASK].sum() == 4 + 3
    assert [m["role"] for m in conversation.messages] == ["assistant", "tool", "assistant"]  # none dropped


def test_overflow_truncates_when_told() -> None:
    answers = [[{"role": "tool", "content": "X" * 50}]]
    config = AgentConfig(max_turns=3, on_overflow="truncate")
    loop = AgentLoop(TEMPLATE, lambda c: ScriptedEnvironment(answers), config, response_length=20)
    batch, (conversation,) = loop.run(scripted_generate([[[7, EOS]]]), [[5]], [None], [[]], SAMPLING, 0)
    assert len(conversation.response_ids) == 20 and conversation.done
    assert batch[RESPONSE_MASK][0].tolist() == [1, 1] + [0] * 18


class EnvironmentByRow(ScriptedEnvironment):
    """``ScriptedEnvironment`` whose answers are those of its row (``reset(answers)``)."""

    def reset(self, row) -> None:
        self.answers, self.turn = row, 0


def test_turns_and_cuts_are_counted_per_conversation() -> None:
    """Five scripted conversations, one per way a conversation ends (response budget 60 tokens,
    max_turns 3), against their turns and cuts written out, and ``conversation_metrics`` over them."""
    tool = [{"role": "tool", "content": "42"}]
    reply = encode("x") + [EOS]
    scripts = [  # (the environment's answers before it says done, the model's replies)
        ([], [reply]),  # the model answers at once: 1 turn, not cut
        ([tool] * 3, [reply] * 3),  # the environment answers the third turn too: cut by max_turns
        ([tool] * 2, [reply] * 3),  # the environment is done after the third turn: not cut
        ([], [encode("abcdefghij" * 8)]),  # a final answer past the budget, no EOS: cut by the budget
        ([[{"role": "tool", "content": "Z" * 80}]], [reply]),  # a message that does not fit: cut likewise
    ]
    config = AgentConfig(max_turns=3)
    loop = AgentLoop(TEMPLATE, lambda c: EnvironmentByRow([]), config, response_length=60)
    rows = [answers for answers, _ in scripts]
    _, conversations = loop.run(
        scripted_generate([replies for _, replies in scripts]), [[5]] * 5, rows, [[]] * 5, SAMPLING, 0
    )
    assert [c.turns for c in conversations] == [1, 3, 3, 1, 1]
    assert [c.cut for c in conversations] == [None, "max_turns", None, "response_length", "response_length"]
    assert conversation_metrics(conversations) == {
        "agent/turns/mean": 9 / 5,
        "agent/turns/max": 3.0,
        "agent/cut/max_turns": 1 / 5,
        "agent/cut/response_length": 2 / 5,
    }


class ScoringCuts(EnvironmentByRow):
    """``EnvironmentByRow`` that scores a conversation the loop cut: 0.5 for ``max_turns``, 0.25 for the
    response budget (``on_cut``)."""

    def on_cut(self, reason: str) -> float | None:
        self.cuts = getattr(self, "cuts", 0) + 1
        return {"max_turns": 0.5, "response_length": 0.25}[reason]


@pytest.mark.parametrize("way", ["run", "run_requests"])
def test_an_environment_scores_the_conversations_the_loop_cut_once_each(way) -> None:
    """The three ways a conversation ends besides being cut get the step's reward (1 when done, else
    none); a cut one gets ``on_cut``'s, from ``on_cut`` called once; an environment without ``on_cut``
    (``EnvironmentByRow``, as the base class's ``None``) leaves a cut one's reward as the steps gave it."""
    tool = [{"role": "tool", "content": "42"}]
    reply = encode("x") + [EOS]
    scripts = [([], [reply]), ([tool] * 3, [reply] * 3), ([], [encode("abcdefghij" * 8)])]
    config = AgentConfig(max_turns=3)
    rows = [answers for answers, _ in scripts]
    rewards = {}
    for environment in (ScoringCuts, EnvironmentByRow):
        made: list = []

        def make(config, environment=environment, made=made):
            made.append(environment([]))
            return made[-1]

        loop = AgentLoop(TEMPLATE, make, config, response_length=60)
        replies = [replies for _, replies in scripts]
        if way == "run":
            _, conversations = loop.run(scripted_generate(replies), [[5]] * 3, rows, [[]] * 3, SAMPLING, 0)
        else:
            _, conversations = asyncio.run(
                loop.run_requests(scripted_submit(replies), [[5]] * 3, rows, [[]] * 3, SAMPLING, 0)
            )
        assert [c.cut for c in conversations] == [None, "max_turns", "response_length"]
        rewards[environment.__name__] = [c.reward for c in conversations]
        assert [getattr(e, "cuts", 0) for e in made] == ([0, 1, 1] if environment is ScoringCuts else [0] * 3)
    # The budget's cut came after the environment's done (reward 1), which on_cut replaces.
    assert rewards == {"ScoringCuts": [1.0, 0.5, 0.25], "EnvironmentByRow": [1.0, None, 1.0]}


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        (COUNTING, "not append-only"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "does not start with a token"),
        (
            "{% for m in messages %}" + START + "{{ m['role'] }}\n{% if m['role'] == 'assistant' %}<think>"
            "{% endif %}{{ m['content'] }}"
            + END
            + "{% endfor %}{% if add_generation_prompt %}"
            + START
            + "assistant\n{% endif %}",
            "between the generation prompt and the assistant's reply",
        ),
    ],
)
def test_templates_the_loop_cannot_follow_are_refused(template, problem) -> None:
    with pytest.raises(AgentError, match=problem):
        TurnTemplate(build_chat_tokenizer(template), [EOS])


# -- with a real model: the rollout's log-probs are the engine's ----------------------------------


class ReencodingLoop(AgentLoop):
    """Broken on purpose: appends the decoded reply encoded again (what the loop must never do)."""

    def model_turn(self, generated, log_probs):
        ids = self.template.encode(self.template.reply_text(generated))
        ids += [EOS] if generated and generated[-1] == EOS else []
        return ids, (log_probs + [0.0] * len(ids))[: len(ids)]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = build_chat_model_dir(tmp_path_factory.mktemp("chat_model"))
    return directory, AutoModelForCausalLM.from_pretrained(directory).eval()


def teacher_forced_generate(model, continuations: list[list[int]]):
    """A rollout that 'samples' the given ids (``a`` and ``b`` as separate tokens) and reports the
    model's own log-probs of them, as a rollout must."""

    def generate(prompts, sampling, seed) -> TensorDict:
        rows = [list(prompt) + continuations[i] for i, prompt in enumerate(prompts)]
        ids, mask = left_pad(rows, 0)
        with torch.no_grad():
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
            )
        all_log_probs = logits.logits.float().log_softmax(-1)
        prompt_ids, prompt_mask = left_pad([list(p) for p in prompts], 0)
        responses, response_mask = left_pad(continuations, 0)  # all one length here
        width = responses.shape[1]
        log_probs = all_log_probs[:, -width - 1 : -1].gather(-1, responses[..., None])[..., 0]
        batch = join_prompts_and_responses(prompt_ids, prompt_mask, responses, response_mask)
        batch[ROLLOUT_LOG_PROBS] = log_probs
        return batch

    return generate


def log_prob_mismatch(model, batch: TensorDict) -> float:
    """Largest difference between the rollout's log-probs and a plain forward pass's over the final
    sequences, at the model's tokens (the check a training engine's first step amounts to)."""
    mask = batch[ATTENTION_MASK]
    with torch.no_grad():
        logits = model(
            input_ids=batch[INPUT_IDS], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits.float()
    width = batch[RESPONSES].shape[1]
    log_probs = logits[:, -width - 1 : -1].log_softmax(-1).gather(-1, batch[RESPONSES][..., None])[..., 0]
    model_tokens = batch[RESPONSE_MASK].bool()
    return float((log_probs - batch[ROLLOUT_LOG_PROBS])[model_tokens].abs().max())


def scripted_submit(replies: list[list[list[int]]]):
    """``scripted_generate`` as ``run_requests``'s ``submit``: conversation ``i`` (from its session key)
    answered ``replies[i]`` turn after turn."""
    turns = [0] * len(replies)

    async def submit(request: RolloutRequest, session: str) -> RolloutResponse:
        index = int(session.split("-")[1])
        ids = replies[index][turns[index]][: request.sampling.max_new_tokens]
        turns[index] += 1
        finish = FinishReason.EOS if ids and ids[-1] == EOS else FinishReason.LENGTH
        return RolloutResponse(request.request_id, ids, [-float(i) for i in ids], finish)

    return submit


def submitting(generate):
    """``generate`` as ``run_requests``'s ``submit``: each request one call of one prompt."""

    async def submit(request: RolloutRequest, session: str):
        return request.joined(*one_prompt_call(types.SimpleNamespace(generate=generate), request))

    return submit


@pytest.mark.parametrize("path", ["run", "run_requests"])
@pytest.mark.parametrize(("loop_class", "matches"), [(AgentLoop, True), (ReencodingLoop, False)])
def test_rollout_log_probs_match_a_forward_pass_unless_the_loop_re_encodes(
    chat_model, loop_class, matches, path
):
    _, model = chat_model
    answers = [[{"role": "tool", "content": "ok"}]]
    loop = loop_class(TEMPLATE, lambda c: ScriptedEnvironment(answers), AgentConfig(max_turns=2), 200)
    prompt = [{"role": "user", "content": "go"}]
    prompt_ids = encode(TEMPLATE.render(prompt, add_generation_prompt=True))
    sampled = [encode("a")[0], encode("b")[0], encode("c")[0], EOS]  # "ab" re-encodes as one token
    generate = teacher_forced_generate(model, [sampled])
    if path == "run":
        batch, _ = loop.run(generate, [prompt_ids], [None], [prompt], SAMPLING, 0)
    else:
        batch, _ = asyncio.run(
            loop.run_requests(submitting(generate), [prompt_ids], [None], [prompt], SAMPLING, 0)
        )
    mismatch = log_prob_mismatch(model, batch)
    assert (mismatch < 1e-4) == matches, mismatch


def test_the_hf_rollout_runs_conversations_whose_log_probs_match(chat_model) -> None:
    from verl_core.config.engine import ModelConfig
    from verl_core.rollout.hf import HFRollout

    directory, model = chat_model
    rollout = HFRollout(ModelConfig(path=str(directory)))
    rollout.initialize()
    answers = [[{"role": "tool", "content": "result 7"}]] * 3
    loop = AgentLoop(
        TEMPLATE, lambda c: ScriptedEnvironment(answers), AgentConfig(max_turns=3, max_tokens_per_turn=6), 80
    )
    prompts = [[{"role": "user", "content": text}] for text in ("hi", "compute 12*34")]
    ids = [encode(TEMPLATE.render(p, add_generation_prompt=True)) for p in prompts]
    sampling = SamplingParams(max_new_tokens=6, eos_token_ids=(EOS,), pad_token_id=0)
    batch, conversations = loop.run(rollout.generate, ids, [None, None], prompts, sampling, seed=3)
    assert all(c.turns >= 2 for c in conversations)
    assert log_prob_mismatch(model, batch) < 1e-4
    environment_tokens = (
        batch[ATTENTION_MASK][:, -batch[RESPONSES].shape[1] :].bool() & ~batch[RESPONSE_MASK].bool()
    )
    assert environment_tokens.any() and not batch[ROLLOUT_LOG_PROBS][environment_tokens].any()


# -- requests: each conversation a coroutine of its own -------------------------------------------


class SharedEnvironmentLoop(AgentLoop):
    """Broken on purpose: one environment (the first row's) answers every conversation."""

    def environments(self, rows):
        return super().environments(rows[:1]) * len(rows)


@pytest.fixture(scope="module")
def hf_rollout(chat_model):
    from verl_core.config.engine import ModelConfig
    from verl_core.rollout.config import HFRolloutConfig
    from verl_core.rollout.hf import HFRollout

    # Without the prefix cache: a request served from a cached prefix has its log-probs to float
    # rounding only (tests/test_rollout_prefix_cache.py), and which prefix is cached depends on the
    # order requests came in; the loop's results, compared bitwise here, must not.
    rollout = HFRollout(ModelConfig(path=str(chat_model[0])), HFRolloutConfig(prefix_cache_sequences=0))
    rollout.initialize()
    return rollout


def sequential_reference(rollout, prompts, scripts, config, response_length, seed):
    """Each conversation's ids, model mask and log-probs, written out: conversation after conversation,
    one ``generate_request`` per turn (the prompt and the response so far; the seed derived from the
    conversation's index and the turn), the environment's answers (``scripts[i][turn]``, done after the
    last) appended as the ids after the model's in the chat template's rendering of the conversation
    with them."""
    results = []
    for index, (prompt, answers) in enumerate(zip(prompts, scripts, strict=True)):
        ids, mask, log_probs = list(prompt), [], []
        messages = [{"role": "user", "content": "q"}]
        for turn in range(config.max_turns):
            room = min(response_length - len(mask), config.max_tokens_per_turn)
            request = RolloutRequest(
                ids,
                attrs.evolve(SAMPLING, max_new_tokens=room),
                derive_seed("agent-request", seed, index, turn),
            )
            response = asyncio.run(rollout.generate_request(request))
            ids += response.token_ids
            mask += [1] * len(response.token_ids)
            log_probs += response.log_probs
            if turn == len(answers) or turn + 1 == config.max_turns:
                break
            # What follows an assistant turn does not depend on its text in this (append-only) template.
            messages.append({"role": "assistant", "content": "."})
            before = TOKENIZER.apply_chat_template(messages, tokenize=False)
            messages += answers[turn]
            after = TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            environment = encode(END + "\n" + after[len(before) :])
            environment = environment[1:] if response.token_ids[-1] == EOS else environment
            ids += environment
            mask += [0] * len(environment)
            log_probs += [0.0] * len(environment)
        assert len(mask) < response_length  # the budget never binds here: nothing is cut
        results.append((ids, mask, log_probs))
    return results


@pytest.mark.parametrize(
    ("loop_class", "delays", "equal"),
    [(AgentLoop, False, True), (AgentLoop, True, True), (SharedEnvironmentLoop, False, False)],
    ids=["in-order", "served-in-random-order", "broken-shared-environment"],
)
def test_run_requests_equals_conversations_run_one_after_another(
    hf_rollout, loop_class, delays, equal
) -> None:
    tool = [{"role": "tool", "content": "result 7"}]
    scripts = [[tool, tool, tool], [], [tool], [[{"role": "user", "content": "more"}], tool]]
    prompts = [encode(TEMPLATE.render([{"role": "user", "content": "q"}], add_generation_prompt=True))] * 4
    config = AgentConfig(max_turns=3, max_tokens_per_turn=6)
    loop = loop_class(TEMPLATE, lambda c: EnvironmentByRow([]), config, 120)
    sessions: dict[str, list[tuple[int, ...]]] = {}
    jitter = random.Random(0)

    async def submit(request: RolloutRequest, session: str):
        sessions.setdefault(session, []).append(request.prompt_ids)
        if delays:  # another order of arrival and of completion than the conversations'
            await asyncio.sleep(jitter.random() * 0.02)
        response = await hf_rollout.generate_request(request)
        if delays:
            await asyncio.sleep(jitter.random() * 0.02)
        return response

    messages = [[{"role": "user", "content": "q"}]] * 4
    batch, conversations = asyncio.run(loop.run_requests(submit, prompts, scripts, messages, SAMPLING, 11))

    reference = sequential_reference(hf_rollout, prompts, scripts, config, 120, seed=11)
    width = batch[RESPONSES].shape[1]
    got = []
    for row, prompt in enumerate(prompts):
        real = batch[ATTENTION_MASK][row].bool()
        length = int(real.sum()) - len(prompt)
        got.append(
            (
                batch[INPUT_IDS][row][real].tolist(),
                batch[RESPONSE_MASK][row, :length].tolist(),
                batch[ROLLOUT_LOG_PROBS][row, :length].tolist(),
            )
        )
        assert not batch[RESPONSE_MASK][row, length:].any() and length <= width
    assert (got == reference) == equal
    if equal:
        assert [c.turns for c in conversations] == [3, 1, 2, 3]
        assert [c.cut for c in conversations] == ["max_turns", None, None, None]
        # One session per conversation, each sending its own sequence as it grows, turn after turn.
        assert sorted(sessions) == sorted(f"11-{index}" for index in range(4))
        for index, (ids, _, _) in enumerate(reference):
            sent = sessions[f"11-{index}"]
            assert len(sent) == conversations[index].turns
            assert all(tuple(ids[: len(prompt)]) == prompt for prompt in sent)
