"""The SFT trainer on the demo's tiny model: the batch it builds, its loss against a plain PyTorch
cross-entropy, the loss falling, exact resume, ``verl-core sft`` with an export an RL run starts from,
and two fsdp ranks under Ray."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.demo import build_small_demo, make_demo_module, run_overrides

from verl_core.config import load_config
from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from verl_core.data.dataset import SFTRow
from verl_core.data.sampler import EpochSampler
from verl_core.trainer import checkpoints
from verl_core.trainer.sft import SFT_LOSS_KEY, VAL_LOSS_KEY, SFTTrainer, sft_batch

torch.set_num_threads(1)

#: Validation pairs: an odd number, so that two ranks need the padded batch.
VAL_PAIRS = 7


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo with more SFT rows than the session's, and a validation file written next to them."""
    return build_small_demo(tmp_path_factory.mktemp("demo"), sft_size=64)


@pytest.fixture(scope="module")
def val_file(demo):
    """SFT pairs from the demo's validation prompts (disjoint from sft.jsonl)."""
    make_demo = make_demo_module()
    rows = make_demo.read_jsonl(demo.val)[:VAL_PAIRS]
    path = demo.root / "data" / "sft_val.jsonl"
    make_demo.write_jsonl(path, [{"prompt": row["prompt"], "response": row["ground_truth"]} for row in rows])
    return path


def sft_overrides(demo, val_file, tmp_path, **changes) -> list[str]:
    values = {
        "data.train_files": f"[{demo.sft}]",
        "data.val_files": f"[{val_file}]",
        "data.train_batch_size": 8,
        "actor.engine.optim.lr": 2e-3,
        "actor.engine.micro_batch.micro_batch_size": 3,  # 8 rows: micro-batches of 3, 3 and 2
        "trainer.total_training_steps": 3,
    } | changes
    return run_overrides(demo, tmp_path, **values)


def trainer_for(demo, val_file, tmp_path, **changes) -> SFTTrainer:
    config = load_config([], sft_overrides(demo, val_file, tmp_path, **changes))
    return SFTTrainer.from_config(config, show_progress=False)


def metrics_lines(tmp_path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines}


def reference_loss(model_path, rows: list[dict]) -> float:
    """The Hugging Face model's mean cross-entropy over the response tokens (eos appended) of
    ``rows``, teacher-forced, one right-padded batch: an independent, plain PyTorch computation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).eval()
    pairs = [
        (tokenizer.encode(row["prompt"]), [*tokenizer.encode(row["response"]), tokenizer.eos_token_id])
        for row in rows
    ]
    width = max(len(prompt) + len(response) for prompt, response in pairs)
    input_ids = torch.full((len(pairs), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros(len(pairs), width, dtype=torch.int64)
    labels = torch.full((len(pairs), width), -100)
    for row, (prompt, response) in enumerate(pairs):
        end = len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor(prompt + response)
        attention_mask[row, :end] = 1
        labels[row, len(prompt) : end] = torch.tensor(response)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    ).item()


def first_batch_rows(demo, trainer: SFTTrainer) -> list[dict]:
    """The rows of sft.jsonl the trainer's first step trains on."""
    data = trainer.config.data
    sampler = EpochSampler(
        len(trainer.train_data), data.train_batch_size, shuffle=data.shuffle, seed=data.seed
    )
    rows = make_demo_module().read_jsonl(demo.sft)
    return [rows[trainer.train_data.row_indices[i]] for i in sampler.next_batch().indices]


def test_the_batch_left_pads_prompts_and_right_pads_responses() -> None:
    rows = [SFTRow((5, 6, 7), (8, 1)), SFTRow((5,), (9, 9, 1))]
    batch = sft_batch(rows, pad_token_id=0)
    assert batch[INPUT_IDS].tolist() == [[5, 6, 7, 8, 1, 0], [0, 0, 5, 9, 9, 1]]
    assert batch[ATTENTION_MASK].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch[POSITION_IDS].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch[RESPONSES].tolist() == [[8, 1, 0], [9, 9, 1]]
    assert batch[RESPONSE_MASK].tolist() == [[1, 1, 0], [1, 1, 1]]
    # Filled up to a multiple of 4 with copies of the first row that count in no loss.
    padded = sft_batch(rows, pad_token_id=0, multiple_of=4)
    assert padded[INPUT_IDS].tolist()[2:] == [[5, 6, 7, 8, 1, 0]] * 2
    assert padded[RESPONSE_MASK].tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]


