"""The plugin as a plugin (core's ``PluginContract``), its options and the layouts it refuses by key,
and the pieces of Ulysses that need no process group: the labels rolled before the split, the padding
segment, the sequence layout of attention, and which KV head each SP rank receives (the attention of
all SP ranks emulated in one process against plain per-sequence attention, at sp 2 and 4).

Everything here runs in one process; test_ulysses.py and test_conformance.py spawn ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from verl_core.config import EngineConfig, ModelConfig, structure
from verl_core.engine import build_engine
from verl_core.errors import ConfigError
from verl_core.plugins import Registry
from verl_core.testing import PluginContract, TinyModelSpec, save_tiny_models

from verl_ulysses import ulysses
from verl_ulysses.config import UlyssesConfig, check_layout

torch.set_num_threads(1)


class TestPlugin(PluginContract):
    distribution = "verl-ulysses"
    package = "verl_ulysses"
    entry_points = {"ulysses": "verl_ulysses.plugin"}
    options_examples = {"ulysses": {"sp_size": 4, "dp_replicate_size": 2, "param_dtype": "bfloat16"}}
    options_docs = {"ulysses": Path(__file__).parents[3] / "docs" / "backends" / "ulysses.md"}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.from_plugins(autoload=True)


# -- options and layouts ---------------------------------------------------------------------------


def test_option_errors_name_their_full_path(registry) -> None:
    data = {"backend": "ulysses", "model": {"path": "m"}, "ulysses": {"sp_sise": 2, "dp_replicate_size": 0}}
    with pytest.raises(ConfigError) as caught:
        structure(data, EngineConfig, "actor.engine", registry=registry)
    errors = dict(caught.value.errors)
    assert errors["actor.engine.ulysses.sp_sise"] == "unknown key (did you mean 'sp_size'?)"
    assert "must be" in errors["actor.engine.ulysses.dp_replicate_size"]


QWEN = {"num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize(
    ("options", "model", "world_size", "shape"),
    [
        ({"sp_size": 2}, QWEN, 2, (1, 1, 2)),
        ({"sp_size": 2}, QWEN, 4, (1, 2, 2)),
        ({"sp_size": 1}, QWEN, 2, (1, 2, 1)),
        ({"sp_size": 4}, QWEN, 8, (1, 2, 4)),  # 2 KV heads repeated for 4 SP ranks
        ({"sp_size": 2, "dp_replicate_size": 2}, QWEN, 8, (2, 2, 2)),
        ({"sp_size": 2, "dp_shard_size": 1, "dp_replicate_size": 2}, QWEN, 4, (2, 1, 2)),
    ],
)
def test_layouts_that_fit(options, model, world_size, shape) -> None:
    mesh = check_layout(UlyssesConfig(**options), model, world_size)
    assert (mesh.dp_replicate, mesh.dp_shard, mesh.sp) == shape and mesh.world_size == world_size


def test_layouts_that_cannot_work_are_refused_by_key_all_at_once() -> None:
    # 6 heads, 4 KV heads, sp 3: heads fine, KV neither divides nor is divided; 3 does not divide 4 ranks.
    with pytest.raises(ConfigError) as caught:
        check_layout(
            UlyssesConfig(sp_size=3), {"num_attention_heads": 6, "num_key_value_heads": 4}, 4, "a.e.u"
        )
    messages = [message for key, message in caught.value.errors if key == "a.e.u.sp_size"]
    assert len(messages) == 2
    assert "4 num_key_value_heads do not divide one another" in messages[0] and "[1, 2]" in messages[0]
    assert "does not divide the 4 ranks" in messages[1]
    with pytest.raises(ConfigError, match=r"engine\.ulysses\.sp_size: 3 does not divide the model's 4"):
        check_layout(UlyssesConfig(sp_size=3), QWEN, 3)
    with pytest.raises(ConfigError, match=r"engine\.ulysses\.dp_shard_size: .* = 6, but the job has 4 ranks"):
        check_layout(UlyssesConfig(sp_size=2, dp_shard_size=3), QWEN, 4)


def test_a_layout_the_model_or_the_job_cannot_take_is_refused_before_any_worker_starts(
    demo, tmp_path, capsys, monkeypatch
) -> None:
    """The model's config.json and trainer.world_size are known on the driver: `verl-core config` and
    `train` refuse the layout at its keys (on main, `config` passed it and `train` started the Ray
    workers, whose engines refused it)."""
    from fixtures.demo import run_overrides
    from verl_core.cli import main
    from verl_core.trainer import build

    monkeypatch.setattr(build, "build_roles", lambda *a, **k: pytest.fail("workers started"))
    # The demo's model has 4 attention heads and 2 KV heads; 3 SP ranks do not divide 4 ranks either.
    layout = {"actor.engine.ulysses.sp_size": 3, "trainer.workers": "ray", "trainer.world_size": 4}
    overrides = run_overrides(
        demo, tmp_path, backend="ulysses", **layout, **{"actor.engine.model.attn_implementation": "eager"}
    )
    for command in ("config", "train"):
        assert main([command, *overrides]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        sp_size = [
            line for line in err.splitlines() if line.strip().startswith("actor.engine.ulysses.sp_size:")
        ]
        assert len(sp_size) == 3, err
        assert "3 does not divide the model's 4 num_attention_heads" in sp_size[0]
        assert "2 num_key_value_heads do not divide one another" in sp_size[1]
        assert "does not divide the 4 ranks of the job" in sp_size[2]
        assert "  actor.engine.model.attn_implementation: 'eager': at sp_size > 1" in err
    # The same layout over 6 ranks at sp 2 fits; in process (one rank) sp 2 does not.
    fits = {**layout, "actor.engine.ulysses.sp_size": 2, "trainer.world_size": 6}
    assert main(["config", *run_overrides(demo, tmp_path, backend="ulysses", **fits)]) == 0
    capsys.readouterr()
    in_process = {**fits, "trainer.workers": "in_process"}
    assert main(["config", *run_overrides(demo, tmp_path, backend="ulysses", **in_process)]) == 2
    assert "does not divide the 1 ranks of the job" in capsys.readouterr().err


def engine_config(model_dir: str, **fields) -> EngineConfig:
    options = UlyssesConfig(**fields.pop("options", {}))
    return EngineConfig(
        backend="ulysses", model=ModelConfig(path=model_dir, **fields), options=options, device="cpu"
    )


def test_without_a_process_group_sp_and_mixed_precision_are_refused_by_key(registry, tmp_path) -> None:
    model = save_tiny_models(tmp_path).lm
    config = engine_config(
        model, attn_implementation="eager", options={"sp_size": 2, "param_dtype": "bfloat16"}
    )
    engine = build_engine(config, registry=registry)
    with pytest.raises(ConfigError) as caught:
        engine.initialize()
    errors = dict(caught.value.errors)
    assert "needs a torch.distributed process group" in errors["engine.ulysses.sp_size"]
    assert "Ulysses attention" in errors["engine.model.attn_implementation"]
    assert "needs an initialised torch.distributed" in errors["engine.ulysses.param_dtype"]
    assert engine.module is None and engine.mesh is None  # refused before anything was built


def test_a_single_process_runs_the_plain_model(registry, tmp_path) -> None:
    engine = build_engine(engine_config(save_tiny_models(tmp_path).lm), registry=registry)
    engine.initialize()
    assert engine.mesh is None and engine.model is engine.module and engine.is_output_rank
    assert (engine.dp_rank, engine.dp_size, engine.sp_size) == (0, 1, 1)


# -- the packed row, split ---------------------------------------------------------------------------


def split_all(lengths: list[int], sp_size: int) -> tuple[torch.Tensor, list[ulysses.SequenceShard]]:
    """A packed row of sequences of ``lengths`` (tokens 1, 2, 3, ...), every token but each sequence's
    last predicting the next, split for every SP rank."""
    total = sum(lengths)
    ids = torch.arange(1, total + 1)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ends = set((cu[1:] - 1).tolist())
    predicting = torch.tensor([i for i in range(total) if i not in ends], dtype=torch.long)
    return ids, [
        ulysses.shard_sequence(ids, positions, cu, predicting, None, sp_size, rank) for rank in range(sp_size)
    ]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), sp_size=st.sampled_from([2, 3, 4]))
def test_labels_are_rolled_on_the_whole_row_and_the_padding_is_a_sequence_of_its_own(
    lengths, sp_size
) -> None:
    ids, shards = split_all(lengths, sp_size)
    total = len(ids)
    padded = shards[0].total_length
    assert padded % sp_size == 0 and 0 <= padded - total < sp_size
    labels = torch.cat([s.labels for s in shards])
    positions = torch.cat([s.position_ids for s in shards])
    # Every token predicts the next one of the whole row, across shard boundaries.
    assert torch.equal(labels[: total - 1], ids[1:])
    assert torch.equal(positions[total:], torch.arange(padded - total))  # the padding restarts at 0
    predicted = torch.cat([s.predicting_local + rank * (padded // sp_size) for rank, s in enumerate(shards)])
    assert bool((predicted < total).all())  # padding predicts nothing
    assert torch.equal(labels[predicted], ids[predicted + 1])


def test_rolling_each_shard_instead_gets_the_boundary_wrong() -> None:
    ids, shards = split_all([3, 8, 4], 2)  # 15 tokens, padded to 16: the boundary at 8 is inside sequence 2
    broken = torch.cat([torch.roll(s.input_ids, -1) for s in shards])
    right = torch.cat([s.labels for s in shards])
    assert int(broken[7]) == int(ids[0]) != int(right[7]) == int(ids[8])  # shard 0's last token


def test_segment_layout_includes_the_padding_segment() -> None:
    rows, slots = ulysses.segment_layout(torch.tensor([0, 3, 5, 6], dtype=torch.int32))
    assert rows.tolist() == [[0, 1, 2], [3, 4, 0], [5, 0, 0]]
    assert slots.tolist() == [0, 1, 2, 3, 4, 6]


# -- attention across SP ranks, emulated --------------------------------------------------------------


def ulysses_attention_emulated(q, k, v, cu_seq_lens, sp_size, repeat=ulysses.repeat_kv_heads):
    """What the SP ranks compute together, in one process: each rank's ``[S/sp, H, D]`` shard, KV heads
    repeated, exchanged (rank r gets heads r H/sp.. of every shard: the all-to-all), attention over the
    whole sequence per rank, heads concatenated back."""
    rows, slots = ulysses.segment_layout(cu_seq_lens)
    length = q.shape[0] // sp_size
    shards = [slice(j * length, (j + 1) * length) for j in range(sp_size)]

    def exchanged(x: torch.Tensor, rank: int, repeated: bool = False) -> torch.Tensor:
        parts = [repeat(x[s], sp_size) if repeated else x[s] for s in shards]
        heads = parts[0].shape[1] // sp_size
        return torch.cat([p[:, rank * heads : (rank + 1) * heads] for p in parts])

    outputs = [
        ulysses.segment_attention(
            exchanged(q, rank), exchanged(k, rank, True), exchanged(v, rank, True), rows, slots
        )
        for rank in range(sp_size)
    ]
    return torch.cat(outputs, dim=1)


def per_sequence_attention(q, k, v, cu_seq_lens):
    """Plain causal attention of each sequence alone, all heads (GQA), as the model computes it."""
    outputs = []
    for start, end in zip(cu_seq_lens[:-1].tolist(), cu_seq_lens[1:].tolist(), strict=True):
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            is_causal=True,
            enable_gqa=True,
        )
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


LAYOUTS = [  # (heads, KV heads, sp): KV split, KV equal to sp, KV repeated 2x and 4x
    (4, 2, 2),
    (8, 4, 2),
    (4, 2, 4),
    (8, 2, 4),
    (4, 1, 4),
    (8, 4, 4),
]


@settings(max_examples=30, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4))
def test_every_sp_rank_attends_with_the_kv_head_of_its_query_heads(layout, lengths) -> None:
    heads, kv_heads, sp_size = layout
    total = sum(lengths)
    padding = -total % sp_size
    cu = torch.tensor([0, *torch.tensor(lengths + ([padding] if padding else [])).cumsum(0).tolist()])
    generator = torch.Generator().manual_seed(total * 31 + heads)
    q = torch.randn(total + padding, heads, 4, generator=generator)
    k = torch.randn(total + padding, kv_heads, 4, generator=generator)
    v = torch.randn(total + padding, kv_heads, 4, generator=generator)
    torch.testing.assert_close(
        ulysses_attention_emulated(q, k, v, cu, sp_size),
        per_sequence_attention(q, k, v, cu),
        atol=1e-6,
        rtol=0,
    )


def test_tiling_the_kv_heads_instead_of_repeating_each_in_place_is_caught() -> None:
    """With 2 KV heads for 4 SP ranks, rank 1's query heads use KV head 0; tiling gives it head 1."""
    heads, kv_heads, sp_size = 4, 2, 4
    cu = torch.tensor([0, 5, 8])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, n, 4, generator=generator) for n in (heads, kv_heads, kv_heads))
    expected = per_sequence_attention(q, k, v, cu)

    def tiled(x, sp):
        return x.repeat(1, sp // x.shape[1], 1)

    broken = ulysses_attention_emulated(q, k, v, cu, sp_size, repeat=tiled)
    assert (broken - expected).abs().max() > 0.1
    torch.testing.assert_close(ulysses_attention_emulated(q, k, v, cu, sp_size), expected, atol=1e-6, rtol=0)


def test_a_model_with_fewer_kv_heads_than_sp_is_accepted_and_one_whose_heads_do_not_split_is_not() -> None:
    one_kv = TinyModelSpec(num_key_value_heads=1).hf_config().to_dict()
    assert check_layout(UlyssesConfig(sp_size=2), one_kv, 2).sp == 2
    three_heads = {"num_attention_heads": 6, "num_key_value_heads": 3}
    with pytest.raises(ConfigError, match="do not divide one another"):
        check_layout(UlyssesConfig(sp_size=2), three_heads, 2)
