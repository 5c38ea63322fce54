"""What the rollout kit does not cover: the engine colocated with a trainer (its process group, RNG,
environment and thread settings left as they were), weights synced into a model with a tied LM head,
prefix sharing, sleep on vLLM's CPU build (which declares no sleep, so the kit skips it), requests cut
short by sleep and weight updates, steps from a thread with another thread count, the refusals of the
tempered log-prob hook, and an engine that dies mid-run.

One engine for the module, built beside a one-rank gloo process group as the trainer's ranks have one,
on the kit's model with its LM head tied to the embedding (as SmolLM2's and Qwen2-0.5B's are); the last
tests kill it and shut it down.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import itertools
import os
import random
import sys
import threading
from datetime import timedelta

import attrs
import pytest
import torch

from verl_core.config.engine import ModelConfig
from verl_core.errors import RolloutError
from verl_core.rollout import RolloutRequest, SamplingParams
from verl_core.rollout.requests import FinishReason
from verl_core.testing import ROLLOUT_CHECKS, TinyModelSpec, save_rollout_model
from verl_core.testing.rollout_checks import RolloutContext
from verl_vllm.plugin import INSTALL

if importlib.util.find_spec("vllm") is None:  # found without importing it: vLLM's import changes torch
    pytest.skip(f"vLLM is not installed: {INSTALL}", allow_module_level=True)

#: Llama's architecture (the kit runs Qwen2's): vLLM ties a Llama's head to the embedding as a module of
#: its own that shares the weight, which it packs separately on a CPU (a tied Qwen2's head is the
#: embedding module itself).
WIDE = TinyModelSpec(
    arch="llama", hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1
)
#: The kit's model has 56 positions: prompts of 6 tokens and responses of up to 40.
PROMPT = [5, 17, 33, 2, 90, 41]
LONG = SamplingParams(max_new_tokens=40, eos_token_ids=(), pad_token_id=0)


def caller_state() -> dict:
    numpy = sys.modules.get("numpy")
    return {
        "torch_rng": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": numpy.random.get_state()[1].copy() if numpy is not None else None,
        "environ": dict(os.environ),
        "set_num_threads": torch.set_num_threads,
        "threads": torch.get_num_threads(),
        "frozen": gc.get_freeze_count(),
    }


@attrs.define
class Colocated:
    rollout: object
    model_dir: str
    group: object
    before: dict
    after: dict


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    import torch.distributed as dist

    from verl_vllm.config import VLLMRolloutConfig
    from verl_vllm.rollout import VLLMRollout

    assert not dist.is_initialized(), "a test before this module left a default process group"
    tmp = tmp_path_factory.mktemp("vllm-rollout")
    model_dir = save_tied_model(tmp)
    store = dist.FileStore(str(tmp / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    group = dist.group.WORLD
    import vllm.platforms  # noqa: F401 (its import sets variables of its own in os.environ, for good)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trainer's ranks run (verl_core.workers.ray_group)
    torch.manual_seed(1234)
    random.seed(1234)
    rollout = VLLMRollout(
        ModelConfig(path=model_dir, dtype="float32"), VLLMRolloutConfig(kv_cache_megabytes=64, block_size=32)
    )
    before = caller_state()
    rollout.initialize()
    after = caller_state()
    try:
        yield Colocated(rollout, model_dir, group, before, after)
    finally:
        rollout.close()
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()


def save_tied_model(tmp) -> str:
    """The kit's model with its LM head tied to the embedding, the embedding scaled as the kit scales its
    head (``ROLLOUT_LOGIT_SCALE``: logits spread enough that weight updates show in the log-probs)."""
    from transformers import AutoModelForCausalLM

    from verl_core.testing.rollout_context import ROLLOUT_LOGIT_SCALE

    model = AutoModelForCausalLM.from_pretrained(save_rollout_model(tmp / "untied", WIDE, logit_scale=1.0))
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(ROLLOUT_LOGIT_SCALE)
    model.save_pretrained(tmp / "model")
    return str(tmp / "model")


def requests(rollout, prompts, sampling, seed=0, resume=()):
    """``generate_request`` for each prompt (resuming ``resume``'s responses), all in flight together."""

    async def all_of():
        partials = list(resume) or [None] * len(prompts)
        return await asyncio.gather(
            *(
                rollout.generate_request(
                    RolloutRequest(p, sampling, seed=seed + i, request_id=f"t{i}", resume_from=r)
                )
                for i, (p, r) in enumerate(zip(prompts, partials, strict=True))
            )
        )

    return asyncio.run(all_of())


def test_building_the_engine_leaves_the_trainers_state_as_it_was(colocated) -> None:
    """vLLM seeds the global RNGs with its own seed, replaces torch.set_num_threads with a no-op,
    edits os.environ (LD_PRELOAD, thread settings) and gc.freeze()s the heap while it builds an engine
    in process; the rollout puts each back. It takes the trainer's process group as its world."""
    import torch.distributed as dist

    before, after = colocated.before, colocated.after
    assert torch.equal(after["torch_rng"], before["torch_rng"])
    assert after["random"] == before["random"]
    if before["numpy"] is not None:
        assert (after["numpy"] == before["numpy"]).all()
    assert after["environ"] == before["environ"]
    assert after["set_num_threads"] is before["set_num_threads"]
    assert after["threads"] == before["threads"] and after["frozen"] == before["frozen"] == 0
    assert dist.group.WORLD is colocated.group


def test_generating_leaves_the_trainers_rng_as_it_was(colocated) -> None:
    """vLLM's CPU sampler draws a number per sequence from torch's global generator at every step."""
    state = torch.get_rng_state()
    colocated.rollout.generate([PROMPT] * 3, LONG, seed=3)
    requests(colocated.rollout, [PROMPT] * 2, LONG)
    assert torch.equal(torch.get_rng_state(), state)


def test_weights_sync_into_a_model_with_a_tied_head(colocated) -> None:
    """The head receives no tensor of its own (the embedding's is its weight), and on a CPU vLLM keeps a
    packed copy of it, which every update must pack again (left stale, log-probs are ~0.3 off): the
    kit's probe weights (every tensor changed) one tensor at a time, then its bucket check."""
    from verl_core.testing.rollout_context import make_prompts
    from verl_core.testing.rollout_weights import probe_weights, samples_with, send_weights

    ctx = context(colocated)
    probe = probe_weights(ctx.reference())
    send_weights(ctx, probe)
    try:
        synced = samples_with(
            ctx, "tied", "after the probe weights", probe, make_prompts([6] * 8, 3), 7, "probe"
        )
    finally:
        send_weights(ctx, ctx.reference(), overwrite=False)
    assert synced.passed, synced.describe()
    comparisons = list(ROLLOUT_CHECKS["weight_buckets"].run(ctx))
    assert all(c.passed for c in comparisons), [c.describe() for c in comparisons]


def test_steps_from_a_thread_with_another_thread_count(colocated) -> None:
    """vLLM's CPU attention plans each step for the threads of the thread that steps it; a step from a
    thread with another count than the engine was built with failed its kernel's check (engine dead)."""
    if (os.cpu_count() or 1) == 1:
        pytest.skip("one core: vLLM plans a step for at most the cores, so no other thread count here")
    colocated.rollout.generate([PROMPT] * 2, LONG, seed=4)  # stepped in this thread first
    results = []

    def other_thread():
        torch.set_num_threads(2)  # the engine was built with 1 (the fixture), as a trainer's rank runs
        results.append(colocated.rollout.generate([PROMPT] * 2, LONG, seed=5))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert len(results) == 1 and results[0]["responses"].shape == (2, 40)


def test_the_n_samples_of_a_prompt_share_its_prefill(colocated) -> None:
    """Four rows of one 40-token prompt in one call: the first prefills its 32-token block, the other
    three find it in the prefix cache (vLLM's count of the prompt tokens it did not compute)."""
    rollout = colocated.rollout
    prompt = list(range(1, 41))
    sampling = SamplingParams(max_new_tokens=4, eos_token_ids=(), pad_token_id=0)
    rollout.update_weights(_weights(colocated))  # an empty cache: a load resets it
    flights = [rollout._driver.submit(f"prefix-{i}", prompt, rollout._params(sampling, i)) for i in range(4)]
    rollout._driver.run(flights)
    assert [flight.cached_tokens for flight in flights] == [0, 32, 32, 32]


def test_seeded_prompts_beyond_a_steps_token_budget_each_sample_as_alone(colocated) -> None:
    """50 prompts of 45 tokens, more than the 2048 a step prefills: vLLM's default split one prompt's
    prefill over two steps and its CPU engine died ('CPU Generator does not use offset'). The rollout
    prefills each prompt in one step (``CPU_ENGINE_DEFAULTS``): the rest wait, and sample what they
    sample alone."""
    prompts = [[(7 * i + j) % 90 + 1 for j in range(45)] for i in range(50)]
    sampling = SamplingParams(max_new_tokens=3, eos_token_ids=(), pad_token_id=0)
    together = requests(colocated.rollout, prompts, sampling, seed=100)
    assert all(len(response.token_ids) == 3 for response in together)
    for i in (0, 45, 49):
        alone = requests(colocated.rollout, prompts[i : i + 1], sampling, seed=100 + i)[0]
        assert alone.token_ids == together[i].token_ids
        assert alone.log_probs == pytest.approx(together[i].log_probs, abs=1e-5)  # other batch shapes


def test_asleep_it_refuses_and_awake_it_has_its_weights(colocated) -> None:
    """The kit's sleep check, which it skips for vLLM's CPU build (no sleep mode: declared sleep=False):
    the contract's refusals naming wake_up() and the weights kept hold there too."""
    comparisons = list(ROLLOUT_CHECKS["sleep"].run(context(colocated, sleep=True)))
    assert len(comparisons) == 5 and all(c.passed for c in comparisons), [c.describe() for c in comparisons]


@pytest.mark.parametrize("interruption", ["sleep", "a weight update"])
def test_requests_in_flight_end_when_it_sleeps_or_loads_weights_and_resume_after(
    colocated, interruption
) -> None:
    rollout = colocated.rollout
    driver = rollout._driver

    async def interrupted():
        prompts = [[p + i for p in PROMPT] for i in range(3)]
        tasks = [
            asyncio.ensure_future(
                rollout.generate_request(RolloutRequest(p, LONG, seed=i, request_id=f"cut{i}"))
            )
            for i, p in enumerate(prompts)
        ]
        # Interrupted mid-response: once each has 2 tokens (they step together: none ends before).
        while not all(f"cut{i}" in driver.flights for i in range(3)) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.001)
        flights = [driver.flights[f"cut{i}"] for i in range(3) if f"cut{i}" in driver.flights]
        while not all(len(flight.tokens) >= 2 or flight.done for flight in flights):
            await asyncio.sleep(0.001)
        if interruption == "sleep":
            rollout.sleep()
        else:
            rollout.update_weights(_weights(colocated))
        return prompts, await asyncio.gather(*tasks)

    prompts, partials = asyncio.run(interrupted())
    assert all(r.finish_reason is FinishReason.ABORTED and 2 <= len(r.token_ids) < 40 for r in partials), (
        partials
    )
    if interruption == "sleep":
        with pytest.raises(RolloutError, match=r"wake_up\(\)"):
            requests(rollout, prompts, LONG)
        rollout.wake_up()
    resumed = requests(rollout, prompts, LONG, seed=10, resume=partials)
    for partial, response in zip(partials, resumed, strict=True):
        assert response.token_ids[: len(partial.token_ids)] == partial.token_ids
        assert len(response.token_ids) == 40 and response.finish_reason is FinishReason.LENGTH


