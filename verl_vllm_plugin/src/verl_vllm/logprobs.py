"""The contract's log-probs from vLLM's sampler: ``log_softmax(logits / T)`` at the sampled token,
before top-k / top-p (``verl_core.rollout.base``).

None of vLLM's ``logprobs_mode`` s is that distribution: ``raw_logprobs`` ignores the temperature,
``processed_logprobs`` is taken after top-k / top-p (renormalised over the tokens they keep). So the
engine runs with ``processed_logprobs`` and the step of its sampler that filters the tempered logits is
wrapped: the wrapper takes the log-softmax of the logits it is given (tempered, not yet filtered) and
reports those as the processed log-probs, sampling unchanged. Greedy requests keep vLLM's own
(untempered) log-probs, which are the contract's for greedy decoding.

This reaches into vLLM's sampler, which moves between releases: ``install_tempered_log_probs`` checks
the structure it relies on and raises ``RolloutError`` naming the vLLM version when it is not there;
``TemperedLogProbs.calls`` lets the rollout verify after a generation that the wrapper ran, so that a
sampler path it does not cover is an error, never log-probs of another distribution.

Two samplers are covered: the V1 model runner's (``vllm.v1.sample.sampler.Sampler``, vLLM's CPU
backend and ``VLLM_USE_V2_MODEL_RUNNER=0``), whose ``topk_topp_sampler`` module is replaced by a
wrapper; and the V2 model runner's (``vllm.v1.worker.gpu.sample.sampler.Sampler``, the GPU default),
whose ``_sample_random`` is wrapped on the instance.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from verl_core.errors import RolloutError

#: The ``logprobs_mode`` the engine runs with: the sampler reports the log-probs the wrapper returns.
LOGPROBS_MODE = "processed_logprobs"
#: ``_sample_random``'s parameters in the V2 sampler this wrapper was written against.
V2_SAMPLE_RANDOM_PARAMETERS = (
    "processed_logits",
    "expanded_idx_mapping",
    "idx_mapping_np",
    "pos",
    "top_k",
    "top_p",
    "use_fused_sampler",
)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def moved(what: str) -> RolloutError:
    """The error for a vLLM whose sampler is not the one this plugin was written against."""
    return RolloutError(
        f"the vllm rollout cannot report the contract's log-probs with vLLM {vllm_version()}: {what}. "
        "verl-vllm-plugin was written against vLLM 0.32 (its extras pin it): install that release "
        '(pip install "verl-core[vllm]"; on a CPU: pip install "verl-vllm-plugin[cpu]"), or upgrade '
        "verl-vllm-plugin to a release that supports yours"
    )


class TemperedTopKTopP(torch.nn.Module):
    """V1: stands in for the sampler's ``TopKTopPSampler``, which gets the tempered logits and filters
    them in place: returns ``log_softmax`` of the logits before it runs, and what it samples."""

    def __init__(self, inner: torch.nn.Module, counter: TemperedLogProbs):
        super().__init__()
        self.inner = inner
        self.counter = counter

    def forward(
        self, logits: torch.Tensor, generators: dict[int, torch.Generator], k: Any, p: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tempered = logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = self.inner(logits, generators, k, p)
        self.counter.calls += 1
        return sampled, tempered


class TemperedLogProbs:
    """The installed wrapper of one engine's sampler; ``calls`` counts the sampling steps it saw."""

    def __init__(self) -> None:
        self.calls = 0

    def install(self, sampler: Any) -> str:
        """Wrap ``sampler`` (a model runner's); returns which sampler it was. Raises ``RolloutError``
        when the sampler is not one this plugin knows."""
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
        from vllm.v1.sample.sampler import Sampler as V1Sampler

        try:
            from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
        except ImportError:  # a build without the V2 model runner
            V2Sampler = None  # noqa: N806

        if isinstance(sampler, V1Sampler):
            if sampler.logprobs_mode != LOGPROBS_MODE:
                raise moved(f"the sampler runs with logprobs_mode={sampler.logprobs_mode!r}")
            inner = getattr(sampler, "topk_topp_sampler", None)
            if not isinstance(inner, TopKTopPSampler) or "topk_topp_sampler" not in inspect.getsource(
                type(sampler).sample
            ):
                raise moved("its V1 Sampler no longer samples through a TopKTopPSampler")
            # Its own processed log-probs would be the filtered ones, computed for nothing.
            inner.logprobs_mode = "raw_logprobs"
            sampler.topk_topp_sampler = TemperedTopKTopP(inner, self)
            return "V1 Sampler.topk_topp_sampler"
        if V2Sampler is not None and isinstance(sampler, V2Sampler):
            original = getattr(sampler, "_sample_random", None)
            if (
                original is None
                or tuple(inspect.signature(original).parameters) != V2_SAMPLE_RANDOM_PARAMETERS
            ):
                raise moved("its V2 Sampler._sample_random is not the one it wraps")
            if sampler.logprobs_mode != LOGPROBS_MODE:
                raise moved(f"the sampler runs with logprobs_mode={sampler.logprobs_mode!r}")

            def sample_random(
                processed_logits: torch.Tensor, *args: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
                # Tempered and not yet filtered; the sampler takes the log-softmax of what is returned.
                tempered = processed_logits.clone()
                sampled, _ = original(processed_logits, *args)
                self.calls += 1
                return sampled, tempered

            sampler._sample_random = sample_random
            return "V2 Sampler._sample_random"
        raise moved(
            f"the model runner's sampler is a {type(sampler).__module__}.{type(sampler).__qualname__}"
        )


def install_tempered_log_probs(engine: Any) -> TemperedLogProbs:
    """Wrap the sampler of every worker of ``engine`` (an in-process ``LLMEngine``)."""
    hook = TemperedLogProbs()

    def install(worker: Any) -> str:
        runner = getattr(worker, "model_runner", None)
        sampler = getattr(runner, "sampler", None)
        if sampler is None:
            raise moved(f"its worker {type(worker).__qualname__} has no model_runner.sampler")
        return hook.install(sampler)

    engine.collective_rpc(install)
    return hook