def test_the_first_loss_is_the_models_cross_entropy_on_the_responses(demo, val_file, tmp_path) -> None:
    trainer = trainer_for(demo, val_file, tmp_path, **{"data.val_batch_size": 3})
    # Validation in batches of 3, 3 and 1 pairs, each weighted by its tokens: the whole set's mean.
    val_rows = make_demo_module().read_jsonl(val_file)
    assert trainer.validate()[VAL_LOSS_KEY] == pytest.approx(reference_loss(demo.model, val_rows), rel=1e-5)
    expected = reference_loss(demo.model, first_batch_rows(demo, trainer))
    metrics = trainer.train_step()  # the loss of the forward pass before the optimiser step
    assert metrics[SFT_LOSS_KEY] == pytest.approx(expected, rel=1e-5)
    assert metrics["sft/grad_norm"] > 0 and metrics["sft/lr"] == pytest.approx(2e-3)
    assert metrics["perf/tokens_per_s"] > 0 and metrics["timing/update"] > 0


def test_the_loss_falls_over_a_few_dozen_steps(demo, val_file, tmp_path) -> None:
    trainer = trainer_for(
        demo, val_file, tmp_path, **{"trainer.total_training_steps": 48, "trainer.test_freq": 24}
    )
    trainer.fit()
    lines = metrics_lines(tmp_path)
    assert sorted(lines) == list(range(49))  # step 0: the validation before training
    losses = [lines[step][SFT_LOSS_KEY] for step in range(1, 49)]
    figures = f"sft/loss {losses[:4]} ... {losses[-4:]}"
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4]), figures
    assert lines[48][VAL_LOSS_KEY] < 0.8 * lines[0][VAL_LOSS_KEY], (lines[0], lines[48])
    assert lines[48]["training/epoch"] == 5.0  # 64 pairs, 8 per step: 8 steps an epoch
    assert VAL_LOSS_KEY in lines[24] and VAL_LOSS_KEY not in lines[23]


def test_resume_continues_bitwise_across_an_epoch_boundary(demo, val_file, tmp_path, monkeypatch) -> None:
    # 64 pairs, 16 a step: 4 steps an epoch; the checkpoint at step 4 resumes into the second epoch.
    changes = {
        "data.train_batch_size": 16,
        "trainer.total_training_steps": 6,
        "trainer.save_freq": 4,
        "trainer.test_freq": 3,
        "actor.engine.optim.lr_scheduler": "cosine",
        "actor.engine.optim.lr_warmup_steps": 2,
        "actor.engine.optim.total_steps": 6,
    }
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight = trainer_for(demo, val_file, straight_dir, **changes)
    straight.fit()
    expected = metrics_lines(straight_dir)

    trainer_for(demo, val_file, resumed_dir, **changes | {"trainer.total_training_steps": 4}).fit()
    assert [step for step, _ in checkpoints.complete_checkpoints(resumed_dir / "checkpoints")] == [4]
    resumed = trainer_for(demo, val_file, resumed_dir, **changes)
    ran, train_step = [], resumed.train_step
    monkeypatch.setattr(resumed, "train_step", lambda step: ran.append(step) or train_step(step))
    resumed.fit()
    assert ran == [5, 6]
    lines = metrics_lines(resumed_dir)
    assert sorted(lines) == list(range(7)) and lines[5]["training/epoch"] == 1.0
    for step in (5, 6):
        for key in (SFT_LOSS_KEY, "sft/grad_norm", "sft/lr", "response_length/mean"):
            assert lines[step][key] == expected[step][key], (step, key)  # bitwise
    assert lines[6][VAL_LOSS_KEY] == expected[6][VAL_LOSS_KEY]
    final_straight = dict(straight.actor.group.worker.policy.get_per_tensor_param())
    for name, tensor in resumed.actor.group.worker.policy.get_per_tensor_param():
        assert torch.equal(tensor, final_straight[name]), name


