"""Peak memory of the log-prob step with the logits whole against chunks of
``micro_batch.logits_chunk_size`` tokens, side by side, and the time each takes.

A tiny Qwen2 with a 32k vocabulary (hidden 256, 2 layers, built here from a config: nothing is
downloaded) and 16 sequences of a 32-token prompt and a 512-token response, random token ids, one
padding-free micro-batch (the engine's default layout), temperature 0.7, entropy on. Two steps:
``infer`` (forward only, under ``no_grad``: the old- and reference-log-prob passes) and ``train``
(forward and backward of a loss on the log-probs and entropy: the actor update). The peak counts
every tensor the step allocates, parameters excluded: on the CPU a ``TorchDispatchMode`` adds up
the live storages (one run, apart from the timed ones), on CUDA ``torch.cuda.max_memory_allocated``.
Time: best of ``--rounds`` after a warm-up. Run: ``python benchmarks/logprob_memory.py [--threads 2]
[--chunk-size 2048] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import weakref

import _common as common
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveTensorBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among the storages allocated under it."""

    def __init__(self):
        super().__init__()
        self.live: set[tuple[int, int]] = set()
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._track(tensor.untyped_storage())
        return output

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = (storage.data_ptr(), storage.nbytes())
        if key in self.live or not key[1]:
            return  # a view, or an op writing in place
        self.live.add(key)
        self.current += key[1]
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)  # storages keep their Python object while alive

    def _release(self, key: tuple[int, int]) -> None:
        self.live.discard(key)
        self.current -= key[1]


def make_batch(sequences: int, prompt_length: int, response_length: int, vocab: int):
    """The batch contract: every sequence full length (no padding), random ids, entropy on."""
    from tensordict import TensorDict

    from verl_core.data import COMPUTE_ENTROPY, TEMPERATURE

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, vocab, (sequences, prompt_length + response_length), generator=generator)
    mask = torch.ones_like(input_ids)
    batch = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1),
            "responses": input_ids[:, prompt_length:],
        },
        batch_size=[sequences],
    )
    batch.set_non_tensor(TEMPERATURE, 0.7)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=None, help="default: micro_batch's default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from verl_core.config.engine import MicroBatchConfig, ModelConfig
    from verl_core.toolkit import forward_micro_batch, load_hf_model

    chunk_size = args.chunk_size or MicroBatchConfig().logits_chunk_size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = make_batch(args.sequences, args.prompt_length, args.response_length, args.vocab).to(device)
    predicted = batch["responses"].numel()
    results: dict = {"predicted_tokens": predicted, "vocab": args.vocab, "chunk_size": chunk_size}
    with tempfile.TemporaryDirectory() as scratch:
        path, _ = common.save_qwen2(
            scratch,
            vocab_size=args.vocab,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.prompt_length + args.response_length,
        )
        model = load_hf_model(ModelConfig(path=path), "lm", packing=True).to(device)

        def step(train: bool, chunks: int | None) -> None:
            model.zero_grad(set_to_none=True)
            with contextlib.nullcontext() if train else torch.no_grad():
                outputs = forward_micro_batch(model, batch, "lm", packing=True, logits_chunk_size=chunks)
                if train:
                    (outputs["log_probs"].sum() - 0.01 * outputs["entropy"].sum()).backward()
            model.zero_grad(set_to_none=True)

        for name, train in (("infer", False), ("train", True)):
            for mode, chunks in (("whole", None), ("chunked", chunk_size)):
                step(train, chunks)  # warm-up
                best = float("inf")
                for _ in range(args.rounds):
                    started = time.perf_counter()
                    step(train, chunks)
                    best = min(best, time.perf_counter() - started)
                results[f"{name}_{mode}"] = {
                    "seconds": best,
                    "peak_mib": peak_mib(step, train, chunks, device),
                }
            whole, chunked = results[f"{name}_whole"], results[f"{name}_chunked"]
            results[f"{name}_memory_ratio"] = whole["peak_mib"] / chunked["peak_mib"]
            results[f"{name}_time_ratio"] = chunked["seconds"] / whole["seconds"]
    print(
        f"{args.sequences} x ({args.prompt_length} + {args.response_length}) tokens, {predicted} predicted, "
        f"vocab {args.vocab}, chunks of {chunk_size}, {device.type}, {args.threads} thread(s)"
    )
    print(
        f"{'step':<6} {'whole MiB':>10} {'chunked MiB':>12} {'memory ratio':>13} {'whole s':>8} {'chunked s':>10} {'time ratio':>11}"
    )
    for name in ("infer", "train"):
        whole, chunked = results[f"{name}_whole"], results[f"{name}_chunked"]
        print(
            f"{name:<6} {whole['peak_mib']:>10.0f} {chunked['peak_mib']:>12.0f} "
            f"{results[f'{name}_memory_ratio']:>12.2f}x {whole['seconds']:>8.3f} {chunked['seconds']:>10.3f} "
            f"{results[f'{name}_time_ratio']:>10.2f}x"
        )
    if args.json:
        print(json.dumps(results))


def peak_mib(step, train: bool, chunks: int | None, device: torch.device) -> float:
    """The step's peak tensor memory above what was allocated before it, in MiB."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(train, chunks)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    with LiveTensorBytes() as spy:
        step(train, chunks)
    return spy.peak / 2**20


if __name__ == "__main__":
    main()
