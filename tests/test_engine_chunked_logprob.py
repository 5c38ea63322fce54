"""Log-probs and entropy a chunk of tokens at a time equal the whole computation, gradients included,
and the whole ``[tokens, vocabulary]`` logits never exist.

The models run in float64: chunked and whole then differ by rounding alone (~1e-15; in float32 the
matrix products of different row counts round differently, ~1e-6), so ``1e-6`` is a tolerance that
only a wrong result exceeds. Every comparison is shown to fail on a deliberately broken variant.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, CohereConfig

from verl_core.config.engine import MicroBatchConfig
from verl_core.config.validators import InvalidValue
from verl_core.data import COMPUTE_ENTROPY, ENTROPY, LOG_PROBS, TEMPERATURE
from verl_core.testing.tiny import VOCAB_SIZE, TinyModelSpec, collate, make_samples
from verl_core.toolkit import (
    TokenLogProbs,
    chunked_log_probs_and_entropy,
    chunked_token_log_probs,
    forward_micro_batch,
    log_probs_and_entropy,
    token_log_probs,
)
from verl_core.toolkit import forward as hf_module
from verl_core.toolkit import logprob as logprob_module
from verl_core.toolkit.varlen import attn_implementation_for

torch.set_num_threads(1)

TOLERANCE = 1e-6
TEMPERATURE_VALUE = 0.7


def largest_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys()
    return max(float((first[name] - second[name]).abs().max()) for name in first)


# -- the formula on its own -----------------------------------------------------------------------


def drops_the_last_partial_chunk(hidden, weight, bias, labels, temperature, compute_entropy, chunk_size):
    """A broken chunker: the tokens after the last whole chunk get zeros."""
    whole = labels.shape[0] // chunk_size * chunk_size
    log_probs, entropy = chunked_log_probs_and_entropy(
        hidden[:whole], weight, bias, labels[:whole], temperature, compute_entropy, chunk_size
    )
    padding = labels.new_zeros(labels.shape[0] - whole, dtype=log_probs.dtype)
    return torch.cat([log_probs, padding]), torch.cat([entropy, padding])


def formula_outputs(chunker, tokens, hidden_size, vocab, chunk_size, with_bias, seed):
    """Log-probs, entropy and the gradients of a weighted sum of both w.r.t. hidden, weight, bias."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = (
        torch.randn(vocab, generator=generator, dtype=torch.float64, requires_grad=True)
        if with_bias
        else None
    )
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    log_probs, entropy = chunker(hidden, weight, bias, labels, TEMPERATURE_VALUE, True, chunk_size)
    scales = torch.randn(2, tokens, generator=generator, dtype=torch.float64)
    leaves = [hidden, weight] + ([bias] if with_bias else [])
    grads = torch.autograd.grad((scales[0] * log_probs + scales[1] * entropy).sum(), leaves)
    return {"log_probs": log_probs.detach(), "entropy": entropy.detach()} | {
        f"grad{i}": g for i, g in enumerate(grads)
    }


def whole(hidden, weight, bias, labels, temperature, compute_entropy, chunk_size):
    return log_probs_and_entropy(F.linear(hidden, weight, bias), labels, temperature, compute_entropy)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(min_value=1, max_value=20),
    chunk_size=st.integers(min_value=1, max_value=24),
    vocab=st.integers(min_value=2, max_value=30),
    with_bias=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_chunks_of_any_size_give_the_whole_formula_and_its_gradients(
    tokens, chunk_size, vocab, with_bias, seed
) -> None:
    args = (tokens, 6, vocab, chunk_size, with_bias, seed)
    expected = formula_outputs(whole, *args)
    assert largest_difference(formula_outputs(chunked_log_probs_and_entropy, *args), expected) <= TOLERANCE


def test_the_formula_comparison_catches_a_chunker_that_drops_the_last_partial_chunk() -> None:
    args = (10, 6, 17, 3, True, 0)
    expected = formula_outputs(whole, *args)
    assert largest_difference(formula_outputs(drops_the_last_partial_chunk, *args), expected) > 1e-2


