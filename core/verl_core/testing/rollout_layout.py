"""The rollout kit's ``batch_contract`` check: the keys, shapes, dtypes and layout of what ``generate``
returns (prompts left-padded and in order, responses right-padded, positions, a response that stops at
its first EOS and keeps it inside its mask). The other checks read responses through the rollout's own
``response_mask`` and trust this one for the layout."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_core.data.batch import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
)
from verl_core.testing.report import Comparison
from verl_core.testing.rollout_context import (
    EOS_TOKEN_IDS,
    REQUIRED_KEYS,
    RolloutContext,
    make_prompts,
    passed,
    rows_of,
)
from verl_core.testing.tiny import PAD_TOKEN_ID


def check_batch_contract(ctx: RolloutContext) -> list[Comparison]:
    check = "batch_contract"
    max_new_tokens = 6
    # Every length from 1 to 8, four times, so that prompts are left-padded by 0 to 7 tokens.
    prompts = make_prompts([1 + i % 8 for i in range(32)], seed=101)
    output = ctx.generate(prompts, seed=7, max_new_tokens=max_new_tokens, eos_token_ids=EOS_TOKEN_IDS)
    comparisons = [_layout_shapes(check, output, len(prompts), max_new_tokens)]
    if not comparisons[0].passed:
        return comparisons  # nothing below can be read from tensors of the wrong shapes
    devices = sorted({str(output[key].device) for key in REQUIRED_KEYS} - {"cpu"})
    comparisons.append(
        passed(
            check,
            "on the CPU",
            [f"tensors on {devices}: generate() returns its batch on the CPU"] if devices else [],
            "every tensor on the CPU",
        )
    )
    output = output.to("cpu")
    batch, width = output[RESPONSES].shape
    prompt_width = output[INPUT_IDS].shape[-1] - width
    attention_mask = output[ATTENTION_MASK]
    response_mask = output[RESPONSE_MASK]
    pad = PAD_TOKEN_ID

    problems = []
    for row, prompt in enumerate(prompts):
        expected_mask = [0] * (prompt_width - len(prompt)) + [1] * len(prompt)
        got_mask = attention_mask[row, :prompt_width].tolist()
        got_ids = output[INPUT_IDS][row, :prompt_width].tolist()
        if got_mask != expected_mask:
            problems.append(f"row {row} (a {len(prompt)}-token prompt): attention_mask {got_mask}")
        elif got_ids[prompt_width - len(prompt) :] != prompt:
            problems.append(
                f"row {row}: prompt tokens {got_ids} are not its prompt {prompt} (rows out of order?)"
            )
        elif any(token != pad for token in got_ids[: prompt_width - len(prompt)]):
            problems.append(f"row {row}: prompt padding {got_ids} is not the pad id {pad}")
    comparisons.append(
        passed(
            check,
            "prompts left-padded, in prompt order",
            problems,
            f"all {batch} prompts left-padded to {prompt_width} tokens with the pad id, in order",
        )
    )

    problems = []
    lengths = []
    for row in range(batch):
        mask = response_mask[row].tolist()
        length = int(sum(mask))
        lengths.append(length)
        if mask != [1] * length + [0] * (width - length):
            problems.append(f"row {row}: response_mask {mask} is not 1s then 0s")
            continue
        after = output[RESPONSES][row, length:]
        if bool((after != pad).any()):
            problems.append(
                f"row {row}: tokens {after.tolist()} after the response's {length} tokens are not the pad id "
                f"{pad} (a token left out of the mask?)"
            )
        elif bool((output[ROLLOUT_LOG_PROBS][row, length:] != 0).any()):
            problems.append(f"row {row}: rollout_log_probs after the response are not 0")
    comparisons.append(
        passed(
            check,
            "responses right-padded",
            problems,
            f"responses of {min(lengths)} to {max(lengths)} tokens right-padded to {width} with the pad "
            "id, log-probs 0 after them",
        )
    )

    problems = []
    if not torch.equal(output[INPUT_IDS][:, prompt_width:], output[RESPONSES]):
        problems.append("input_ids' response columns are not responses")
    if not torch.equal(attention_mask[:, prompt_width:], response_mask):
        problems.append("attention_mask's response columns are not response_mask")
    expected_positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    if not torch.equal(output[POSITION_IDS], expected_positions):
        differs = (output[POSITION_IDS] != expected_positions).any(dim=-1).nonzero()[:, 0].tolist()
        problems.append(
            f"position_ids of rows {differs[:5]} are not (attention_mask.cumsum(-1) - 1).clamp(min=0): "
            "positions must count real tokens only"
        )
    comparisons.append(
        passed(
            check,
            "input_ids, attention_mask, position_ids",
            problems,
            "[prompt | response] columns, masks and positions as the batch contract computes them",
        )
    )

    eos = set(EOS_TOKEN_IDS)
    problems = []
    stopped = full = 0
    # Read through the mask, wherever it is: a response mask that is not 1s then 0s is reported above.
    for row, read in enumerate(rows_of(output)):
        response = read.response
        early = [t for t, token in enumerate(response[:-1]) if token in eos]
        if not response:
            problems.append(f"row {row}: an empty response (a response has at least one token)")
        elif early:
            problems.append(
                f"row {row}: response {response} holds EOS id {response[early[0]]} at token {early[0]} "
                "and goes on (generation must stop at the first EOS and keep it as the last token)"
            )
        elif response[-1] in eos:
            stopped += 1
        elif len(response) == max_new_tokens:
            full += 1
        else:
            after = output[RESPONSES][row, int(read.columns[-1]) + 1 :].tolist()
            dropped = (
                " (an EOS id follows outside the mask: the EOS was dropped from it)"
                if any(token in eos for token in after)
                else ""
            )
            problems.append(
                f"row {row}: response {response} ends after {len(response)} of {max_new_tokens} tokens "
                f"without an EOS id{dropped}"
            )
    comparisons.append(
        passed(
            check,
            "EOS ends a response, inside its mask",
            problems,
            f"{stopped} responses end with their EOS (kept, in the mask), {full} run to max_new_tokens",
        )
    )
    exercised = stopped > 0 and full > 0
    comparisons.append(
        Comparison(
            check,
            "both endings exercised",
            0,
            exercised or bool(problems),  # a response read wrongly is already reported above
            f"{stopped} of {batch} responses ended at an EOS and {full} ran to max_new_tokens={max_new_tokens}"
            + (
                ""
                if exercised
                else "; the kit expects both (with its 16 EOS ids holding ~1/8 of the probability, a correct "
                "rollout misses either with a chance below 1e-8): are eos_token_ids or max_new_tokens ignored?"
            ),
        )
    )
    return comparisons


def _layout_shapes(check: str, output: TensorDict, batch: int, max_new_tokens: int) -> Comparison:
    problems = []
    if output.batch_size[:1] != torch.Size([batch]):
        problems.append(f"batch size {list(output.batch_size)} for {batch} prompts")
    width = output[RESPONSES].shape[-1] if output[RESPONSES].dim() == 2 else -1
    sequence = output[INPUT_IDS].shape[-1] if output[INPUT_IDS].dim() == 2 else -1
    for key in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS):
        if list(output[key].shape) != [batch, sequence]:
            problems.append(
                f"{key} has shape {list(output[key].shape)}, input_ids {list(output[INPUT_IDS].shape)}"
            )
    for key in (RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS):
        if list(output[key].shape) != [batch, width]:
            problems.append(
                f"{key} has shape {list(output[key].shape)}, responses {list(output[RESPONSES].shape)}"
            )
    if width > max_new_tokens:
        problems.append(f"{width} response columns for max_new_tokens={max_new_tokens}")
    for key in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, RESPONSES, RESPONSE_MASK):
        if output[key].dtype != torch.int64:
            problems.append(f"{key} is {output[key].dtype}, not torch.int64")
    if not output[ROLLOUT_LOG_PROBS].is_floating_point():
        problems.append(f"{ROLLOUT_LOG_PROBS} is {output[ROLLOUT_LOG_PROBS].dtype}, not floating point")
    return passed(
        check,
        "keys, shapes, dtypes",
        problems,
        f"[{batch}, P + R] sequences and [{batch}, R] responses, int64 ids and masks",
    )
