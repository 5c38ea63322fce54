"""``LeanDecoder`` against the model's own forward pass (``HFDecoder``): the same logits at the
prefill and at every step, with left-padded prompts, rows dropped and repeated, for Qwen2 (QKV
biases) and Llama (tied embeddings, no biases), on every path (dtype x weight layout x fused or
separate) forced in turn, each shown to fail when its products are broken; a path this machine cannot
run is skipped, saying why. The paths ``auto`` chooses from the CPU's capabilities, the rollout's
options that select one, the architectures it must refuse, and (marked ``gpu``) the same on CUDA."""

from __future__ import annotations

import re

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
from verl_core.config.loading import load_config
from verl_core.data.batch import left_pad
from verl_core.errors import ConfigError, ConfigWarning
from verl_core.rollout import decoder as decoder_module
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.config import HFRolloutConfig
from verl_core.rollout.decoder import (
    DecoderPath,
    HFDecoder,
    LeanDecoder,
    Projection,
    decoder_for,
    decoder_paths,
    default_packing,
    packing_problem,
)
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


#: How far the decoder's logits may be from the model's own forward, per dtype: float32 to float
#: rounding; bfloat16 and float16 round at different points than the model's kernels do (a few units
#: in their last place of logits of order 1).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
#: Each layout's product, as the decoder module calls it, and where the bias is among its arguments.
KERNELS = {"plain": ("_plain_linear", 2), "mkl": ("_mkl_linear", 3), "onednn": ("_onednn_linear", 2)}


def runnable(path: DecoderPath) -> DecoderPath:
    """``path``, or a skip saying why this machine cannot compute it."""
    problem = packing_problem(path.packing, path.dtype, "cpu")
    if problem:
        pytest.skip(f"{path} cannot run here: {problem}")
    return path


def forced(build, path: DecoderPath, device: str = "cpu") -> tuple[torch.nn.Module, LeanDecoder]:
    """The model ``build`` makes, in ``path``'s dtype on ``device``, and a decoder forced onto ``path``."""
    model = build().to(device=device, dtype=path.dtype)
    lean = LeanDecoder.for_model(model, packing=path.packing, fuse=path.fused)
    assert lean is not None and lean.path == path
    return model, lean


def projections(lean: LeanDecoder) -> list[Projection]:
    return [*(p for layer in lean.projections for p in layer), lean.head]


@pytest.mark.parametrize("path", decoder_paths(), ids=str)
@pytest.mark.parametrize("build", [qwen2, llama], ids=["qwen2", "llama"])
def test_every_path_forced_computes_the_models_own_logits(build, path) -> None:
    model, lean = forced(build, runnable(path))
    # Forced, the path is every weight's, whatever its size.
    assert {p.packing for p in projections(lean)} == {path.packing}
    assert {p.fused for p in projections(lean) if len(p.linears) > 1} == {path.fused}
    assert_same_logits(lean, HFDecoder(model), update_model=model, tolerance=TOLERANCE[path.dtype])


def without_bias(kernel, position: int):
    def product(*args):
        return kernel(*args[:position], None, *args[position + 1 :])

    return product


@pytest.mark.parametrize("path", decoder_paths(), ids=str)
def test_the_comparison_catches_each_path_dropping_its_bias(path, monkeypatch) -> None:
    """The broken variant of every path: its layout's product without Qwen2's q/k/v biases. Caught at
    the prefill, or with MKL at the first decoding step (prefills are plain products): the forced
    path's own products compute the logits the comparison checks."""
    model, lean = forced(qwen2, runnable(path))
    name, position = KERNELS[path.packing]
    monkeypatch.setattr(decoder_module, name, without_bias(getattr(decoder_module, name), position))
    with pytest.raises(AssertionError, match="step 0" if path.packing == "mkl" else "prefill"):
        assert_same_logits(lean, HFDecoder(model), tolerance=TOLERANCE[path.dtype])


@pytest.mark.parametrize("path", [path for path in decoder_paths() if path.fused], ids=str)
def test_the_comparison_catches_each_fused_path_with_its_weights_misordered(path, monkeypatch) -> None:
    """Fused q/k/v and gate/up side by side in the wrong order (v, k, q; up, gate) are caught."""
    model, lean = forced(llama, runnable(path))
    fuse = decoder_module._fused_weight
    monkeypatch.setattr(decoder_module, "_fused_weight", lambda linears: fuse(linears[::-1]))
    with pytest.raises(AssertionError, match="prefill"):
        assert_same_logits(lean, HFDecoder(model), tolerance=TOLERANCE[path.dtype])


