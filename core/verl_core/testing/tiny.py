"""The tiny model and the batches every conformance check runs on.

The model is built from a config (nothing is downloaded), seeded, and written with
``save_pretrained`` so that every rank and the reference load identical weights. Two directories:
``lm`` (a causal LM) and ``value`` (the same backbone as a token-classification model with one
label, head included, so that a value engine loads its head instead of initialising one).

Batches follow ``verl_core.data.batch``: prompts left-padded, responses right-padded, lengths
varied, and two response tokens present in the sequence but masked out of the loss (tool output).
Samples are also kept unpadded (``Sample``) so the reference never sees padding at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from tensordict import TensorDict

from verl_core.data import batch as keys

PAD_TOKEN_ID = 0

#: Response lengths fall with the sample index, so contiguous DP shares of this batch carry unequal
#: token counts at every world size that divides ``BATCH_SIZE`` (40 vs 14 loss tokens at 2 ranks).
RESPONSE_LENGTHS = (8, 8, 7, 7, 6, 5, 4, 3, 3, 2, 2, 1)
PROMPT_LENGTHS = (3, 6, 1, 5, 2, 6, 4, 6, 2, 5, 3, 4)
BATCH_SIZE = len(RESPONSE_LENGTHS)
PROMPT_LENGTH = max(PROMPT_LENGTHS)
RESPONSE_LENGTH = max(RESPONSE_LENGTHS)
#: (sample, response position) pairs kept in the sequence but left out of the loss.
LOSS_MASK_HOLES = ((1, 3), (7, 1))
VOCAB_SIZE = 128


@attrs.frozen
class TinyModelSpec:
    """A tiny decoder-only transformer; ``arch`` is ``qwen2`` (attention biases) or ``llama``."""

    arch: str = "qwen2"
    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seed: int = 0

    def hf_config(self, num_labels: int | None = None):
        """The ``transformers`` config; ``num_labels`` makes it a token-classification config."""
        from transformers import LlamaConfig, Qwen2Config

        config_classes = {"qwen2": Qwen2Config, "llama": LlamaConfig}
        if self.arch not in config_classes:
            raise ValueError(f"TinyModelSpec.arch={self.arch!r}: expected one of {sorted(config_classes)}")
        extra = {} if num_labels is None else {"num_labels": num_labels, "classifier_dropout": 0.0}
        return config_classes[self.arch](
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=4 * (PROMPT_LENGTH + RESPONSE_LENGTH),
            tie_word_embeddings=False,
            pad_token_id=PAD_TOKEN_ID,
            dtype="float32",
            **extra,
        )


@attrs.frozen
class ModelDirs:
    """Where the tiny model was saved, per role."""

    lm: str
    value: str

    @classmethod
    def under(cls, directory: str | Path) -> ModelDirs:
        return cls(lm=str(Path(directory) / "lm"), value=str(Path(directory) / "value"))

    def for_role(self, role: str) -> str:
        return self.value if role == "value" else self.lm


def save_tiny_models(directory: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> ModelDirs:
    """Build the tiny model from ``spec`` (seeded) and save it as ``lm`` and ``value`` directories."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    dirs = ModelDirs.under(directory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        lm = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
        value = AutoModelForTokenClassification.from_config(spec.hf_config(num_labels=1), dtype=torch.float32)
    # The critic starts from the policy's backbone, as in verl; only the head is new.
    value.model.load_state_dict(lm.model.state_dict())
    lm.save_pretrained(dirs.lm)
    value.save_pretrained(dirs.value)
    return dirs


@attrs.frozen
class Sample:
    """One unpadded sequence: prompt and response tokens and per-response-token training inputs."""

    prompt: torch.Tensor  # [p] int64
    response: torch.Tensor  # [r] int64
    loss_mask: torch.Tensor  # [r] 1 where the token counts in the loss
    advantages: torch.Tensor  # [r] float32
    returns: torch.Tensor  # [r] float32

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt, self.response])


