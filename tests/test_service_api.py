"""The Tinker-style API (``verl_core.service``, docs/embedding.md "A Tinker-style API") on the tiny model
over the ddp backend: ``forward_backward`` + ``optim_step`` against an engine's ``train_batch`` bitwise,
the losses against plain PyTorch and their formulas, the custom loss, states saved and loaded, samplers
from saved weights, LoRA clients side by side, futures, and the errors. Each check has a broken
variant that the same comparison catches."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from verl_core.config import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
from verl_core.data import batch as keys
from verl_core.engine import build_engine
from verl_core.service import (
    AdamParams,
    Datum,
    ModelInput,
    SamplingParams,
    ServiceClient,
    TensorData,
)
from verl_core.service.losses import SAMPLER_LOG_PROBS, elementwise_loss
from verl_core.testing.tiny import VOCAB_SIZE, save_tiny_models

torch.set_num_threads(1)

#: AdamParams of the steps; the service's engine starts from other settings, so equal weights after a
#: step prove that these were applied.
STEP = AdamParams(learning_rate=2e-3, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.05, grad_clip_norm=0.5)
STEP_OPTIM = OptimConfig(lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05, clip_grad=0.5)


def sequences(seed: int, count: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (count,), generator=generator).tolist()
    return [torch.randint(1, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def sft_data(seed: int) -> list[Datum]:
    """Tinker's SFT data: input = sequence[:-1], targets = sequence[1:], the first two positions unweighted."""
    data = []
    for tokens in sequences(seed):
        weights = [0.0, 0.0] + [1.0] * (len(tokens) - 3)
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return data


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp("tiny")).lm


@pytest.fixture(scope="module")
def engine_config(model_dir):
    return EngineConfig(
        backend="ddp",
        model=ModelConfig(path=model_dir),
        device="cpu",
        optim=OptimConfig(lr=0.1, betas=(0.5, 0.5), eps=1e-3, weight_decay=0.5, clip_grad=0.0),
        micro_batch=MicroBatchConfig(micro_batch_size=2),  # 5 data: three micro-batches accumulate
    )


@pytest.fixture(scope="module")
def service(model_dir, engine_config, tmp_path_factory):
    with ServiceClient(
        {"tiny": model_dir}, state_dir=tmp_path_factory.mktemp("state"), engine=engine_config
    ) as client:
        yield client


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.get_per_tensor_param()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


# -- forward_backward + optim_step is an engine step ----------------------------------------------


def reference_batch(data: list[Datum]) -> TensorDict:
    """The engine batch of ``data``, written out independently: the first input token is the prompt,
    the rest and the last target the response, right-padded."""
    length = max(datum.model_input.length for datum in data)
    rows = []
    for datum in data:
        tokens = datum.model_input.to_ints() + [datum.loss_fn_inputs["target_tokens"].data[-1]]
        rows.append((tokens, datum.loss_fn_inputs["weights"].data))
    pad = length + 1
    input_ids = torch.tensor([t + [0] * (pad - len(t)) for t, _ in rows])
    attention = torch.tensor([[1] * len(t) + [0] * (pad - len(t)) for t, _ in rows])
    return TensorDict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention,
            keys.POSITION_IDS: (attention.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: input_ids[:, 1:],
            keys.RESPONSE_MASK: attention[:, 1:],
            "w": torch.tensor([w + [0.0] * (length - len(w)) for _, w in rows]),
        },
        batch_size=[len(data)],
    )


def reference_cross_entropy(output, micro_batch, dp_group):
    return -(micro_batch["w"] * output[keys.LOG_PROBS]).sum(), {}


def service_steps(service, params: AdamParams, seeds=(0, 1)) -> dict[str, torch.Tensor]:
    client = service.create_training_client("tiny").result()
    for seed in seeds:
        client.forward_backward(sft_data(seed), "cross_entropy")
        client.optim_step(params)
    client.forward(sft_data(0), "cross_entropy").result()  # waits for the steps
    return weights(client.engine)


def engine_steps(engine_config, seeds=(0, 1)) -> dict[str, torch.Tensor]:
    engine = build_engine(attrs.evolve(engine_config, optim=STEP_OPTIM), role="lm")
    engine.initialize()
    for seed in seeds:
        with engine.train_mode():
            engine.train_batch(reference_batch(sft_data(seed)), reference_cross_entropy)
    return weights(engine)


def test_forward_backward_and_optim_step_equal_train_batch_bitwise(service, engine_config):
    expected = engine_steps(engine_config)
    assert same_weights(service_steps(service, STEP), expected)