def test_auto_chooses_the_layout_torch_reports_this_cpu_computes() -> None:
    """On this CPU, whatever it is: MKL for float32 where torch has it on an Intel CPU, oneDNN for
    float32 elsewhere and for bfloat16 and float16 where torch's oneDNN supports them here, else the
    weights as they are; on a GPU always plain."""
    intel = "intel" in torch.cpu.get_capabilities()["cpu_name"].lower()
    mkl = torch.backends.mkl.is_available() and intel
    onednn = torch.backends.mkldnn.is_available()
    assert default_packing(torch.float32) == ("mkl" if mkl else "onednn" if onednn else "plain")
    for dtype, supported in (
        (torch.bfloat16, torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        (torch.float16, torch.ops.mkldnn._is_mkldnn_fp16_supported()),
    ):
        assert default_packing(dtype) == ("onednn" if supported else "plain"), dtype
    assert {default_packing(dtype, "cuda") for dtype in decoder_module.DTYPES} == {"plain"}


@pytest.mark.parametrize(
    ("cpu_name", "packing"), [("Intel(R) Xeon(R) Platinum 8488C", "mkl"), ("AMD EPYC 9R14", "onednn")]
)
def test_float32_weights_take_mkls_layout_on_intel_cpus_and_onednns_elsewhere(
    monkeypatch, cpu_name, packing
) -> None:
    """MKL's packed kernels are Intel's: elsewhere its packed layout decoded slower than plain products,
    and oneDNN's (which picks its kernels by instruction set, not vendor) twice as fast."""
    if not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()):
        pytest.skip(
            f"this torch ({torch.__version__}) lacks MKL or oneDNN: float32 has one packed layout at most"
        )
    capabilities = torch.cpu.get_capabilities() | {"cpu_name": cpu_name}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert default_packing(torch.float32) == packing
    assert LeanDecoder.for_model(qwen2()).path.packing == packing
    assert packing_problem("mkl", torch.float32) is None  # forcing it stays possible on either