def test_leading_dimensions_are_kept_and_entropy_is_optional() -> None:
    hidden, weight = torch.randn(2, 5, 4), torch.randn(9, 4)
    labels = torch.randint(0, 9, (2, 5))
    log_probs, entropy = chunked_log_probs_and_entropy(hidden, weight, None, labels, chunk_size=3)
    assert entropy is None and log_probs.shape == (2, 5)
    with pytest.raises(ValueError, match=r"chunk_size=0.*>= 1"):
        chunked_log_probs_and_entropy(hidden, weight, None, labels, chunk_size=0)


# -- the backward: closed form, one chunk at a time ---------------------------------------------


def formula_inputs(tokens=10, hidden_size=5, vocab=13, with_bias=True, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=dtype).requires_grad_()
    bias = torch.randn(vocab, generator=generator, dtype=dtype).requires_grad_() if with_bias else None
    return hidden, weight, bias, torch.randint(0, vocab, (tokens,), generator=generator)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("compute_entropy", [True, False], ids=["entropy", "log-probs"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
def test_the_custom_backward_passes_gradcheck(temperature, compute_entropy, with_bias) -> None:
    hidden, weight, bias, labels = formula_inputs(with_bias=with_bias)
    leaves = (hidden, weight) + ((bias,) if with_bias else ())

    def outputs(hidden, weight, bias=None):  # 10 tokens in chunks of 3: four chunks, the last partial
        log_probs, entropy = chunked_log_probs_and_entropy(
            hidden, weight, bias, labels, temperature, compute_entropy, 3
        )
        return (log_probs, entropy) if compute_entropy else log_probs

    first = outputs(*leaves)
    node = (first[0] if compute_entropy else first).grad_fn.next_functions[0][0]
    assert type(node).__name__ == "_ChunkedHeadLogProbsBackward"
    assert torch.autograd.gradcheck(outputs, leaves)


def grads_of(chunker, loss_of, leaves, labels, chunk_size=3):
    log_probs, entropy = chunker(leaves[0], leaves[1], leaves[2], labels, TEMPERATURE_VALUE, True, chunk_size)
    wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
    return dict(enumerate(torch.autograd.grad(loss_of(log_probs, entropy), wanted)))


def recording_grad_logits(monkeypatch) -> list[tuple[bool, bool]]:
    """Which of ``_grad_logits``'s two output weights each chunk's backward got (not None)."""
    calls, original = [], logprob_module._grad_logits

    def recording(*args):
        calls.append((args[-2] is not None, args[-1] is not None))
        return original(*args)

    monkeypatch.setattr(logprob_module, "_grad_logits", recording)
    return calls


@pytest.mark.parametrize(
    ("used", "loss_of"),
    [
        ((False, True), lambda log_probs, entropy: (entropy * torch.linspace(-1, 2, entropy.numel())).sum()),
        (
            (True, False),
            lambda log_probs, entropy: (log_probs * torch.linspace(-1, 2, log_probs.numel())).sum(),
        ),
    ],
    ids=["entropy only", "log-probs only"],
)
def test_an_output_the_loss_does_not_use_skips_its_term(monkeypatch, used, loss_of) -> None:
    leaves = formula_inputs()
    expected = grads_of(whole, loss_of, leaves[:3], leaves[3])
    calls = recording_grad_logits(monkeypatch)
    assert largest_difference(
        grads_of(chunked_log_probs_and_entropy, loss_of, leaves[:3], leaves[3]), expected
    ) <= (TOLERANCE)
    assert calls == [used] * 4  # four chunks, each recomputed once, with the unused term's weight None


def test_only_the_inputs_that_require_grad_get_one() -> None:
    hidden, weight, bias, labels = formula_inputs()
    weight.requires_grad_(False)
    bias.requires_grad_(False)

    def loss_of(log_probs, entropy):
        return (log_probs + 0.3 * entropy).sum()

    expected = grads_of(whole, loss_of, (hidden, weight, bias), labels)
    assert largest_difference(
        grads_of(chunked_log_probs_and_entropy, loss_of, (hidden, weight, bias), labels), expected
    ) <= (TOLERANCE)
    log_probs, _ = chunked_log_probs_and_entropy(hidden.detach(), weight, bias, labels, 0.7, True, 3)
    assert log_probs.grad_fn is None  # nothing requires grad: the forward-only loop, no custom function


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_heads_compute_the_softmax_in_float32(dtype) -> None:
    """Outputs in float32 (as ``_tempered`` upcasts), gradients in the inputs' dtype, as close to the
    float64 values as the unchunked low-precision autograd is."""
    leaves = formula_inputs(tokens=40, hidden_size=16, vocab=50, seed=3, dtype=dtype)
    exact = tuple(None if leaf is None else leaf.detach().double().requires_grad_() for leaf in leaves[:3])
    scales = torch.randn(2, 40, generator=torch.Generator().manual_seed(1))

    def loss_of(log_probs, entropy):
        return (scales[0] * log_probs + scales[1] * entropy).sum()

    reference = grads_of(whole, loss_of, exact, leaves[3])
    unchunked = grads_of(whole, loss_of, leaves[:3], leaves[3])
    chunked = grads_of(chunked_log_probs_and_entropy, loss_of, leaves[:3], leaves[3], chunk_size=7)
    log_probs, entropy = chunked_log_probs_and_entropy(*leaves[:3], leaves[3], 0.7, True, 7)
    assert log_probs.dtype == entropy.dtype == torch.float32
    for index, grad in chunked.items():
        assert grad.dtype == dtype
        scale = float(reference[index].abs().max())
        error = float((grad.double() - reference[index]).abs().max()) / scale
        unchunked_error = float((unchunked[index].double() - reference[index]).abs().max()) / scale
        assert error <= 2 * unchunked_error, (index, error, unchunked_error)


def omits_the_entropy_in_its_term(logits, labels, temperature, log_normaliser, entropy, *weights):
    """A broken backward: ``dH/dz = -p log p``, without ``+ H``."""
    return ORIGINAL_GRAD_LOGITS(
        logits,
        labels,
        temperature,
        log_normaliser,
        None if entropy is None else torch.zeros_like(entropy),
        *weights,
    )


def forgets_the_temperature(logits, labels, temperature, *rest):
    """A broken backward: the gradient w.r.t. the tempered logits, not divided by the temperature."""
    return ORIGINAL_GRAD_LOGITS(logits, labels, temperature, *rest) * temperature


ORIGINAL_GRAD_LOGITS = logprob_module._grad_logits


@pytest.mark.parametrize("broken", [omits_the_entropy_in_its_term, forgets_the_temperature])
def test_the_formula_comparison_catches_a_wrong_backward(monkeypatch, broken) -> None:
    args = (10, 6, 17, 3, True, 0)
    expected = formula_outputs(whole, *args)
    assert largest_difference(formula_outputs(chunked_log_probs_and_entropy, *args), expected) <= TOLERANCE
    monkeypatch.setattr(logprob_module, "_grad_logits", broken)
    assert largest_difference(formula_outputs(chunked_log_probs_and_entropy, *args), expected) > 1e-2


# -- several labels per token and the top-k (GKD's candidates and teacher) --------------------------


def several_labels_outputs(chunker, tokens, vocab, labels_per_token, top_k, chunk_size, seed):
    """Log-probs of ``labels_per_token`` labels per token (duplicates drawn too), entropy, the top-k,
    and the gradients of a weighted sum of the log-probs and the entropy."""
    hidden, weight, bias, _ = formula_inputs(tokens=tokens, vocab=vocab, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(0, vocab, (tokens, labels_per_token), generator=generator)
    computed = chunker(
        hidden,
        weight,
        bias,
        labels,
        TEMPERATURE_VALUE,
        compute_entropy=True,
        top_k=top_k,
        chunk_size=chunk_size,
    )
    scales = torch.randn(tokens, labels_per_token + 1, generator=generator, dtype=torch.float64)
    loss = (scales[:, 1:] * computed.log_probs).sum() + (scales[:, 0] * computed.entropy).sum()
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    return {
        "log_probs": computed.log_probs.detach(),
        "entropy": computed.entropy.detach(),
        "top_k_log_probs": computed.top_k_log_probs,
        "top_k_ids": computed.top_k_ids.double(),
    } | {f"grad{i}": g for i, g in enumerate(grads)}


def log_softmax_formula(hidden, weight, bias, labels, temperature, *, compute_entropy, top_k, chunk_size):
    """The plain autograd formula: ``log_softmax`` of the whole logits, gathered and ``topk``-ed."""
    log_p = torch.log_softmax(F.linear(hidden, weight, bias) / temperature, dim=-1)
    top = log_p.detach().topk(top_k, dim=-1)
    return TokenLogProbs(log_p.gather(-1, labels), -(log_p.exp() * log_p).sum(-1), top.values, top.indices)


def scatters_the_first_label_only(logits, labels, temperature, log_normaliser, entropy, grad_lp, grad_h):
    """A broken backward: the gradient of a token's first label alone (one label per token, as before)."""
    first = None if grad_lp is None else grad_lp[:, :1]
    return ORIGINAL_GRAD_LOGITS(logits, labels[:, :1], temperature, log_normaliser, entropy, first, grad_h)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(min_value=1, max_value=20),
    chunk_size=st.integers(min_value=1, max_value=24),
    vocab=st.integers(min_value=2, max_value=30),
    labels_per_token=st.integers(min_value=1, max_value=6),
    data=st.data(),
)
def test_several_labels_per_token_and_the_top_k_give_the_log_softmax_formula(
    tokens, chunk_size, vocab, labels_per_token, data
) -> None:
    """Labels ``[tokens, m]`` (the sampled token and a teacher's top-k, say) gathered in one pass,
    chunked or whole, equal ``log_softmax(...).gather``, gradients included; the top-k equals
    ``log_softmax(...).topk`` (random float64 logits do not tie)."""
    top_k = data.draw(st.integers(min_value=1, max_value=vocab))
    args = (tokens, vocab, labels_per_token, top_k, chunk_size, data.draw(st.integers(0, 2**16)))
    expected = several_labels_outputs(log_softmax_formula, *args)
    assert largest_difference(several_labels_outputs(chunked_token_log_probs, *args), expected) <= TOLERANCE


def test_the_several_labels_comparison_catches_a_backward_that_keeps_one_label(monkeypatch) -> None:
    args = (10, 17, 4, 3, 3, 0)
    expected = several_labels_outputs(log_softmax_formula, *args)
    assert largest_difference(several_labels_outputs(chunked_token_log_probs, *args), expected) <= TOLERANCE
    monkeypatch.setattr(logprob_module, "_grad_logits", scatters_the_first_label_only)
    assert largest_difference(several_labels_outputs(chunked_token_log_probs, *args), expected) > 1e-2


@pytest.mark.parametrize("compute_entropy", [True, False], ids=["entropy", "log-probs"])
def test_the_custom_backward_of_several_labels_passes_gradcheck(compute_entropy) -> None:
    hidden, weight, bias, labels = formula_inputs()
    labels = torch.stack([labels, labels.flip(0), labels], dim=-1)  # a label twice per token too

    def outputs(hidden, weight, bias):  # 10 tokens in chunks of 3, the top-k alongside
        computed = chunked_token_log_probs(
            hidden, weight, bias, labels, 0.6, compute_entropy=compute_entropy, top_k=2, chunk_size=3
        )
        assert not computed.top_k_log_probs.requires_grad
        return (computed.log_probs, computed.entropy) if compute_entropy else computed.log_probs

    assert torch.autograd.gradcheck(outputs, (hidden, weight, bias))


def test_the_top_k_keeps_leading_dimensions_and_is_refused_beyond_the_vocabulary() -> None:
    hidden, weight = torch.randn(2, 5, 4), torch.randn(9, 4)
    labels = torch.randint(0, 9, (2, 5, 3))
    computed = chunked_token_log_probs(hidden, weight, None, labels, top_k=4, chunk_size=3)
    assert computed.log_probs.shape == (2, 5, 3) and computed.entropy is None
    assert computed.top_k_log_probs.shape == computed.top_k_ids.shape == (2, 5, 4)
    whole_logits = token_log_probs(F.linear(hidden, weight), labels, top_k=4)
    torch.testing.assert_close(computed.log_probs, whole_logits.log_probs)
    torch.testing.assert_close(computed.top_k_log_probs, whole_logits.top_k_log_probs)
    with pytest.raises(ValueError, match=r"top_k=10: must be between 0 and the vocabulary size 9"):
        chunked_token_log_probs(hidden, weight, None, labels, top_k=10, chunk_size=3)
    with pytest.raises(ValueError, match=r"labels of 1 dimensions for logits of 3"):
        token_log_probs(F.linear(hidden, weight), labels[0, 0])


# -- through the models, packed and padded ---------------------------------------------------------

MODEL_VARIANTS = [
    pytest.param(arch, tied, id=f"{arch}-{'tied' if tied else 'untied'}")
    for arch in ("qwen2", "llama")
    for tied in (False, True)
]
#: One token per chunk, a size that divides no response count, one chunk for everything.
CHUNK_SIZES = (1, 3, 10_000)


def tiny_model(config, packing: bool) -> torch.nn.Module:
    """A seeded float64 causal LM from ``config``, attention as ``load_hf_model`` picks it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float64, attn_implementation=attn_implementation_for("sdpa", packing)
        )
    return model.train()


def model_config(arch: str, tied: bool):
    config = TinyModelSpec(arch=arch).hf_config()
    config.tie_word_embeddings = tied
    return config


def micro_batch(samples=None):
    batch = collate(make_samples(seed=5, share_prompts=True)[:6] if samples is None else samples)
    batch.set_non_tensor(TEMPERATURE, TEMPERATURE_VALUE)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    return batch


def model_outputs(model, batch, packing: bool, chunk_size: int | None) -> dict[str, torch.Tensor]:
    """Log-probs, entropy and the gradient of a weighted sum of both w.r.t. every parameter."""
    model.zero_grad()
    outputs = forward_micro_batch(model, batch, "lm", packing=packing, logits_chunk_size=chunk_size)
    scales = torch.linspace(-1.0, 1.0, outputs[LOG_PROBS].numel(), dtype=torch.float64).view_as(
        outputs[LOG_PROBS]
    )
    (scales * outputs[LOG_PROBS] + scales.flip(0) * outputs[ENTROPY]).sum().backward()
    grads = {
        name: torch.zeros_like(param) if param.grad is None else param.grad.clone()
        for name, param in model.named_parameters()
    }
    return {LOG_PROBS: outputs[LOG_PROBS].detach(), ENTROPY: outputs[ENTROPY].detach()} | grads


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize(("arch", "tied"), MODEL_VARIANTS)
def test_chunked_model_outputs_and_gradients_equal_the_whole(arch, tied, packing) -> None:
    model = tiny_model(model_config(arch, tied), packing)
    assert hf_module.plain_head_model(model) is model
    batch = micro_batch()
    expected = model_outputs(model, batch, packing, None)
    assert all(expected[name].abs().sum() > 0 for name, _ in model.named_parameters()), (
        "a parameter got no gradient"
    )
    for chunk_size in CHUNK_SIZES:
        difference = largest_difference(model_outputs(model, batch, packing, chunk_size), expected)
        assert difference <= TOLERANCE, f"logits_chunk_size={chunk_size}: {difference}"


@settings(max_examples=8, deadline=None)
@given(
    chunk_size=st.integers(min_value=1, max_value=50),
    rows=st.lists(st.integers(min_value=0, max_value=11), min_size=1, max_size=5, unique=True),
    packing=st.booleans(),
)
def test_any_chunk_size_and_batch_gives_the_whole(qwen2_models, chunk_size, rows, packing) -> None:
    samples = make_samples(seed=7)
    batch = micro_batch([samples[row] for row in rows])
    model = qwen2_models[packing]
    expected = model_outputs(model, batch, packing, None)
    assert largest_difference(model_outputs(model, batch, packing, chunk_size), expected) <= TOLERANCE


@pytest.fixture(scope="module")
def qwen2_models():
    return {packing: tiny_model(model_config("qwen2", False), packing) for packing in (False, True)}


@contextlib.contextmanager
def pre_norm_hidden_state(base_model):
    """A broken variant of ``_last_hidden_state``: the final norm's input, not its output."""
    caught = []
    handle = base_model.norm.register_forward_pre_hook(lambda _module, args: caught.append(args[0]))
    try:
        yield caught
    finally:
        handle.remove()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_the_model_comparison_catches_the_pre_norm_hidden_state(qwen2_models, monkeypatch, packing) -> None:
    model, batch = qwen2_models[packing], micro_batch()
    expected = model_outputs(model, batch, packing, None)
    monkeypatch.setattr(hf_module, "_last_hidden_state", pre_norm_hidden_state)
    assert largest_difference(model_outputs(model, batch, packing, 3), expected) > 1e-2


# -- models whose logits are not the plain head's --------------------------------------------------


def cohere_model():
    """Cohere multiplies the head's logits by ``logit_scale``: not ``lm_head(hidden)``."""
    spec = TinyModelSpec()
    config = CohereConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        logit_scale=0.25,
        pad_token_id=0,
    )
    return tiny_model(config, packing=False)


def test_a_model_that_scales_its_logits_runs_whole_and_keeps_its_values(monkeypatch) -> None:
    model, batch = cohere_model(), micro_batch()
    assert hf_module.plain_head_model(model) is None
    expected = model_outputs(model, batch, False, None)
    assert largest_difference(model_outputs(model, batch, False, 3), expected) <= TOLERANCE
    # What the allow-list prevents: chunking it from the head's weight alone gives other values.
    monkeypatch.setattr(hf_module, "PLAIN_HEAD_MODEL_TYPES", hf_module.PLAIN_HEAD_MODEL_TYPES | {"cohere"})
    assert hf_module.plain_head_model(model) is model
    assert largest_difference(model_outputs(model, batch, False, 3), expected) > 1e-2


def test_a_subclass_that_overrides_forward_runs_whole() -> None:
    model = tiny_model(model_config("qwen2", False), packing=False)

    class Custom(type(model)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model.__class__ = Custom
    assert hf_module.plain_head_model(model) is None


def test_wrappers_are_looked_through() -> None:
    model = tiny_model(model_config("llama", False), packing=False)
    wrapper = torch.nn.Module()
    wrapper.module = model
    assert hf_module.unwrap_hf_model(wrapper) is model
    assert hf_module.unwrap_hf_model(torch.nn.Linear(2, 2)) is None


# -- memory: the whole logits never exist ------------------------------------------------------------


class LargestVocabularyTensor(TorchDispatchMode):
    """Records the most token rows any tensor ``[..., tokens, vocab]`` had, forward and backward.

    ``[hidden, vocab]`` tensors are the head's weight, transposed, and its gradient: not logits.
    """

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.weight_shape = (hidden, vocab)
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        vocab = self.weight_shape[1]
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if not isinstance(tensor, torch.Tensor) or not tensor.dim() or tensor.shape[-1] != vocab:
                continue
            if tuple(tensor.shape[-2:]) != self.weight_shape:
                self.rows = max(self.rows, tensor.numel() // vocab)
        return output


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("chunk_size", [None, 4], ids=["whole", "chunks of 4"])
def test_no_tensor_holds_the_logits_of_more_than_one_chunk(qwen2_models, packing, chunk_size) -> None:
    model, batch = qwen2_models[packing], micro_batch()
    predicted = int(batch["attention_mask"][:, -batch["responses"].shape[-1] :].sum())
    spy = LargestVocabularyTensor(TinyModelSpec().hidden_size, VOCAB_SIZE)
    with spy:
        model_outputs(model, batch, packing, chunk_size)
    if chunk_size is None:  # the spy sees the whole logits when they exist
        assert spy.rows >= predicted
    else:
        assert spy.rows == chunk_size, f"a tensor held {spy.rows} tokens' logits"


@pytest.mark.parametrize("chunk_size", [None, 4], ids=["whole", "chunks of 4"])
def test_backward_alone_holds_the_logits_of_one_chunk(qwen2_models, chunk_size) -> None:
    """The spy around ``.backward()`` only: the custom backward recomputes and differentiates one
    chunk's logits at a time."""
    model, batch = qwen2_models[True], micro_batch()
    predicted = int(batch["attention_mask"][:, -batch["responses"].shape[-1] :].sum())
    model.zero_grad()
    outputs = forward_micro_batch(model, batch, "lm", packing=True, logits_chunk_size=chunk_size)
    loss = (outputs[LOG_PROBS] - 0.5 * outputs[ENTROPY]).sum()
    spy = LargestVocabularyTensor(TinyModelSpec().hidden_size, VOCAB_SIZE)
    with spy:
        loss.backward()
    if chunk_size is None:  # the spy sees the whole logits' gradient when they exist
        assert spy.rows >= predicted
    else:
        assert spy.rows == chunk_size, f"a tensor held {spy.rows} tokens' logits"


# -- the option -------------------------------------------------------------------------------------


def test_the_option_is_positive_or_null() -> None:
    assert MicroBatchConfig().logits_chunk_size == 1024
    assert MicroBatchConfig(logits_chunk_size=None).logits_chunk_size is None
    with pytest.raises(InvalidValue, match=r"logits_chunk_size: must be > 0, got 0"):
        MicroBatchConfig(logits_chunk_size=0)
