"""``LeanDecoder`` against the model's own forward pass (``HFDecoder``): the same logits at the
prefill and at every step, with left-padded prompts, rows dropped and repeated, for Qwen2 (QKV
biases) and Llama (tied embeddings, no biases); and the architectures it must refuse."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from verl_core.config.engine import ModelConfig
from verl_core.data.batch import left_pad
from verl_core.rollout import decoder as decoder_module
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.config import HFRolloutConfig
from verl_core.rollout.decoder import HFDecoder, LeanDecoder, Projection, decoder_for, packing_for
from verl_core.rollout.hf import HFRollout

torch.set_num_threads(1)

SHAPE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[3, 9, 17], [44], [8, 8, 8, 8, 8, 2], [10, 11]]


def qwen2(**changes) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, **HEADS, **changes)).eval()
    with torch.no_grad():  # Hugging Face starts biases at zero: a decoder that dropped them would pass
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(std=0.5)
    return model


def llama(**changes) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, **HEADS, tie_word_embeddings=True, **changes)).eval()


@pytest.fixture
def every_weight_packed(monkeypatch) -> None:
    """These tests' models are far below the size a packed copy pays for: pack them anyway."""
    monkeypatch.setattr(decoder_module, "PACKED_MIN_ELEMENTS", 0)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("build", [qwen2, llama], ids=["qwen2", "llama"])
def test_lean_logits_equal_the_models_own_forward_at_every_step(build, fuse, pack, monkeypatch) -> None:
    if pack:
        monkeypatch.setattr(decoder_module, "PACKED_MIN_ELEMENTS", 0)
    model = build()
    lean = LeanDecoder.for_model(model, fuse=fuse, pack=pack)
    assert lean is not None
    assert_same_logits(lean, HFDecoder(model), update_model=model)