@pytest.fixture
def avx2_only_cpu(monkeypatch) -> None:
    """This process sees a CPU with AVX2 only (as an AMD EPYC of the project's has): torch's oneDNN
    reports no bfloat16 or float16 kernels."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    capabilities = {"cpu_name": "AMD EPYC 7B12", "architecture": "x86_64", "avx2": True, "avx512_f": False}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)


@pytest.mark.usefixtures("avx2_only_cpu", "every_weight_packed")
def test_on_a_cpu_without_half_precision_kernels_auto_decodes_plainly_and_forcing_onednn_says_why() -> None:
    model = qwen2().to(torch.bfloat16)
    lean = LeanDecoder.for_model(model)
    assert lean.path == DecoderPath(torch.bfloat16, "plain", False)
    assert {p.packing for p in projections(lean)} == {"plain"}
    assert_same_logits(lean, HFDecoder(model), tolerance=TOLERANCE[torch.bfloat16])
    with pytest.raises(ValueError) as raised:
        LeanDecoder.for_model(model, packing="onednn")
    assert str(raised.value) == (
        "LeanDecoder(packing='onednn'): this CPU's oneDNN has no bfloat16 kernels (on x86 it needs AVX-512, with "
        "AVX512-BF16 or AMX to be fast, or AVX2-VNNI-2); torch reports AMD EPYC 7B12: avx2 (no avx512_f, "
        "avx512_bf16, avx512_fp16, avx_ne_convert, amx_bf16, amx_fp16): use plain or auto"
    )


@pytest.mark.parametrize(
    ("packing", "dtype", "device", "expected"),
    [
        ("mkl", torch.bfloat16, "cpu", "mkl lays out float32 weights, and these are bfloat16: use onednn, plain or auto"),
        ("mkl", torch.float16, "cpu", "mkl lays out float32 weights, and these are float16: use onednn, plain or auto"),
        ("onednn", torch.bfloat16, "cuda", "onednn lays out weights for a CPU's kernels, and these are on cuda: use plain or auto (a GPU's kernels read the weights as they are)"),
        ("packed", torch.float32, "cpu", "'packed' is not a weight layout: use auto, plain, mkl, onednn"),
    ],
)  # fmt: skip
def test_a_path_no_machine_can_run_is_refused_saying_why(packing, dtype, device, expected) -> None:
    assert packing_problem(packing, dtype, device) == expected
    if device == "cpu":
        with pytest.raises(ValueError, match=re.escape(expected)):
            LeanDecoder(qwen2().to(dtype), packing=packing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_auto_packs_only_weights_large_enough_to_pay_for_a_copy(dtype) -> None:
    packing = default_packing(dtype)
    if packing == "plain":
        layout = {torch.float32: "mkl", torch.bfloat16: "onednn"}[dtype]
        pytest.skip(f"this CPU's torch packs no {dtype} weights: {packing_problem(layout, dtype)}")
    narrow = Projection.of(
        [torch.nn.Linear(64, 64, dtype=dtype)], packing, None, decoder_module.PACKED_MIN_ELEMENTS
    )
    side = int(decoder_module.PACKED_MIN_ELEMENTS**0.5) + 1
    wide = Projection.of(
        [torch.nn.Linear(side, side, dtype=dtype)], packing, None, decoder_module.PACKED_MIN_ELEMENTS
    )
    assert narrow.packing == "plain" and wide.packing == packing
    lean = LeanDecoder.for_model(qwen2().to(dtype))  # every weight narrow
    assert lean.path.packing == packing and {p.packing for p in projections(lean)} == {"plain"}


@pytest.mark.usefixtures("every_weight_packed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_q_k_v_and_gate_up_are_fused_by_default_only_where_the_packed_copy_is_the_fused_one(dtype) -> None:
    lean = LeanDecoder.for_model(qwen2().to(dtype))
    qkv, _, gate_up, _ = lean.projections[0]
    onednn = qkv.packing == "onednn"
    assert qkv.fused is onednn and gate_up.fused is onednn and lean.path.fused is onednn
    assert not LeanDecoder.for_model(qwen2().to(dtype), fuse=False).projections[0][0].fused
    assert LeanDecoder.for_model(qwen2().to(dtype), fuse=True).projections[0][0].fused


#: 16 rows; after two steps a quarter of them (the copy is remade for 4), then 3 (padded up to 4),
#: then 1 (a plain product).
MANY_PROMPTS = PROMPTS * 4
QUARTER = {2: torch.tensor([0, 5, 10, 15]), 4: torch.tensor([0, 1, 3]), 5: torch.tensor([2])}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_mkl_copies_serve_fewer_rows_padded_and_are_remade_for_a_quarter_as_many_or_more(
    fused, monkeypatch
) -> None:
    path = runnable(DecoderPath(torch.float32, "mkl", fused))
    model, lean = forced(qwen2, path)
    qkv = lean.projections[0][0]
    served, fallbacks = [], []
    original, product = Projection._mkl, decoder_module._mkl_linear

    def recording(self, x, rows):
        outs = original(self, x, rows)
        if self is qkv:
            served.append((rows, self._packed_rows))
        return outs

    def product_from_the_copy_only(x, packed, weight, bias, rows):
        # MKL reads the plain weight only where it cannot use the copy (other rows than it was made
        # for): with a zero weight in its place, the product must not change.
        out = product(x, packed, weight, bias, rows)
        if not torch.equal(out, product(x, packed, torch.zeros_like(weight), bias, rows)):
            fallbacks.append((x.shape[0], rows))
        return out

    monkeypatch.setattr(Projection, "_mkl", recording)
    monkeypatch.setattr(decoder_module, "_mkl_linear", product_from_the_copy_only)
    assert_same_logits(lean, HFDecoder(model), update_model=model, prompts=MANY_PROMPTS, selections=QUARTER)
    # (rows, packed for) at steps 0-4: 16 rows twice; 4 rows (remade for them); after the weight
    # update (remade); 3 rows padded up to 4. Step 5's one row, and the prefill, are plain products.
    assert served == [(16, 16), (16, 16), (4, 4), (4, 4), (3, 4)], served
    assert not fallbacks, f"MKL computed from the plain weight, not the packed copy: {fallbacks}"


def test_mkl_products_told_other_rows_than_their_copys_are_caught(monkeypatch) -> None:
    """The broken variant: MKL's products told another row count than their copy was made for (as
    when the rows before padding are passed). The logits stay right, MKL silently computing from the
    plain weight instead, so only the check that the copy computes them catches it."""
    product = decoder_module._mkl_linear
    monkeypatch.setattr(
        decoder_module, "_mkl_linear", lambda x, packed, w, b, rows: product(x, packed, w, b, rows + 1)
    )
    with pytest.raises(AssertionError, match="not the packed copy"):
        test_mkl_copies_serve_fewer_rows_padded_and_are_remade_for_a_quarter_as_many_or_more(
            False, monkeypatch
        )


class StaleProjection(Projection):
    """Makes its copy of the weights once and keeps it: blind to weight updates."""

    def _refresh(self) -> None:
        if not self._products:
            self._rebuild()


def test_the_comparison_catches_fused_weights_that_miss_an_update(monkeypatch) -> None:
    model = qwen2()
    monkeypatch.setattr(
        Projection, "of", classmethod(lambda cls, linears, *_: StaleProjection(linears, True, "plain"))
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


#: Which rows each decoding step keeps of ``PROMPTS``: drop row 1 and repeat row 3, as finished rows
#: and shared prefills do; then rows finish.
SELECTIONS = {2: torch.tensor([0, 2, 3, 3]), 4: torch.tensor([0, 1, 3]), 5: torch.tensor([2])}


@torch.no_grad()
def assert_same_logits(
    lean,
    reference,
    update_model=None,
    tolerance: float = 1e-5,
    prompts=PROMPTS,
    selections=SELECTIONS,
    device: str = "cpu",
) -> None:
    """Prefill, then six steps with the rows of ``selections`` kept: the same logits. With
    ``update_model``, every weight of it changes in place before step 3, as a weight update writes
    them: both decoders must compute with the new weights from then on."""
    ids, mask = (tensor.to(device) for tensor in left_pad(prompts, 0))
    logits = [decoder.prefill(ids, mask, capacity=ids.shape[1] + 6) for decoder in (lean, reference)]
    torch.testing.assert_close(*logits, atol=tolerance, rtol=tolerance, msg=lambda text: f"prefill: {text}")
    positions = mask.sum(dim=-1)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        rows = selections.get(step)
        if rows is not None:
            rows = rows.to(device)
            for decoder in (lean, reference):
                decoder.select(rows)
            positions = positions[rows]
        if step == 3 and update_model is not None:
            for parameter in update_model.parameters():
                parameter.mul_(1.5)
        tokens = torch.randint(1, SHAPE["vocab_size"], (len(positions),), generator=generator).to(device)
        logits = [decoder.step(tokens, positions) for decoder in (lean, reference)]
        torch.testing.assert_close(
            *logits, atol=tolerance, rtol=tolerance, msg=lambda text, step=step: f"step {step}: {text}"
        )
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


ROLLOUT_SAMPLING = SamplingParams(max_new_tokens=8, eos_token_ids=(5,), pad_token_id=0, temperature=1.0)


def rollout_output(path, device: str = "cpu", **options) -> tuple[HFRollout, dict]:
    rollout = HFRollout(ModelConfig(path=str(path)), HFRolloutConfig(**options), device=device)
    rollout.initialize()
    return rollout, rollout.generate(PROMPTS * 2, ROLLOUT_SAMPLING, seed=7)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    qwen2().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_output(qwen2_dir) -> dict:
    """What the rollout samples with the model's own forward."""
    rollout, output = rollout_output(qwen2_dir, lean_decoder=False)
    assert isinstance(rollout._decoder, HFDecoder)
    return output