def test_the_bitwise_comparison_catches_adam_params_not_applied(service, engine_config):
    # A step with the engine's own settings (as if AdamParams were ignored) moves the weights elsewhere.
    ignored = AdamParams(learning_rate=0.1, beta1=0.5, beta2=0.5, eps=1e-3, weight_decay=0.5)
    assert not same_weights(service_steps(service, ignored), engine_steps(engine_config))


def test_the_bitwise_comparison_catches_gradients_kept_across_steps(service, engine_config):
    # Two forward_backward calls before one step accumulate: not the two-step result.
    client = service.create_training_client("tiny").result()
    client.forward_backward(sft_data(0), "cross_entropy")
    client.forward_backward(sft_data(1), "cross_entropy")
    client.optim_step(STEP).result()
    assert not same_weights(weights(client.engine), engine_steps(engine_config))


# -- the losses ------------------------------------------------------------------------------------


def plain_log_probs(model_dir: str, data: list[Datum]) -> list[torch.Tensor]:
    """Each datum's target log-probs from the Hugging Face model, one unpadded sequence at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = []
    with torch.no_grad():
        for datum in data:
            logits = model(torch.tensor([datum.model_input.to_ints()])).logits[0]
            targets = datum.loss_fn_inputs["target_tokens"].to_torch()
            result.append(torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0])
    return result


def off_targets(data: list[Datum]) -> list[Datum]:
    """Targets that are not the next input token (reversed), which the engine scores as candidates."""
    return [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"].data[::-1],
                "weights": d.loss_fn_inputs["weights"],
            },
        )
        for d in data
    ]


@pytest.mark.parametrize("targets", ["shifted", "other"])
def test_cross_entropy_is_the_plain_pytorch_sum(service, model_dir, targets):
    data = sft_data(3) if targets == "shifted" else off_targets(sft_data(3))
    client = service.create_training_client("tiny").result()
    output = client.forward(data, "cross_entropy").result()
    expected = plain_log_probs(model_dir, data)
    loss = sum(
        -(d.loss_fn_inputs["weights"].to_torch() * lp).sum() for d, lp in zip(data, expected, strict=True)
    )
    assert output.metrics["loss:sum"] == pytest.approx(float(loss), rel=1e-5)
    for result, lp, datum in zip(output.loss_fn_outputs, expected, data, strict=True):
        torch.testing.assert_close(result["logprobs"].to_torch(), lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            result["elementwise_loss"].to_torch(),
            -datum.loss_fn_inputs["weights"].to_torch() * lp,
            atol=1e-5,
            rtol=0,
        )
    # Broken variant: the log-probs of the input tokens (no shift) are not the targets'.
    unshifted = [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={"target_tokens": d.model_input.to_ints(), "weights": d.loss_fn_inputs["weights"]},
        )
        for d in data
    ]
    wrong = plain_log_probs(model_dir, unshifted)
    assert not torch.allclose(output.loss_fn_outputs[0]["logprobs"].to_torch(), wrong[0], atol=1e-3)


def rl_data(seed: int, sampler_shift: float) -> list[Datum]:
    """Datums with the sampler's log-probs (the model's, moved by noise) and advantages."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for datum in sft_data(seed):
        n = datum.model_input.length
        data.append(
            Datum(
                model_input=datum.model_input,
                loss_fn_inputs={
                    "target_tokens": datum.loss_fn_inputs["target_tokens"],
                    "logprobs": -4.8 + sampler_shift * torch.randn(n, generator=generator),
                    "advantages": torch.randn(n, generator=generator),
                },
            )
        )
    return data


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_policy_losses_follow_their_formulas(service, model_dir, loss_fn):
    data = rl_data(4, sampler_shift=0.5)  # ratios far enough from 1 that PPO clips some
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1} if loss_fn == "ppo" else None
    client = service.create_training_client("tiny").result()
    output = client.forward(data, loss_fn, config).result()
    total, clipped = 0.0, 0
    for datum, lp in zip(data, plain_log_probs(model_dir, data), strict=True):
        for i in range(len(lp)):
            q = datum.loss_fn_inputs["logprobs"].data[i]
            a = datum.loss_fn_inputs["advantages"].data[i]
            ratio = math.exp(float(lp[i]) - q)
            if loss_fn == "importance_sampling":
                total += -ratio * a
            else:
                bounded = min(max(ratio, 0.9), 1.1)
                clipped += bounded != ratio
                total += -min(ratio * a, bounded * a)
    assert output.metrics["loss:sum"] == pytest.approx(total, rel=1e-4)
    if loss_fn == "ppo":
        assert clipped > 0
        # Broken variant: the default thresholds (0.8, 1.2) clip less, a different loss.
        default = client.forward(data, "ppo").result().metrics["loss:sum"]
        assert default != pytest.approx(total, rel=1e-4)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(-8, 0), st.floats(-8, 0), st.floats(-3, 3), st.floats(0.5, 1.0), st.floats(1.0, 1.5)
        ),
        min_size=1,
        max_size=6,
    )
)
def test_ppo_terms_are_the_clipped_surrogate(terms):
    low = min(term[3] for term in terms)
    high = max(term[4] for term in terms)
    lp = torch.tensor([[t[0] for t in terms]], dtype=torch.float64)
    batch = TensorDict(
        {
            keys.RESPONSE_MASK: torch.ones(1, len(terms)),
            SAMPLER_LOG_PROBS: torch.tensor([[t[1] for t in terms]], dtype=torch.float64),
            keys.ADVANTAGES: torch.tensor([[t[2] for t in terms]], dtype=torch.float64),
        },
        batch_size=[1],
    )
    got = elementwise_loss("ppo", {"clip_low_threshold": low, "clip_high_threshold": high}, lp, batch)[0]
    for value, (p, q, a, _, _) in zip(got.tolist(), terms, strict=True):
        ratio = math.exp(p - q)
        expected = -min(ratio * a, min(max(ratio, low), high) * a)
        assert value == pytest.approx(expected, rel=1e-9, abs=1e-12)


