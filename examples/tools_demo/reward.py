"""The tools demo's reward: 1 when the model's last line (its final answer) is the key's value.

The response is the whole conversation (docs/agents.md); its last line is the model's: a
conversation never ends on the environment's message."""


def score(prompt: str, response: str, extra: dict) -> float:
    return float(response.strip().rsplit("\n", 1)[-1].strip() == extra["ground_truth"])