def make_samples(seed: int, vocab_size: int = VOCAB_SIZE, share_prompts: bool = False) -> list[Sample]:
    """``BATCH_SIZE`` samples with the fixed lengths above and random tokens (never the pad id).

    With ``share_prompts`` the samples whose prompts have the same length have the same prompt, as
    the ``n`` samples of a GRPO group do (five groups of two or three; responses still differ).
    """
    generator = torch.Generator().manual_seed(seed)
    holes = set(LOSS_MASK_HOLES)
    prompts: dict[int, torch.Tensor] = {}
    samples = []
    for index, (prompt_length, response_length) in enumerate(
        zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)
    ):
        tokens = torch.randint(1, vocab_size, (prompt_length + response_length,), generator=generator)
        loss_mask = torch.tensor([0 if (index, t) in holes else 1 for t in range(response_length)])
        samples.append(
            Sample(
                prompt=prompts.setdefault(prompt_length, tokens[:prompt_length])
                if share_prompts
                else tokens[:prompt_length],
                response=tokens[prompt_length:],
                loss_mask=loss_mask,
                advantages=torch.randn(response_length, generator=generator),
                returns=torch.randn(response_length, generator=generator),
            )
        )
    return samples


def teacher_top_k(
    samples: Sequence[Sample], k: int, seed: int = 0, vocab_size: int = VOCAB_SIZE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A made-up teacher's top-k at each response token of ``samples``: per sample, ``k`` distinct
    token ids per position ``[r, k]`` int64 and their log-probs ``[r, k]``, descending (the ``k``
    likeliest of ``k + 1`` tokens), as a GKD teacher's ``top_k_ids`` and ``top_k_log_probs``."""
    generator = torch.Generator().manual_seed(seed)
    top_k = []
    for sample in samples:
        length = len(sample.response)
        ids = torch.rand(length, vocab_size, generator=generator).argsort(dim=-1)[:, :k]
        log_probs = torch.log_softmax(torch.randn(length, k + 1, generator=generator), dim=-1)
        top_k.append((ids, log_probs.sort(dim=-1, descending=True).values[:, :k]))
    return top_k


def collate(samples: Sequence[Sample]) -> TensorDict:
    """Pad ``samples`` into the batch contract: prompts left-padded to ``PROMPT_LENGTH``, responses
    right-padded to ``RESPONSE_LENGTH``; ``position_ids`` count real tokens only."""
    count = len(samples)
    length = PROMPT_LENGTH + RESPONSE_LENGTH
    input_ids = torch.full((count, length), PAD_TOKEN_ID, dtype=torch.int64)
    attention_mask = torch.zeros(count, length, dtype=torch.int64)
    response_mask = torch.zeros(count, RESPONSE_LENGTH, dtype=torch.int64)
    advantages = torch.zeros(count, RESPONSE_LENGTH)
    returns = torch.zeros(count, RESPONSE_LENGTH)
    for row, sample in enumerate(samples):
        prompt_start = PROMPT_LENGTH - len(sample.prompt)
        response_end = PROMPT_LENGTH + len(sample.response)
        input_ids[row, prompt_start:PROMPT_LENGTH] = sample.prompt
        input_ids[row, PROMPT_LENGTH:response_end] = sample.response
        attention_mask[row, prompt_start:response_end] = 1
        response_mask[row, : len(sample.response)] = sample.loss_mask
        advantages[row, : len(sample.response)] = sample.advantages
        returns[row, : len(sample.response)] = sample.returns
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    return TensorDict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: position_ids,
            keys.RESPONSES: input_ids[:, PROMPT_LENGTH:].clone(),
            keys.RESPONSE_MASK: response_mask,
            keys.ADVANTAGES: advantages,
            keys.RETURNS: returns,
        },
        batch_size=[count],
    )


def response_token_mask(batch: TensorDict) -> torch.Tensor:
    """[B, R] bool: where a response token exists (the attention mask's response columns).

    Wider than ``response_mask``, which also drops tokens left out of the loss: model outputs are
    defined, and compared, on every real token.
    """
    return batch[keys.ATTENTION_MASK][:, -batch[keys.RESPONSES].shape[-1] :].bool()


def shard(items: Sequence, rank: int, world_size: int) -> slice:
    """The contiguous share of ``items`` (samples or batch rows) that DP rank ``rank`` trains on."""
    if len(items) % world_size:
        raise ValueError(
            f"world_size={world_size} does not divide the conformance batch of {len(items)} sequences; "
            f"use a world size that divides {len(items)}"
        )
    size = len(items) // world_size
    return slice(rank * size, (rank + 1) * size)