@pytest.mark.parametrize(
    ("weight_packing", "fused_projections"),
    [("auto", "auto"), ("plain", False), ("plain", True), ("mkl", False), ("mkl", True), ("onednn", "auto")],
)
def test_the_rollout_samples_the_same_tokens_on_the_path_its_options_choose(
    qwen2_dir, hf_output, weight_packing, fused_projections
) -> None:
    if weight_packing != "auto":
        fused_projections = weight_packing == "onednn" if fused_projections == "auto" else fused_projections
        runnable(DecoderPath(torch.float32, weight_packing, fused_projections))
    options = {"weight_packing": weight_packing, "fused_projections": fused_projections}
    lean, lean_output = rollout_output(qwen2_dir, **options)
    if weight_packing == "auto":  # the path of weights large enough to pack (these tiny ones stay plain)
        packing = default_packing(torch.float32)
        assert lean._decoder.path == DecoderPath(torch.float32, packing, packing == "onednn")
    else:
        assert lean._decoder.path == DecoderPath(torch.float32, weight_packing, fused_projections)
    assert torch.equal(lean_output["responses"], hf_output["responses"])
    torch.testing.assert_close(
        lean_output["rollout_log_probs"], hf_output["rollout_log_probs"], atol=1e-5, rtol=0
    )