def test_a_prompt_and_response_longer_than_max_model_len_is_refused(colocated) -> None:
    """vLLM would cut the response at max_model_len (56, the model's positions) without a word."""
    sampling = SamplingParams(max_new_tokens=16, eos_token_ids=(), pad_token_id=0)
    with pytest.raises(RolloutError, match=r"need 61 positions, more than the engine's max_model_len=56"):
        colocated.rollout.generate([list(range(1, 46))], sampling, seed=0)


def test_the_tempered_log_prob_hook_refuses_a_sampler_it_does_not_know(colocated) -> None:
    """A vLLM whose sampler moved: refused at start-up naming the version, and a sampling step the
    wrapper does not see is refused after the call, never reported as the contract's log-probs."""
    import vllm
    from vllm.v1.sample.sampler import Sampler

    from verl_vllm.logprobs import TemperedLogProbs, TemperedTopKTopP

    with pytest.raises(
        RolloutError, match=rf"vLLM {vllm.__version__}: the model runner's sampler is a builtins.object"
    ):
        TemperedLogProbs().install(object())
    with pytest.raises(RolloutError, match="the sampler runs with logprobs_mode='raw_logprobs'"):
        TemperedLogProbs().install(Sampler(logprobs_mode="raw_logprobs"))

    rollout = colocated.rollout

    def unwrap(worker, wrapped: bool):
        # Unwrapped, vLLM's own sampler step reports its processed log-probs: the filtered ones.
        sampler = worker.model_runner.sampler
        wrapper.inner.logprobs_mode = "raw_logprobs" if wrapped else "processed_logprobs"
        sampler.topk_topp_sampler = wrapper if wrapped else wrapper.inner

    (wrapper,) = rollout.engine.collective_rpc(lambda worker: worker.model_runner.sampler.topk_topp_sampler)
    assert isinstance(wrapper, TemperedTopKTopP)
    rollout.engine.collective_rpc(unwrap, kwargs={"wrapped": False})
    try:
        with pytest.raises(
            RolloutError, match="it sampled without the sampler step whose log-probs the rollout"
        ):
            rollout.generate([PROMPT], LONG, seed=0)
    finally:
        rollout.engine.collective_rpc(unwrap, kwargs={"wrapped": True})
    rollout.generate([PROMPT], LONG, seed=0)