def test_verl_core_sft_exports_a_model_an_rl_run_starts_from(demo, val_file, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.cli import main
    from verl_core.trainer.rl import RLTrainer

    sft_dir = tmp_path / "sft"
    overrides = sft_overrides(
        demo,
        val_file,
        sft_dir,
        **{"trainer.test_freq": 2, "trainer.save_freq": 3, "trainer.save_hf_model": "true"},
    )
    assert main(["sft", *overrides]) == 0
    err = capsys.readouterr().err  # the end-of-run summary, with the files, is on stderr
    assert "curves:" in err and (sft_dir / "run" / "curves.png").is_file()
    assert (sft_dir / "checkpoints" / "global_step_3" / "actor").is_dir()

    export = sft_dir / "run" / "hf_model"
    assert {"tokenizer.json", "tokenizer_config.json"} <= {path.name for path in export.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    source = AutoTokenizer.from_pretrained(demo.model, local_files_only=True)
    assert tokenizer.encode("rev 3851=") == source.encode("rev 3851=")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (source.eos_token_id, source.pad_token_id)
    untrained = AutoModelForCausalLM.from_pretrained(demo.model, local_files_only=True)
    assert not torch.equal(model.lm_head.weight, untrained.lm_head.weight)

    rl_dir = tmp_path / "rl"
    rl_config = load_config(
        [],
        run_overrides(
            demo,
            rl_dir,
            **{"actor.engine.model.path": export, "trainer.total_training_steps": 1, "trainer.save_freq": 1},
        ),
    )
    rl = RLTrainer.from_config(rl_config, show_progress=False)
    exported = model.state_dict()
    for name, tensor in rl.actor.group.worker.policy.get_per_tensor_param():
        assert torch.equal(tensor, exported[name]), name  # the RL run starts from the SFT model
    assert rl.fit()["actor/grad_norm"] > 0

    # An SFT run pointed at the RL run's checkpoints refuses to resume from them.
    capsys.readouterr()
    wrong = overrides + [f"trainer.checkpoint_dir={rl_dir / 'checkpoints'}"]
    assert main(["sft", *wrong]) == 2  # refused before the SFT run starts
    assert "written by `verl-core train`): give this run its own checkpoint_dir" in capsys.readouterr().err


@pytest.mark.distributed
def test_sft_on_two_fsdp_ranks_under_ray(demo, val_file, tmp_path, ray_cluster) -> None:
    overrides = sft_overrides(
        demo,
        val_file,
        tmp_path,
        backend="fsdp",
        **{
            "trainer.workers": "ray",
            "trainer.world_size": 2,
            "trainer.total_training_steps": 2,
            "trainer.test_freq": 2,
            "trainer.save_freq": 2,
            "trainer.save_hf_model": "true",
        },
    )
    trainer = SFTTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        assert trainer.actor.dp_size == 2
        trainer.fit()
    finally:
        trainer.shutdown()
    lines = metrics_lines(tmp_path)
    assert sorted(lines) == [0, 1, 2]
    # Two ranks of 4 pairs each, in micro-batches of 2: the single-process loss all the same.
    assert lines[1][SFT_LOSS_KEY] == pytest.approx(
        reference_loss(demo.model, first_batch_rows(demo, trainer)), rel=1e-5
    )
    val_rows = make_demo_module().read_jsonl(val_file)
    assert lines[0][VAL_LOSS_KEY] == pytest.approx(
        reference_loss(demo.model, val_rows), rel=1e-5
    )  # 7 pairs, padded to 8
    assert (tmp_path / "checkpoints" / "global_step_2" / "actor").is_dir()
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()