needs_packed_bf16 = pytest.mark.skipif(
    packing_for(torch.empty(1, dtype=torch.bfloat16)) != "onednn",
    reason="this CPU's oneDNN has no bfloat16 products: the packed path is not used here",
)
needs_mkl = pytest.mark.skipif(
    packing_for(torch.empty(1)) != "mkl", reason="torch was built without MKL: float32 weights are not packed"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_only_weights_large_enough_to_pay_for_a_copy_are_packed(dtype) -> None:
    if packing_for(torch.empty(1, dtype=dtype)) is None:
        pytest.skip(f"this CPU's torch packs no {dtype} weights: nothing to observe")
    narrow = Projection.of([torch.nn.Linear(64, 64, dtype=dtype)], fuse=False, pack=True)
    side = int(decoder_module.PACKED_MIN_ELEMENTS**0.5) + 1
    wide = Projection.of([torch.nn.Linear(side, side, dtype=dtype)], fuse=False, pack=True)
    unasked = Projection.of([torch.nn.Linear(side, side, dtype=dtype)], fuse=False, pack=False)
    assert narrow.packing is None and unasked.packing is None
    assert wide.packing == packing_for(torch.empty(1, dtype=dtype))


@pytest.mark.usefixtures("every_weight_packed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_q_k_v_and_gate_up_are_fused_by_default_only_where_the_packed_copy_is_the_fused_one(dtype) -> None:
    lean = LeanDecoder.for_model(qwen2().to(dtype))
    qkv, _, gate_up, _ = lean.projections[0]
    onednn = qkv.packing == "onednn"
    assert qkv.fused is onednn and gate_up.fused is onednn
    assert not LeanDecoder.for_model(qwen2().to(dtype), fuse=False).projections[0][0].fused
    assert LeanDecoder.for_model(qwen2().to(dtype), fuse=True).projections[0][0].fused


@needs_mkl
@pytest.mark.usefixtures("every_weight_packed")
def test_float32_weights_packed_for_a_decoding_steps_rows_serve_fewer_rows_and_are_remade_for_more() -> None:
    model = qwen2()
    lean = LeanDecoder.for_model(model)
    qkv = lean.projections[0][0]
    assert qkv.packing == "mkl"
    seen = []
    original = Projection._mkl

    def recording(self, x, rows):
        outs = original(self, x, rows)
        if self is qkv:
            seen.append((x.numel() // x.shape[-1], self._packed_rows))
        return outs

    Projection._mkl = recording
    try:
        assert_same_logits(lean, HFDecoder(model), update_model=model)
    finally:
        Projection._mkl = original
    # (rows, packed for) at steps 0-4: 4 rows (the prefill's 4 x 6 tokens use the plain product); 4 rows,
    # repeated; after the weight update (remade); 3 rows padded up to 4; 1 row: the plain product.
    assert seen == [(4, 4), (4, 4), (4, 4), (4, 4), (3, 4)], seen


@needs_packed_bf16
@pytest.mark.usefixtures("every_weight_packed")
@pytest.mark.parametrize("build", [qwen2, llama], ids=["qwen2", "llama"])
def test_packed_bfloat16_logits_equal_the_models_own_bfloat16_forward(build) -> None:
    model = build().to(torch.bfloat16)
    lean = LeanDecoder.for_model(model)
    assert all(projection.packing == "onednn" for projection in (*lean.projections[0], lean.head))
    # Both round to bfloat16 at different points: a few units in its last place, as two bf16 kernels do.
    assert_same_logits(lean, HFDecoder(model), update_model=model, tolerance=3e-2)


class StaleProjection(Projection):
    """Makes its copy of the weights once and keeps it: blind to weight updates."""

    def _refresh(self) -> None:
        if not self._products:
            self._rebuild()


def test_the_comparison_catches_fused_weights_that_miss_an_update(monkeypatch) -> None:
    model = qwen2()
    monkeypatch.setattr(
        Projection, "of", classmethod(lambda cls, linears, fuse, pack: StaleProjection(linears, True, None))
    )
    lean = LeanDecoder.for_model(model)
    assert isinstance(lean.head, StaleProjection)
    with pytest.raises(AssertionError, match="step 3"):
        assert_same_logits(lean, HFDecoder(model), update_model=model)


class ReorderingDecoder(LeanDecoder):
    """Keeps the cache rows it is asked for in the wrong order."""

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows.flip(0))


def test_the_comparison_catches_a_decoder_without_rotary_positions_or_with_misordered_rows(
    monkeypatch,
) -> None:
    model = qwen2()
    with pytest.raises(AssertionError):
        assert_same_logits(ReorderingDecoder(model), HFDecoder(model))
    monkeypatch.setattr("verl_core.rollout.decoder._rotate", lambda x, cos, sin: x)
    with pytest.raises(AssertionError):
        assert_same_logits(LeanDecoder(model), HFDecoder(model))


@torch.no_grad()
def assert_same_logits(lean, reference, update_model=None, tolerance: float = 1e-5) -> None:
    """Prefill, then six steps with rows dropped and repeated after the second: the same logits.
    With ``update_model``, every weight of it changes in place before step 3, as a weight update
    writes them: both decoders must compute with the new weights from then on."""
    ids, mask = left_pad(PROMPTS, 0)
    logits = [decoder.prefill(ids, mask, capacity=ids.shape[1] + 6) for decoder in (lean, reference)]
    torch.testing.assert_close(*logits, atol=tolerance, rtol=tolerance)
    positions = mask.sum(dim=-1)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        # Drop row 1 and repeat row 3, as finished rows and shared prefills do; then rows finish.
        rows = {2: torch.tensor([0, 2, 3, 3]), 4: torch.tensor([0, 1, 3]), 5: torch.tensor([2])}.get(step)
        if rows is not None:
            for decoder in (lean, reference):
                decoder.select(rows)
            positions = positions[rows]
        if step == 3 and update_model is not None:
            for parameter in update_model.parameters():
                parameter.mul_(1.5)
        tokens = torch.randint(1, SHAPE["vocab_size"], (len(positions),), generator=generator)
        logits = [decoder.step(tokens, positions) for decoder in (lean, reference)]
        torch.testing.assert_close(*logits, atol=tolerance, rtol=tolerance, msg=f"step {step}")
        positions = positions + 1


def test_the_cache_refuses_a_token_past_its_capacity() -> None:
    lean = LeanDecoder.for_model(qwen2())
    ids, mask = left_pad([[1, 2]], 0)
    with torch.no_grad():
        lean.prefill(ids, mask, capacity=3)
        lean.step(torch.tensor([4]), torch.tensor([2]))
        with pytest.raises(RuntimeError, match="no room"):
            lean.step(torch.tensor([5]), torch.tensor([3]))


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(
            lambda: GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)), id="gpt2"
        ),
        pytest.param(lambda: llama(mlp_bias=True), id="llama-mlp-bias"),
        pytest.param(
            lambda: qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0), id="qwen2-sliding"
        ),
        pytest.param(
            lambda: llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
            id="llama-dynamic-rope",
        ),
    ],
)
def test_architectures_it_does_not_cover_decode_with_the_models_forward(model) -> None:
    model = model()
    assert LeanDecoder.for_model(model) is None
    assert isinstance(decoder_for(model, lean=True), HFDecoder)