@pytest.mark.usefixtures("avx2_only_cpu")
def test_a_layout_the_rollouts_cpu_cannot_compute_is_refused_at_its_key_before_the_model_loads(
    qwen2_dir,
) -> None:
    rollout = HFRollout(
        ModelConfig(path=str(qwen2_dir), dtype="bfloat16"), HFRolloutConfig(weight_packing="onednn")
    )
    with pytest.raises(ConfigError) as raised:
        rollout.initialize()
    ((key, message),) = raised.value.errors
    assert key == "rollout.hf.weight_packing" and "no bfloat16 kernels" in message, message
    assert rollout.model is None


RL_OVERRIDES = [
    "actor.engine.backend=ddp",
    "actor.engine.model.path=/models/tiny",
    "actor.ppo_mini_batch_size=4",
    "algorithm.adv_estimator=grpo",
    "rollout.n=2",
    "data.train_batch_size=8",
]


def test_a_layout_that_does_not_serve_the_rollouts_dtype_is_refused_when_the_config_loads() -> None:
    with pytest.raises(ConfigError) as raised:
        load_config([], [*RL_OVERRIDES, "rollout.dtype=bfloat16", "rollout.hf.weight_packing=mkl"])
    assert raised.value.errors == [
        (
            "rollout.hf.weight_packing",
            "mkl lays out float32 weights, and these are bfloat16 (rollout.dtype): use onednn, plain or auto "
            "(from override 'rollout.hf.weight_packing=mkl')",
        )
    ]
    config = load_config(
        [], [*RL_OVERRIDES, "rollout.hf.weight_packing=mkl", "rollout.hf.fused_projections=true"]
    )
    assert (config.rollout.options.weight_packing, config.rollout.options.fused_projections) == ("mkl", True)


def test_a_path_chosen_without_the_lean_decoder_is_reported_as_ignored() -> None:
    with pytest.warns(ConfigWarning, match=r"^rollout\.hf\.weight_packing: ignored: lean_decoder is false"):
        load_config([], [*RL_OVERRIDES, "rollout.hf.lean_decoder=false", "rollout.hf.weight_packing=plain"])


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


# -- on a GPU ---------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the GPU path runs on a GPU"
)
#: On a GPU the products read the weights as they are (``auto`` is plain): the plain paths, each dtype.
GPU_PATHS = [path for path in decoder_paths() if path.packing == "plain"]
#: Both sides' CUDA kernels (SDPA, products) may reduce in other orders than on the CPU.
GPU_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", GPU_PATHS, ids=str)
@pytest.mark.parametrize("build", [qwen2, llama], ids=["qwen2", "llama"])
def test_on_cuda_every_path_computes_the_models_own_logits(build, path) -> None:
    model, lean = forced(build, path, device="cuda")
    assert LeanDecoder.for_model(model).path == DecoderPath(path.dtype, "plain", False)  # auto, on a GPU
    tolerance = GPU_TOLERANCE[path.dtype]
    assert_same_logits(lean, HFDecoder(model), update_model=model, tolerance=tolerance, device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_the_comparison_catches_products_that_drop_the_bias(monkeypatch) -> None:
    model, lean = forced(qwen2, DecoderPath(torch.float32, "plain", False), device="cuda")
    monkeypatch.setattr(decoder_module, "_plain_linear", without_bias(decoder_module._plain_linear, 2))
    with pytest.raises(AssertionError, match="prefill"):
        assert_same_logits(lean, HFDecoder(model), tolerance=GPU_TOLERANCE[torch.float32], device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_the_rollout_samples_the_same_tokens_either_way(tmp_path) -> None:
    qwen2().save_pretrained(tmp_path)
    lean, lean_output = rollout_output(tmp_path, device="cuda")
    assert isinstance(lean._decoder, LeanDecoder) and lean._decoder.path.packing == "plain"
    _, hf_output = rollout_output(tmp_path, device="cuda", lean_decoder=False)
    assert torch.equal(lean_output["responses"], hf_output["responses"])
    torch.testing.assert_close(
        lean_output["rollout_log_probs"], hf_output["rollout_log_probs"], atol=1e-4, rtol=0
    )
