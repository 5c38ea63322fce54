"""The matrix products a GRPO step of this trainer must run, timed alone on this machine: a floor
under the step's time that no work outside the products can lower.

Whatever else a step does (attention, norms, the log-softmax, sampling, the optimiser), it runs at least
these, each on the kernels this trainer runs it on:

- the update, through torch's product (what ``F.linear`` and its backward call): the forward, input
  gradient and weight gradient of every layer's weights at the positions it computes (each group's
  prompt once, every response token: ``micro_batch.share_prompts``), and of the head at the response
  tokens;
- the rollout's prefill of each distinct prompt and its decoding steps at the batch's rows, through the
  decoder's own projections (the packing and fusion ``auto`` picks on this CPU), the head at each row's
  last token. Rows that finish early decode fewer steps; a product of fewer rows costs no less per row,
  so ``(response tokens - rows) / rows`` steps of all rows bound them from below.

Each set runs back to back, the fastest of a few rounds, so the floor is what the kernels reach at
their best: a step cannot be faster, and a ratio against another trainer cannot exceed its step time
over this floor (``docs/benchmarks.md``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from _common import best_seconds

if TYPE_CHECKING:
    from verl_core.rollout.decoder import LeanDecoder

#: Rounds of each set of products (after a warm-up): the fastest counts.
ROUNDS = 3


def products_floor(
    model_dir: Path, prompts: int, group: int, prompt_tokens: float, response_tokens: float
) -> dict[str, float]:
    """Seconds of the products of one step: ``prompts`` x ``group`` rows of ``prompt_tokens`` prompt
    tokens (the mean) and ``response_tokens`` response tokens in all; keys ``update_s``,
    ``prefill_s``, ``decoding_s`` and their sum ``total_s``."""
    from transformers import AutoModelForCausalLM

    from verl_core.rollout.decoder import LeanDecoder

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    layer_weights = [
        module.weight
        for layer in model.model.layers
        for module in layer.modules()
        if isinstance(module, torch.nn.Linear)
    ]
    head = model.lm_head.weight
    rows = prompts * group
    trained_positions = round(prompts * prompt_tokens + response_tokens)
    with torch.inference_mode():
        update = _training_products(layer_weights, trained_positions) + _training_products(
            [head], round(response_tokens)
        )
        decoder = LeanDecoder(model)  # the rollout's own path on this CPU
        prefill = _decoder_products(decoder, prompts, round(prompt_tokens))
        step = _decoder_products(decoder, rows, 1)
        decoder.release()
    decoding = step * max(response_tokens - rows, 0) / rows
    return {
        "update_s": update,
        "prefill_s": prefill,
        "decoding_s": decoding,
        "decoding_step_ms": 1e3 * step,
        "decoder_path": str(decoder.path),
        "total_s": update + prefill + decoding,
    }


def _training_products(weights: list[torch.Tensor], positions: int) -> float:
    """Forward, input gradient and weight gradient of each weight at ``positions`` positions."""
    shapes = [tuple(weight.shape) for weight in weights]
    return sum(shapes.count(shape) * _training_seconds(*shape, positions) for shape in set(shapes))


def _training_seconds(out_features: int, in_features: int, positions: int) -> float:
    weight = torch.randn(out_features, in_features)
    inputs, grads = torch.randn(positions, in_features), torch.randn(positions, out_features)
    forward = best_seconds(lambda: inputs @ weight.t(), ROUNDS)
    input_grad = best_seconds(lambda: grads @ weight, ROUNDS)
    weight_grad = best_seconds(lambda: grads.t() @ inputs, ROUNDS)
    return forward + input_grad + weight_grad


def _decoder_products(decoder: LeanDecoder, rows: int, tokens: int) -> float:
    """One forward of ``tokens`` new tokens on each of ``rows`` rows through the decoder's own
    projections, the head at each row's last token only (a prefill, or a decoding step: one token)."""
    layers = decoder.projections
    hidden = decoder.model.config.hidden_size
    inputs = {
        size: torch.randn(rows, tokens, size)
        for size in {p.linears[0].weight.shape[1] for layer in layers for p in layer}
    }
    last = torch.randn(rows, 1, hidden)

    def forward() -> None:
        for projections in layers:
            for projection in projections:
                projection(inputs[projection.linears[0].weight.shape[1]])
        decoder.head(last)

    return best_seconds(forward, ROUNDS)
