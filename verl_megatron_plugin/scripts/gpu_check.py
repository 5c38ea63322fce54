"""Prove the Megatron engine on a CUDA machine and measure it: ``python verl_megatron_plugin/scripts/gpu_check.py``.

1. Runs ``tests/test_megatron_gpu.py`` (marked ``gpu``): the conformance kit on CUDA with NCCL,
   megatron-core unpatched (no CPU bridge), transformer-engine's layers if it is installed, offload
   included.
2. Reports training and log-prob throughput (tokens/s) of a Qwen2-0.5B-shaped model built from a
   config (random weights; nothing is downloaded), bf16, on one GPU at TP=1, through the engine API,
   with the ``fsdp`` backend beside it on the same model and batch.

Exits non-zero when CUDA is missing or a check fails. Needs ``pip install -e .[test] -e verl_fsdp_plugin
-e verl_megatron_plugin``. ``--skip-tests`` measures only; ``--json`` prints the figures as JSON;
``--smoke`` runs the measurement on the CPU with a tiny shape (through the CPU bridge), to check the
script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_megatron_gpu.py"
#: Qwen2-0.5B's shape (494M parameters with its 151936-token vocabulary).
QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
BATCH, PROMPT, RESPONSE = 16, 256, 256
#: ``--smoke``: a shape that trains in seconds on a CPU.
SMOKE = {
    **QWEN2_05B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 512,
}


def save_model(directory: Path, shape: dict) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape, dtype="bfloat16")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    return str(directory)


def batch(vocab: int):
    """``BATCH`` full-length sequences of random tokens in the batch contract."""
    from tensordict import TensorDict

    from verl_core.data import COMPUTE_ENTROPY, TEMPERATURE
    from verl_core.data import batch as keys

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, vocab, (BATCH, PROMPT + RESPONSE), generator=generator)
    data = TensorDict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: torch.ones_like(input_ids),
            keys.POSITION_IDS: torch.arange(PROMPT + RESPONSE).expand(BATCH, -1).clone(),
            keys.RESPONSES: input_ids[:, PROMPT:].clone(),
            keys.RESPONSE_MASK: torch.ones(BATCH, RESPONSE, dtype=torch.long),
            keys.ADVANTAGES: torch.randn(BATCH, RESPONSE, generator=generator),
        },
        batch_size=[BATCH],
    )
    data.set_non_tensor(TEMPERATURE, 1.0)
    data.set_non_tensor(COMPUTE_ENTROPY, True)
    return data


def throughput(backend: str, model: str, vocab: int, device: str, steps: int = 3) -> dict[str, float]:
    from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
    from verl_core.engine import build_engine
    from verl_core.plugins import get_registry
    from verl_core.testing.losses import policy_loss_fn

    options_class = get_registry().get("engine_backends", backend).load_config()
    bridged = backend == "megatron" and device == "cpu"
    config = EngineConfig(
        backend=backend,
        model=ModelConfig(path=model, dtype="bfloat16"),
        options=options_class(cpu_bridge=True) if bridged else None,
        optim=OptimConfig(lr=1e-6, clip_grad=1.0),
        micro_batch=MicroBatchConfig(micro_batch_size=4, packing=False),
        device=device,
    )
    engine = build_engine(config, "lm")
    engine.initialize()
    tokens = BATCH * (PROMPT + RESPONSE)
    timings = {"train_batch": [], "infer_batch": []}
    cuda = device == "cuda"
    for _ in range(steps + 1):  # the first round warms up
        with engine.train_mode():
            start = _now(cuda)
            engine.train_batch(batch(vocab), policy_loss_fn)
            timings["train_batch"].append(_now(cuda) - start)
        with engine.eval_mode():
            start = _now(cuda)
            engine.infer_batch(batch(vocab))
            timings["infer_batch"].append(_now(cuda) - start)
    result = {f"{name} tokens/s": tokens / (sum(t[1:]) / steps) for name, t in timings.items()}
    if cuda:
        result["peak GiB"] = torch.cuda.max_memory_allocated() / 2**30
        del engine
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def _now(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        return measure("cpu", SMOKE, args.json)
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run this on a GPU machine", file=sys.stderr)
        return 2
    print(
        f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {torch.cuda.get_device_name()}"
    )
    if not args.skip_tests:
        status = int(pytest.main([str(TESTS), "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider"]))
        if status:
            return status
    return measure("cuda", QWEN2_05B, args.json)


def measure(device: str, shape: dict, as_json: bool) -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as directory:
        model = save_model(Path(directory) / "qwen2-shaped", shape)
        figures = {
            backend: throughput(backend, model, shape["vocab_size"], device)
            for backend in ("megatron", "fsdp")
        }
    dist.destroy_process_group()
    if as_json:
        print(json.dumps(figures, indent=2))
    else:
        for name in figures["megatron"]:
            ratio = figures["megatron"][name] / figures["fsdp"][name]
            print(
                f"{name:22s} megatron {figures['megatron'][name]:10.1f}  fsdp {figures['fsdp'][name]:10.1f}  ratio {ratio:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