def test_an_engine_that_dies_mid_run_names_the_rank_and_the_last_request(colocated) -> None:
    """The model's forward fails on its third call (a device error, say): every call then raises
    RolloutError naming the rank and the last request, not vLLM's own exception or a hang."""
    rollout = colocated.rollout
    calls = itertools.count()

    def break_forward(worker):
        model = worker.model_runner.model
        forward = model.forward

        def failing(*args, **kwargs):
            if next(calls) >= 2:
                raise RuntimeError("injected: the device is gone")
            return forward(*args, **kwargs)

        model.forward = failing

    rollout.engine.collective_rpc(break_forward)
    died = (
        r"the vLLM engine on rank 0 died while generating \(the last request sent: 'verl-vllm-generate-\d+-2'"
    )
    with pytest.raises(RolloutError, match=died) as caught:
        rollout.generate([PROMPT] * 3, LONG, seed=0)
    assert "RuntimeError: injected: the device is gone" in str(caught.value)
    with pytest.raises(RolloutError, match=died):
        rollout.generate([PROMPT], LONG, seed=0)
    with pytest.raises(RolloutError, match=died):
        requests(rollout, [PROMPT], LONG)
    with pytest.raises(RolloutError, match=died):
        rollout.update_weights(_weights(colocated))


def test_closing_the_engine_keeps_the_trainers_process_group(colocated) -> None:
    """vLLM's shutdown destroys the default process group, which it took from the trainer as its world."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    colocated.rollout.close()
    assert dist.is_initialized() and dist.group.WORLD is colocated.group
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 1.0
    assert parallel_state._WORLD is None  # vLLM's own groups are gone
    with pytest.raises(RolloutError, match="the vllm rollout was closed"):
        colocated.rollout.generate([PROMPT], LONG, seed=0)


def context(colocated, **capabilities) -> RolloutContext:
    """The rollout kit's context for the module's rollout, with the capabilities it declares (changed)."""
    from verl_core.plugins import get_registry

    declared = get_registry().get("rollout_backends", "vllm").capabilities
    return RolloutContext(
        "vllm", colocated.rollout, colocated.model_dir, "cpu", attrs.evolve(declared, **capabilities)
    )


def _weights(colocated):
    """The model's own weights, as an engine's get_per_tensor_param sends them."""
    from verl_core.testing.reference import load_reference_model

    return load_reference_model(colocated.model_dir, "lm").state_dict().items()
