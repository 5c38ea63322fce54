"""The tools demo's scripted traces are what the agent loop builds: an SFT row's prompt for the answer
turn is, token for token, the conversation the loop grows after the model's call and the tool's
result (so SFT teaches exactly the sequences GRPO samples), and the written tool answers the call."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from fixtures.chat import scripted_generate

from verl_core.agents import AgentLoop, ToolEnvironment, TurnTemplate
from verl_core.config.run import AgentConfig
from verl_core.rollout.base import SamplingParams

ROOT = Path(__file__).parents[1]
MAKE = ROOT / "examples" / "tools_demo" / "make_tools_demo.py"
REWARD = ROOT / "examples" / "tools_demo" / "reward.py"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tools_demo", MAKE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_tools_demo"] = module
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("tools_demo")
    module.build(out, sft_keys=4, train_keys=4, val_keys=4)
    return module, out


def test_the_traces_are_the_loops_conversations(assets) -> None:
    make, out = assets
    tokenizer = make.build_tokenizer()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rows = [json.loads(line) for line in (out / "data" / "sft.jsonl").read_text().splitlines()]
    call_row, answer_row = rows[0], rows[1]
    eos = tokenizer.eos_token_id
    config = AgentConfig(environment="tools", tools=str(out / "tools.py"), max_turns=2)
    loop = AgentLoop(TurnTemplate(tokenizer, [eos]), ToolEnvironment.from_config, config, 200)
    key = call_row["prompt"].split("value of ")[1][:2]
    question = [{"role": "user", "content": f"value of {key}?"}]
    replies = [[encode(call_row["response"]) + [eos], encode(answer_row["response"]) + [eos]]]
    sampling = SamplingParams(max_new_tokens=64, eos_token_ids=(eos,), pad_token_id=0)
    batch, (conversation,) = loop.run(
        scripted_generate(replies), [encode(call_row["prompt"])], [None], [question], sampling, 0
    )
    # The whole conversation is the SFT answer row, token for token: its prompt (call, tool turn and the
    # generation prompt, rendered by the template) and its response with the EOS the trainer appends.
    whole = encode(call_row["prompt"]) + conversation.response_ids
    assert whole == encode(answer_row["prompt"]) + encode(answer_row["response"]) + [eos]
    assert conversation.messages[2] == {
        "role": "tool",
        "content": answer_row["response"],
    }  # the table's value

    reward = importlib.util.spec_from_file_location("tools_demo_reward", REWARD)
    score_module = importlib.util.module_from_spec(reward)
    reward.loader.exec_module(score_module)
    text = tokenizer.decode(
        batch["responses"][0][batch["attention_mask"][0, -batch["responses"].shape[1] :].bool()],
        skip_special_tokens=True,
    )
    assert score_module.score("", text, {"ground_truth": answer_row["response"]}) == 1.0
    assert score_module.score("", text, {"ground_truth": "000"}) == 0.0


def test_the_documented_scores_are_of_the_warm_up_and_grpo_the_demo_runs() -> None:
    """docs/agents.md's table names the steps of the warm-up's two SFT calls (examples/tools_demo/sft.yaml,
    then noxfile.py's second call) and of GRPO (grpo.yaml) that its scores were measured with: change
    one of them, and the scores are to be measured again."""
    steps = {
        name: yaml.safe_load((ROOT / "examples" / "tools_demo" / f"{name}.yaml").read_text())["trainer"][
            "total_training_steps"
        ]
        for name in ("sft", "grpo")
    }
    more = int(re.search(r"^TOOLS_DEMO_MORE_SFT_STEPS = (\d+)$", (ROOT / "noxfile.py").read_text(), re.M)[1])
    docs = (ROOT / "docs" / "agents.md").read_text()
    assert f"| SFT warm-up, {steps['sft']} + {more} steps (GRPO's start) |" in docs
    assert f"| after GRPO, {steps['grpo']} steps" in docs
