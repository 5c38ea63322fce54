"""Rollout contract 2 in core: its API version and capabilities on the descriptor, BaseRollout's
defaults built on contract 1 (requests served one at a time by the batch call, abort while waiting,
resume), the bucketed weight stream and its checks, the built-in rollout's request path and sleep, and
the actor's weight sync and sleep between generations.

The rollout kit's checks of the same (``verl_core.testing.rollout_requests`` and ``rollout_weights``)
are tests/test_rollout_kit.py's subject; this file holds what the kit cannot see from outside.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import warnings
import zlib

import attrs
import pytest
import torch
from fixtures.rollouts import answered
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from verl_core import RolloutBackend, RolloutCapabilities, hookimpl
from verl_core.config import ModelConfig, load_config
from verl_core.data.batch import ROLLOUT_LOG_PROBS
from verl_core.deprecation import VerlCoreRemovedIn04Warning
from verl_core.errors import ApiVersionError, ConfigError, RolloutError
from verl_core.plugins import Kind, Registry
from verl_core.rollout import (
    BaseRollout,
    FinishReason,
    HFRollout,
    RolloutRequest,
    RolloutResponse,
    SamplingParams,
    weight_buckets,
)
from verl_core.rollout.buckets import unpack_buckets
from verl_core.rollout.requests import resume_seed
from verl_core.testing import save_rollout_model

torch.set_num_threads(1)

THIS_PLUGIN = sys.modules[__name__]
SAMPLING = SamplingParams(max_new_tokens=6, eos_token_ids=(2,), pad_token_id=0)
HF_ROLLOUT, HF_CONFIG = "verl_core.rollout.hf:HFRollout", "verl_core.rollout.config:HFRolloutConfig"


# -- the descriptor: api_version and capabilities ----------------------------------------------------


class UnstatedPlugin:
    """A rollout plugin of verl-core 0.1, whose descriptor states no api_version."""

    @hookimpl
    def verl_rollout_backends(self):
        return [RolloutBackend(name="old-rollout", rollout=HF_ROLLOUT, config=HF_CONFIG)]


def test_a_rollout_backend_without_api_version_reads_as_1_warning_with_the_plugin() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = Registry.from_plugins([UnstatedPlugin()])
    (warning,) = [w for w in caught if issubclass(w.category, VerlCoreRemovedIn04Warning)]
    assert "rollout backend 'old-rollout': RolloutBackend without api_version is deprecated" in str(
        warning.message
    )
    assert str(warning.message).startswith("plugin 'UnstatedPlugin' (no distribution), rollout backend")
    assert "api_version=1" in str(warning.message) and "api_version=2" in str(warning.message)
    descriptor = registry.get(Kind.ROLLOUT_BACKENDS, "old-rollout")
    assert descriptor.api_version == 1 and descriptor.capabilities == RolloutCapabilities()


class FuturePlugin:
    @hookimpl
    def verl_rollout_backends(self):
        return [RolloutBackend(name="future", rollout=HF_ROLLOUT, config=HF_CONFIG, api_version=3)]


def test_a_rollout_api_version_core_does_not_speak_is_refused_naming_both() -> None:
    registry = Registry.from_plugins([FuturePlugin()])
    (entry,) = [entry for entry in registry.entries(Kind.ROLLOUT_BACKENDS) if entry.name == "future"]
    assert entry.status == "incompatible"
    with pytest.raises(ApiVersionError) as error:
        registry.get(Kind.ROLLOUT_BACKENDS, "future")
    message = str(error.value)
    assert "targets rollout API version 3" in message
    assert "speaks rollout API versions 1 to 2" in message and "Upgrade verl-core" in message


def test_capabilities_are_checked_and_need_api_version_2() -> None:
    with pytest.raises(ValueError, match=r"RolloutCapabilities\.requests='async': expected one of"):
        RolloutCapabilities(requests="async")
    with pytest.raises(ValueError, match=r"sleep_frees_weights=True\) needs sleep=True"):
        RolloutCapabilities(sleep_frees_weights=True)
    with pytest.raises(ValueError, match=r"abort_resume=True\) needs a request path of the backend's own"):
        RolloutCapabilities(abort_resume=True)
    with pytest.raises(ValueError, match=r"dtypes=\('float64',\)"):
        RolloutCapabilities(dtypes=("float64",))
    with pytest.raises(ValueError, match=r"log_prob_tolerance=0: expected a number in \(0, 1\)"):
        RolloutCapabilities(log_prob_tolerance=0)
    with pytest.raises(ValueError, match=r"capabilities are rollout contract 2's.*state api_version=2"):
        RolloutBackend(
            name="x", rollout="m:R", config="m:C", api_version=1, capabilities=RolloutCapabilities(sleep=True)
        )
    with pytest.raises(
        TypeError, match=r"capabilities=\{'sleep': True\}: expected a verl_core\.RolloutCapabilities"
    ):
        RolloutBackend(name="x", rollout="m:R", config="m:C", api_version=2, capabilities={"sleep": True})
    # Strings are the members they name.
    assert RolloutCapabilities(requests="serial", abort_resume=True).requests == "serial"


def test_verl_core_plugins_lists_each_rollouts_api_version_and_capabilities(capsys) -> None:
    import json

    from verl_core.cli import main
    from verl_core.rollout.catalog import HF_CAPABILITIES

    assert main(["plugins", "--all", "--json"]) == 0
    (hf,) = [row for row in json.loads(capsys.readouterr().out)["rollout_backends"] if row["name"] == "hf"]
    assert hf["api_version"] == 2
    assert hf["capabilities"] == {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in attrs.asdict(HF_CAPABILITIES, recurse=False).items()
    }
    assert main(["plugins", "--all"]) == 0
    table = capsys.readouterr().out
    (line,) = [line for line in table.split("rollout_backends:")[1].splitlines() if line.startswith("hf ")]
    assert (
        " 2 " in line
        and "requests=serial abort_resume prefix_caching sleep log_prob_semantics=tempered" in line
    )
    assert "sleep_frees_weights" not in line  # false: not listed


class Float32OnlyPlugin:
    @hookimpl
    def verl_rollout_backends(self):
        return [
            RolloutBackend(
                name="f32",
                rollout=HF_ROLLOUT,
                config=HF_CONFIG,
                api_version=2,
                capabilities=RolloutCapabilities(dtypes=("float32",)),
            )
        ]


def test_a_dtype_the_backend_does_not_declare_is_refused_at_its_key(demo, tmp_path) -> None:
    from fixtures.demo import run_overrides

    registry = Registry.from_plugins([Float32OnlyPlugin()], autoload=True)
    overrides = [*run_overrides(demo, tmp_path), "rollout.backend=f32"]
    load_config([], overrides, registry=registry)
    with pytest.raises(ConfigError) as error:
        load_config([], [*overrides, "rollout.dtype=bfloat16"], registry=registry)
    assert "rollout.dtype: rollout backend 'f32' generates in float32, not bfloat16" in str(error.value)


# -- BaseRollout's defaults, on a contract-1 rollout ---------------------------------------------------


class ScriptedRollout(BaseRollout):
    """A contract-1 rollout (the three abstract methods only) answering each prompt with tokens drawn
    from its seed, and recording every ``generate`` call; ``gate``, when set up, holds a call until opened."""

    def initialize(self):
        self.calls: list[tuple[list[list[int]], SamplingParams, int]] = []
        self.gate: threading.Event | None = None
        self.started = threading.Event()

    def update_weights(self, params):
        for _ in params:
            pass

    def generate(self, prompts, sampling, seed):
        self.calls.append(([list(p) for p in prompts], sampling, seed))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        generator = torch.Generator().manual_seed(seed)
        answers = []
        for _ in prompts:
            tokens = []
            while len(tokens) < sampling.max_new_tokens:
                tokens.append(int(torch.randint(1, 40, (1,), generator=generator)))
                if tokens[-1] in sampling.eos_token_ids:
                    break
            answers.append(tokens)
        return answered(prompts, answers, sampling.pad_token_id)


def scripted() -> ScriptedRollout:
    rollout = ScriptedRollout(ModelConfig(path="unused"))
    rollout.initialize()
    return rollout


def row_of(output: TensorDict) -> tuple[list[int], list[float]]:
    mask = output["response_mask"][0].bool()
    return output["responses"][0][mask].tolist(), output[ROLLOUT_LOG_PROBS][0][mask].tolist()


def test_the_default_request_is_the_batch_call_of_its_one_prompt() -> None:
    rollout = scripted()
    request = RolloutRequest([5, 6, 7], SAMPLING, seed=11, request_id="a")
    response = asyncio.run(rollout.generate_request(request))
    tokens, log_probs = row_of(scripted().generate([[5, 6, 7]], SAMPLING, 11))
    assert response == RolloutResponse("a", tokens, log_probs, "eos" if tokens[-1] == 2 else "length")
    assert rollout.calls == [([[5, 6, 7]], SAMPLING, 11)]


def test_the_default_resumes_with_the_prompt_extended_and_a_derived_seed() -> None:
    rollout = scripted()
    partial = RolloutResponse("b", [9, 8], [-0.9, -0.8], "aborted")
    request = RolloutRequest([5, 6, 7], SAMPLING, seed=11, request_id="b", resume_from=partial)
    response = asyncio.run(rollout.generate_request(request))
    ((prompts, sampling, seed),) = rollout.calls
    assert prompts == [[5, 6, 7, 9, 8]]
    assert sampling == attrs.evolve(SAMPLING, max_new_tokens=4) and seed == resume_seed(11, 2) != 11
    tokens, log_probs = row_of(scripted().generate(prompts, sampling, seed))
    assert response.token_ids == (9, 8, *tokens) and response.log_probs == (-0.9, -0.8, *log_probs)
    # Nothing left to generate: returned as it is, without a call.
    for done, finish in (([3] * 6, "length"), ([3, 2], "eos")):
        complete = RolloutResponse("c", done, [-0.1] * len(done), "aborted")
        again = asyncio.run(rollout.generate_request(attrs.evolve(request, resume_from=complete)))
        assert again.token_ids == tuple(done) and again.finish_reason == finish
    assert len(rollout.calls) == 1


def test_the_default_serves_one_request_at_a_time_and_aborts_one_still_waiting() -> None:
    rollout = scripted()
    rollout.gate = threading.Event()

    async def scenario():
        first = asyncio.ensure_future(
            rollout.generate_request(RolloutRequest([1], SAMPLING, seed=1, request_id="first"))
        )
        second = asyncio.ensure_future(
            rollout.generate_request(RolloutRequest([2], SAMPLING, seed=2, request_id="second"))
        )
        while not rollout.started.is_set():
            await asyncio.sleep(0.001)
        with pytest.raises(RolloutError, match=r"request_id 'first' is already in flight"):
            await rollout.generate_request(RolloutRequest([3], SAMPLING, request_id="first"))
        await rollout.abort("second")  # waiting for its turn: it returns at once
        aborted = await asyncio.wait_for(second, 10)
        assert not first.done() and len(rollout.calls) == 1
        await rollout.abort("first")  # generating: the batch call cannot be stopped
        await rollout.abort("no-such-request")  # ignored
        rollout.gate.set()
        return await first, aborted

    first, aborted = asyncio.run(scenario())
    assert aborted == RolloutResponse("second", (), (), FinishReason.ABORTED)
    assert first.finish_reason in ("eos", "length") and first.token_ids
    assert [call[0] for call in rollout.calls] == [[[1]]]


def test_a_cancelled_request_holds_its_turn_until_its_call_returns() -> None:
    rollout = scripted()
    rollout.gate = threading.Event()

    async def scenario():
        first = asyncio.ensure_future(
            rollout.generate_request(RolloutRequest([1], SAMPLING, request_id="first"))
        )
        second = asyncio.ensure_future(
            rollout.generate_request(RolloutRequest([2], SAMPLING, request_id="second"))
        )
        while not rollout.started.is_set():
            await asyncio.sleep(0.001)
        first.cancel()
        await asyncio.sleep(0.05)
        assert len(rollout.calls) == 1  # the second waits: the first's call is still running
        rollout.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await second

    second = asyncio.run(scenario())
    assert second.token_ids and [call[0] for call in rollout.calls] == [[[1]], [[2]]]


def test_requests_and_responses_refuse_what_cannot_be_served() -> None:
    with pytest.raises(ValueError, match="an empty prompt"):
        RolloutRequest([], SAMPLING)
    with pytest.raises(ValueError, match=r"RolloutRequest\.seed=-1: must be an int >= 0"):
        RolloutRequest([1], SAMPLING, seed=-1)
    with pytest.raises(ValueError, match=r"prompt_ids: expected token ids"):
        RolloutRequest([1, -2], SAMPLING)
    long = RolloutResponse("x", [3] * 7, [-1.0] * 7, "aborted")
    with pytest.raises(ValueError, match=r"resume_from holds 7 tokens, more than sampling\.max_new_tokens=6"):
        RolloutRequest([1], SAMPLING, resume_from=long)
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        RolloutResponse("x", [3, 4], [-1.0], "length")
    with pytest.raises(ValueError, match=r"'stopped' is not a FinishReason"):
        RolloutResponse("x", [3], [-1.0], "stopped")


# -- weight buckets ----------------------------------------------------------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


@st.composite
def tensors(draw) -> list[tuple[str, torch.Tensor]]:
    count = draw(st.integers(0, 8))
    out = []
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        values = torch.arange(int(torch.tensor(shape).prod()) if shape else 1).reshape(shape) * (i + 3) % 251
        out.append((f"w{i}", values.to(dtype)))
    return out


@settings(max_examples=60, deadline=None)
@given(tensors(), st.integers(1, 300))
def test_buckets_carry_every_tensor_exactly_within_their_size(params, bucket_bytes) -> None:
    buckets = list(weight_buckets(iter(params), bucket_bytes))
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert [b.final for b in buckets] == [False] * (len(buckets) - 1) + [True]
    for bucket in buckets:
        assert bucket.checksum == zlib.crc32(bucket.buffer.numpy().tobytes())
        # Over the size only as a single tensor larger than a bucket.
        assert bucket.nbytes <= bucket_bytes or len(bucket.names) == 1
    received = list(unpack_buckets(iter(buckets)))
    assert [name for name, _ in received] == [name for name, _ in params]
    for (_, got), (_, sent) in zip(received, params, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_flipped_byte_of_a_bucket_is_refused_naming_it(data) -> None:
    params = [(f"w{i}", torch.randn(7, 3, generator=torch.Generator().manual_seed(i))) for i in range(6)]
    buckets = list(weight_buckets(iter(params), 200))
    index = data.draw(st.integers(0, len(buckets) - 1))
    corrupt = buckets[index].buffer.clone()
    corrupt[data.draw(st.integers(0, corrupt.numel() - 1))] ^= data.draw(st.integers(1, 255))
    buckets[index] = attrs.evolve(buckets[index], buffer=corrupt)
    with pytest.raises(RolloutError, match=rf"bucket {index} \(.*\) is corrupt: its bytes have CRC-32"):
        list(unpack_buckets(iter(buckets)))


def test_a_gap_a_repeat_a_name_twice_a_bucket_after_the_final_one_and_a_truncated_stream_are_refused() -> (
    None
):
    params = [(f"w{i}", torch.full((4,), float(i))) for i in range(5)]
    buckets = list(weight_buckets(iter(params), 32))  # two tensors (16 bytes each) per bucket
    assert len(buckets) == 3
    cases = {
        r"arrived after 1 bucket\(s\): bucket 1 is missing": [buckets[0], buckets[2]],
        r"bucket 0 .* arrived after 1 bucket\(s\): a bucket arrived twice or late": [buckets[0], buckets[0]],
        r"holds 'w0', which an earlier bucket already sent": [buckets[0], attrs.evolve(buckets[0], index=1)],
        r"arrived after the final bucket 2": [*buckets, attrs.evolve(buckets[2], index=3)],
        r"ended after 2 bucket\(s\) without its final one: a truncated stream": buckets[:2],
    }
    for message, stream in cases.items():
        with pytest.raises(RolloutError, match=message):
            list(unpack_buckets(iter(stream)))


def test_buckets_are_packed_lazily_about_one_at_a_time() -> None:
    read: list[str] = []

    def stream():
        for i in range(6):
            read.append(f"w{i}")
            yield f"w{i}", torch.zeros(4)  # 16 bytes: two per bucket of 32

    seen = []
    for bucket in weight_buckets(stream(), 32):
        seen.append((bucket.names, len(read)))
    # Bucket k is handed on once the first tensor of bucket k + 1 is read, not later.
    assert seen == [(("w0", "w1"), 3), (("w2", "w3"), 5), (("w4", "w5"), 6)]


def test_the_default_sync_from_buckets_feeds_update_weights_and_a_bad_stream_fails_it() -> None:
    received = []

    class Recording(ScriptedRollout):
        def update_weights(self, params):
            received.extend((name, tensor.clone()) for name, tensor in params)

    rollout = Recording(ModelConfig(path="unused"))
    rollout.initialize()
    params = [(f"w{i}", torch.full((3,), float(i))) for i in range(4)]
    rollout.update_weights_from_buckets(weight_buckets(iter(params), 16))
    assert [(n, t.tolist()) for n, t in received] == [(n, t.tolist()) for n, t in params]
    with pytest.raises(RolloutError, match="truncated stream"):
        rollout.update_weights_from_buckets(list(weight_buckets(iter(params), 16))[:-1])


# -- the built-in rollout: requests and sleep -----------------------------------------------------------


@pytest.fixture(scope="module")
def hf_rollout(tmp_path_factory) -> HFRollout:
    rollout = HFRollout(
        ModelConfig(path=save_rollout_model(tmp_path_factory.mktemp("c2") / "model"), dtype="float32")
    )
    rollout.initialize()
    return rollout


def test_an_hf_request_is_its_prompts_batch_call_token_for_token(hf_rollout) -> None:
    sampling = SamplingParams(
        max_new_tokens=10, eos_token_ids=(2,), pad_token_id=0, temperature=0.7, top_k=20
    )
    for seed, prompt in enumerate(([5, 6, 7, 8], [9], [3, 1, 4, 1, 5, 9])):
        output = hf_rollout.generate([prompt], sampling, seed)
        tokens, log_probs = row_of(output)
        response = asyncio.run(hf_rollout.generate_request(RolloutRequest(prompt, sampling, seed=seed)))
        assert list(response.token_ids) == tokens and list(response.log_probs) == log_probs


def test_hf_sleep_frees_its_cache_refuses_work_naming_wake_up_and_wakes_with_its_weights(hf_rollout) -> None:
    sampling = SamplingParams(max_new_tokens=8, eos_token_ids=(), pad_token_id=0, temperature=0.0)
    before = hf_rollout.generate([[5, 6, 7]], sampling, 0)
    asyncio.run(hf_rollout.generate_request(RolloutRequest([5, 6, 7], sampling)))  # keeps its cache
    assert hf_rollout._decoder.keys  # the request's KV cache is held for the next request
    hf_rollout.sleep()
    assert not hf_rollout._decoder.keys and hf_rollout._decoder.key_mask.numel() == 0
    state = {name: tensor.clone() for name, tensor in hf_rollout.model.state_dict().items()}
    with pytest.raises(RolloutError, match=r"asleep.*call wake_up\(\) before you generate"):
        hf_rollout.generate([[5, 6, 7]], sampling, 0)
    with pytest.raises(RolloutError, match=r"call wake_up\(\) before you generate"):
        asyncio.run(hf_rollout.generate_request(RolloutRequest([5, 6, 7], sampling)))
    with pytest.raises(RolloutError, match=r"call wake_up\(\) before you update the weights"):
        hf_rollout.update_weights((name, torch.zeros_like(t)) for name, t in state.items())
    assert all(torch.equal(t, state[n]) for n, t in hf_rollout.model.state_dict().items())
    hf_rollout.wake_up()
    hf_rollout.wake_up()  # awake already: nothing
    after = hf_rollout.generate([[5, 6, 7]], sampling, 0)
    assert torch.equal(after["responses"], before["responses"])
    assert torch.equal(after[ROLLOUT_LOG_PROBS], before[ROLLOUT_LOG_PROBS])


# -- the actor: bucketed sync, sleep between generations -------------------------------------------------


class ForwardingHFRollout(HFRollout):
    """Takes bucket streams with a method of its own, as a serving engine that sends them on to its
    processes would (here it unpacks them itself)."""

    streams = 0

    def update_weights_from_buckets(self, buckets):
        type(self).streams += 1
        self.update_weights(unpack_buckets(buckets))


@pytest.mark.parametrize("forwards", [False, True], ids=["hf", "forwarding"])
def test_the_actor_syncs_buckets_only_to_a_rollout_that_sends_them_on_and_sleeps_it_between_generations(
    demo, tmp_path, forwards
) -> None:
    """The built-in rollout unpacks buckets in the actor's process: it gets the tensors themselves (no
    copies, no checksums); a rollout with a bucket path of its own gets checked buckets."""
    from fixtures.demo import run_overrides

    from verl_core.workers.ranks import ActorWorker

    config = load_config([], run_overrides(demo, tmp_path, **{"rollout.update_weights_bucket_megabytes": 1}))
    worker = ActorWorker(config)
    worker.initialize()
    if forwards:
        worker.rollout.__class__ = ForwardingHFRollout
    sampling = SamplingParams(max_new_tokens=4, eos_token_ids=(), pad_token_id=0)
    worker.generate([[5, 6, 7]], sampling, 0)
    assert worker.rollout._asleep and not worker.rollout._decoder.keys
    with torch.no_grad():  # the policy moves: the sync must carry it
        for _, tensor in worker.policy.get_per_tensor_param():
            tensor.add_(0.5)
    ForwardingHFRollout.streams = 0
    worker.sync_weights()
    assert ForwardingHFRollout.streams == (1 if forwards else 0) and not worker.rollout._asleep
    policy = dict(worker.policy.get_per_tensor_param())
    rollout = worker.rollout.model.state_dict()
    assert policy.keys() == rollout.keys()
    assert all(torch.equal(rollout[name], tensor) for name, tensor in policy.items())