# -- the custom loss -------------------------------------------------------------------------------


def custom_steps(service, loss_fn) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    client = service.create_training_client("tiny").result()
    result = client.forward_backward_custom(sft_data(0), loss_fn)
    client.optim_step(STEP).result()
    return weights(client.engine), result.result().metrics


def user_cross_entropy(data, logprobs):
    loss = sum(
        -(d.loss_fn_inputs["weights"].to_torch() * lp).sum() for d, lp in zip(data, logprobs, strict=True)
    )
    return loss, {"custom": 1.0}


def test_custom_loss_gives_the_built_in_gradients(service, engine_config):
    got, metrics = custom_steps(service, user_cross_entropy)
    expected = engine_steps(engine_config, seeds=(0,))
    assert same_weights(got, expected)
    built_in = service.create_training_client("tiny").result().forward(sft_data(0), "cross_entropy").result()
    assert metrics["loss:sum"] == pytest.approx(built_in.metrics["loss:sum"], rel=1e-5)
    assert metrics["surrogate_loss:sum"] == pytest.approx(built_in.metrics["loss:sum"], rel=1e-5)
    assert metrics["custom"] == 1.0
    # Broken variant: a loss twice as large is another step.
    doubled, _ = custom_steps(service, lambda data, lps: (2 * user_cross_entropy(data, lps)[0], {}))
    assert not same_weights(doubled, expected)


# -- states ----------------------------------------------------------------------------------------


def stepped_client(service):
    """A full fine-tuning client after one step on ``sft_data(0)`` (its futures not awaited)."""
    client = service.create_training_client("tiny").result()
    client.forward_backward(sft_data(0), "cross_entropy")
    client.optim_step(STEP)
    return client


def test_save_and_load_state_continue_bitwise(service):
    first = stepped_client(service)
    saved = first.save_state("after-one").result()
    assert saved.path == f"tinker://{first.model_id}/weights/after-one"
    first.forward_backward(sft_data(1), "cross_entropy")
    first.optim_step(STEP).result()
    expected = weights(first.engine)

    def resumed(create) -> dict[str, torch.Tensor]:
        client = create(saved.path).result()
        client.forward_backward(sft_data(1), "cross_entropy")
        client.optim_step(STEP).result()
        return weights(client.engine)

    assert same_weights(resumed(service.create_training_client_from_state_with_optimizer), expected)
    # Broken variant: without the optimiser's moments the second step differs.
    assert not same_weights(resumed(service.create_training_client_from_state), expected)
    # load_state on a running client does the same.
    other = service.create_training_client("tiny").result()
    other.load_state_with_optimizer(saved.path)
    other.forward_backward(sft_data(1), "cross_entropy")
    other.optim_step(STEP).result()
    assert same_weights(weights(other.engine), expected)
    with pytest.raises(FileExistsError, match="after-one.*overwrite=True"):
        first.save_state("after-one")


# -- sampling --------------------------------------------------------------------------------------


def target_log_probs(client, tokens: list[int]) -> list[float]:
    """The training client's log-probs of ``tokens[1:]``, each given the tokens before it."""
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)},
    )
    return client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data