def test_the_rollout_samples_the_same_tokens_either_way(tmp_path) -> None:
    qwen2().save_pretrained(tmp_path)
    outputs = []
    for lean in (True, False):
        rollout = HFRollout(ModelConfig(path=str(tmp_path)), HFRolloutConfig(lean_decoder=lean))
        rollout.initialize()
        assert isinstance(rollout._decoder, LeanDecoder if lean else HFDecoder)
        sampling = SamplingParams(max_new_tokens=8, eos_token_ids=(5,), pad_token_id=0, temperature=1.0)
        outputs.append(rollout.generate(PROMPTS * 2, sampling, seed=7))
    lean_output, hf_output = outputs
    assert torch.equal(lean_output["responses"], hf_output["responses"])
    torch.testing.assert_close(
        lean_output["rollout_log_probs"], hf_output["rollout_log_probs"], atol=1e-5, rtol=0
    )


@pytest.mark.usefixtures("every_weight_packed")
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_a_rollout_frees_its_cache_and_weight_copies_between_generations(tmp_path, lean) -> None:
    qwen2().save_pretrained(tmp_path)
    sampling = SamplingParams(max_new_tokens=6, eos_token_ids=(5,), pad_token_id=0, temperature=1.0)
    rollout = HFRollout(ModelConfig(path=str(tmp_path)), HFRolloutConfig(lean_decoder=lean))
    rollout.initialize()
    first = rollout.generate(PROMPTS, sampling, seed=3)
    decoder = rollout._decoder
    if lean:
        assert decoder.keys == [] and decoder.values == [] and decoder.key_mask.numel() == 0
        projections = [*(p for layer in decoder.projections for p in layer), decoder.head]
        assert all(p._products == [] and p._packed == [] for p in projections if p.copies)
    else:
        assert decoder.cache.get_seq_length() == 0 and decoder.attention_mask.numel() == 0
    # Freed, then rebuilt: the next generation (after a weight update) is a fresh rollout's.
    with torch.no_grad():
        for parameter in rollout.model.parameters():
            parameter.mul_(1.5)
    fresh = HFRollout(ModelConfig(path=str(tmp_path)), HFRolloutConfig(lean_decoder=lean))
    fresh.initialize()
    fresh.update_weights(rollout.model.state_dict().items())
    again = rollout.generate(PROMPTS, sampling, seed=3)
    expected = fresh.generate(PROMPTS, sampling, seed=3)
    assert torch.equal(again["responses"], expected["responses"])
    assert not torch.equal(again["responses"], first["responses"])