def test_sampler_from_saved_weights(service):
    client = stepped_client(service)
    saved = client.save_weights_for_sampler("trained").result()
    assert saved.path == f"tinker://{client.model_id}/sampler_weights/trained"
    sampler = service.create_sampling_client(model_path=saved.path).result()
    tokens = sequences(5, count=1)[0]
    trained = target_log_probs(client, tokens)
    scored = sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()
    assert scored[0] is None
    assert scored[1:] == pytest.approx(trained, abs=1e-5)
    # Broken variant: the base model's sampler scores the same tokens otherwise.
    base = service.create_sampling_client(base_model="tiny").result()
    assert base.compute_logprobs(ModelInput.from_ints(tokens)).result()[1:] != pytest.approx(
        trained, abs=1e-5
    )

    prompt = ModelInput.from_ints(tokens[:3])
    response = sampler.sample(prompt, 3, SamplingParams(max_tokens=6, seed=1)).result()
    assert len(response.sequences) == 3
    for sequence in response.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) == 6
        assert sequence.stop_reason == "length"
    greedy = sampler.sample(prompt, 1, SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    # The sampler's log-probs are the model's: score the greedy continuation.
    full = sampler.compute_logprobs(ModelInput.from_ints(tokens[:3] + greedy.tokens)).result()
    assert full[3:] == pytest.approx(greedy.logprobs, abs=1e-5)
    stop = greedy.tokens[2]
    stopped = sampler.sample(prompt, 1, SamplingParams(max_tokens=6, temperature=0.0, stop=[stop])).result()
    first_stop = greedy.tokens.index(stop)
    assert stopped.sequences[0].tokens == greedy.tokens[: first_stop + 1]
    assert stopped.sequences[0].stop_reason == "stop"
    with_prompt = sampler.sample(
        prompt, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True
    ).result()
    assert with_prompt.prompt_logprobs == pytest.approx(scored[:3], abs=1e-6)

    # save_weights_and_get_sampling_client: the weights as they are after the calls before it.
    snapshot = client.save_weights_and_get_sampling_client().result()
    assert snapshot.compute_logprobs(ModelInput.from_ints(tokens)).result()[1:] == pytest.approx(
        trained, abs=1e-5
    )


# -- LoRA clients side by side, futures --------------------------------------------------------------


def test_lora_clients_train_side_by_side(service, model_dir):
    one = service.create_lora_training_client("tiny", rank=4, seed=1).result()
    two = service.create_lora_training_client("tiny", rank=4, seed=1, train_unembed=False).result()
    assert one.get_info().is_lora and one.get_info().lora_rank == 4
    before = [weights(one.engine), weights(two.engine)]
    one.forward_backward(sft_data(0), "cross_entropy")
    two.forward_backward(sft_data(1), "cross_entropy")
    one.optim_step(AdamParams(learning_rate=1e-2))
    two.optim_step(AdamParams(learning_rate=1e-2))
    sampler = one.save_weights_and_get_sampling_client("lora").result()
    two.forward(sft_data(0), "cross_entropy").result()
    after = [weights(one.engine), weights(two.engine)]
    assert not same_weights(after[0], before[0]) and not same_weights(after[1], before[1])
    assert not same_weights(after[0], after[1])
    # The second adapter leaves the LM head alone (train_unembed=False); the first moves it.
    assert torch.equal(after[1]["lm_head.weight"], before[1]["lm_head.weight"])
    assert not torch.equal(after[0]["lm_head.weight"], before[0]["lm_head.weight"])
    tokens = sequences(6, count=1)[0]
    merged = sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()
    trained = target_log_probs(one, tokens)
    assert merged[1:] == pytest.approx(trained, abs=1e-5)


def test_futures_run_in_call_order_and_can_be_awaited(service):
    client = service.create_training_client("tiny").result()

    async def loop() -> tuple[float, float]:
        before = client.forward(sft_data(0), "cross_entropy")
        await client.forward_backward_async(sft_data(0), "cross_entropy")
        await client.optim_step_async(AdamParams(learning_rate=5e-2))
        after = client.forward(sft_data(0), "cross_entropy")  # submitted before anything was awaited
        return (await before).metrics["loss:sum"], (await after.result_async()).metrics["loss:sum"]

    before, after = asyncio.run(loop())
    assert after < before  # the step ran between the two forwards, in order


# -- errors ------------------------------------------------------------------------------------------


def test_errors_name_the_datum_key_and_fix(service):
    client = service.create_training_client("tiny").result()
    data = sft_data(0)
    with pytest.raises(ValueError, match=r"loss_fn='cross_entropi'.*did you mean 'cross_entropy'"):
        client.forward_backward(data, "cross_entropi")
    missing = [
        *data[:1],
        Datum(
            model_input=data[1].model_input,
            loss_fn_inputs={"target_tokens": data[1].loss_fn_inputs["target_tokens"]},
        ),
    ]
    with pytest.raises(ValueError, match=r"data\[1\]\.loss_fn_inputs lacks \['weights'\]"):
        client.forward_backward(missing, "cross_entropy")
    short = Datum(
        model_input=data[0].model_input, loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]}
    )
    n = data[0].model_input.length
    with pytest.raises(
        ValueError,
        match=rf"data\[0\]\.loss_fn_inputs\['target_tokens'\] has shape \[2\] but .* has {n} tokens.*shape \[{n}\]",
    ):
        client.forward_backward([short], "cross_entropy")
    with pytest.raises(
        ValueError,
        match=r"data\[0\]\.loss_fn_inputs has \['advantages'\].*exactly \['target_tokens', 'weights'\]",
    ):
        extra = Datum(
            model_input=data[0].model_input,
            loss_fn_inputs={**data[0].loss_fn_inputs, "advantages": [0.0] * n},
        )
        client.forward_backward([extra], "cross_entropy")
    with pytest.raises(
        ValueError, match=rf"data\[0\] has token id {VOCAB_SIZE}, outside the model's vocabulary"
    ):
        client.forward(
            [
                Datum(
                    model_input=ModelInput.from_ints([VOCAB_SIZE]),
                    loss_fn_inputs={"target_tokens": [1], "weights": [1.0]},
                )
            ],
            "cross_entropy",
        )
    with pytest.raises(ValueError, match=r"loss_fn_config\['clip_ratio'\]: 'ppo' has no such setting"):
        client.forward(rl_data(0, 0.1), "ppo", {"clip_ratio": 0.2})
    with pytest.raises(ValueError, match=r"unknown base model 'tiny2'.*serves \['tiny'\]"):
        service.create_lora_training_client("tiny2")
    with pytest.raises(FileNotFoundError, match="no saved state"):
        service.create_sampling_client(model_path=f"tinker://{client.model_id}/sampler_weights/never-saved")
    with pytest.raises(ValueError, match="holds weights, not sampler_weights: give it to load_state"):
        service.create_sampling_client(model_path=f"tinker://{client.model_id}/weights/x")
    with pytest.raises(ValueError, match="max_tokens is required"):
        service.create_sampling_client(base_model="tiny").result().sample(
            ModelInput.from_ints([1]), 1, SamplingParams()
        )
    with pytest.raises(TypeError, match="optim_step takes AdamParams"):
        client.optim_step({"learning_rate": 1e-3})


def test_a_failed_call_fails_the_calls_after_it(service):
    client = service.create_training_client("tiny").result()

    def broken(data, logprobs):
        raise ZeroDivisionError("the user's loss")

    failed = client.forward_backward_custom(sft_data(0), broken)
    later = client.optim_step(STEP)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    with pytest.raises(RuntimeError, match="an earlier call of this client failed"):
        later.result()


def test_tensor_data_round_trips():
    tensor = torch.tensor([[1, 0, 3], [0, 0, 4]])
    data = TensorData.from_torch(tensor)
    assert data.dtype == "int64" and data.shape == [2, 3] and torch.equal(data.to_torch(), tensor)
    sparse = TensorData(
        data=[1, 3, 4],
        dtype="int64",
        shape=[2, 3],
        sparse_crow_indices=[0, 2, 3],
        sparse_col_indices=[0, 2, 2],
    )
    assert torch.equal(sparse.to_torch(), tensor)
    assert (
        Datum(model_input=ModelInput.from_ints([1]), loss_fn_inputs={"weights": [1]})
        .loss_fn_inputs["weights"]
        .dtype
        == "float32"
    )


def test_the_docs_example_runs(capsys):
    """docs/embedding.md's "A Tinker-style API" block, as written: three LoRA steps learn the datum."""
    text = (Path(__file__).parents[1] / "docs" / "embedding.md").read_text()
    section = text[text.index("## A Tinker-style API") :].split("\n## ")[0]  # up to the next section
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    namespace: dict = {}
    exec(compile(block, "docs/embedding.md", "exec"), namespace)
    losses = namespace["losses"]
    assert losses[2] < losses[1] < losses[0]
    assert len(namespace["response"].sequences) == 2
    assert namespace["saved"].path.endswith("/weights/three-steps")
    assert "length" in capsys.readouterr().out
