"""Every shell command of the README, quickstart, training, sft, embedding and agents pages, run as written.

A command runs in a folder laid out as the page assumes: the demo's assets in ``runs/demo`` (built
small), and the files a page names as the user's own (``models/base``, ``data/sft.jsonl``, ``grpo.yaml``,
``my_reward.py``, ...) made from them. ``verl-core plugins``, ``config`` and ``plot`` run as they
stand; ``verl-core train`` and ``sft`` run as ``verl-core config --for train|sft`` with the same
arguments (every check a run makes before anything starts, without the minutes of training). What
cannot run here is reported as skipped with the reason: installs, downloads, a Ray cluster, and
placeholders the reader fills in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PAGES = [
    "README.md",
    "docs/quickstart.md",
    "docs/training.md",
    "docs/sft.md",
    "docs/embedding.md",
    "docs/tracking.md",
    "docs/agents.md",
]

#: Commands whose first words say they are not for this test, and why.
NOT_RUN = {
    "pip install": "installs packages (CI's own install step runs the same)",
    "python -m pip": "installs packages (CI's own install step runs the same)",
    "pip uninstall": "uninstalls packages (the vllm nox session runs the same after its install)",
    "python examples/demo/make_demo.py": "builds the demo's assets, which the workspace has "
    "(tests/test_demo_assets.py runs the script, --attention-heads and --kv-heads included)",
    "hf download": "downloads a model from the hub, which this machine cannot reach",
    "ray start": "starts a Ray cluster (tests/test_trainer_ray.py runs against a real `ray start --head`)",
    "python examples/embedding.py": "tests/test_embedding_example.py runs the example and checks its output",
    "python examples/tools_demo/make_tools_demo.py": "builds the tools demo's assets, which the workspace has "
    "(built small; tests/test_agents_demo.py runs the builder)",
    "python examples/openenv/echo_server.py": "starts a server that runs until it is stopped "
    "(tests/test_agents_openenv.py serves it, and trains against it)",
    "python examples/verifiers/export_dataset.py": "needs the verifiers extra, which the tests session "
    "lacks (tests/test_agents_verifiers.py runs it in the integrations session, and trains on its output)",
    "VERL_CORE_SERVE_TOKEN=tml-change-me verl-core serve": "starts a server that runs until it is stopped "
    "(tests/test_service_server.py serves the same config's kind, and trains against it)",
    "TINKER_BASE_URL=": "runs the tinker client, an integration package, against a running server "
    "(tests/test_service_server.py runs the page's my_tinker_loop.py against `verl-core serve`)",
}
#: Words a reader replaces before running the command.
PLACEHOLDERS = ("HEAD_IP", "run.yaml")


def shell_commands(page: str) -> list[str]:
    """The commands of ``page``'s bash blocks: continuation lines joined, comments dropped, each
    ``&&`` part on its own."""
    text = (REPO / page).read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands += [part.strip() for part in line.split("&&")]
    return commands


COMMANDS = [(page, command) for page in PAGES for command in shell_commands(page)]


def why_not_run(command: str) -> str | None:
    for prefix, reason in NOT_RUN.items():
        if command.startswith(prefix):
            return reason
    if command.startswith(("python -m nox", "nox")):
        return "runs a whole nox session (CI runs `nox`; the demo session is the README's main job)"
    if any(word in command for word in PLACEHOLDERS):
        return "holds a placeholder the reader fills in (a cluster's address, their own config)"
    for adapter, module in (("mcp", "mcp"), ("openenv", "openenv"), ("verifiers", "verifiers")):
        selects = f"rollout.agent.environment={adapter}" in command or f"examples/{adapter}/" in command
        if selects and importlib.util.find_spec(module) is None:
            return f'needs the {adapter} extra, which this environment lacks (pip install "verl-core[{adapter}]")'
    if "rollout.backend=vllm" in command and importlib.util.find_spec("vllm") is None:
        return (
            "needs vLLM, which this environment lacks (`nox -s vllm` runs `verl-core config` with "
            "rollout.backend=vllm: verl_vllm_plugin/tests/test_vllm_preflight.py)"
        )
    return None


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder laid out as the pages assume: the demo's assets, and the user's files made from them."""
    from fixtures.demo import build_small_demo

    root = tmp_path_factory.mktemp("docs-commands")
    demo = build_small_demo(root / "runs" / "demo")
    (root / "examples").symlink_to(REPO / "examples")
    for model in [
        "runs/demo/sft/hf_model",
        "runs/sft/hf_model",
        "models/base",
        "models/qwen2.5-0.5b-instruct",
    ]:
        (root / model).parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(demo.model, root / model)
    tools_demo = root / "runs" / "tools_demo"  # docs/agents.md's adapters train the tools demo's model
    make_tools_demo = importlib.util.spec_from_file_location(
        "make_tools_demo", REPO / "examples" / "tools_demo" / "make_tools_demo.py"
    )
    module = importlib.util.module_from_spec(make_tools_demo)
    make_tools_demo.loader.exec_module(module)
    module.build(tools_demo, sft_keys=4, train_keys=4, val_keys=4)
    data = root / "data"
    data.mkdir()
    for name, source in {
        "sft.jsonl": demo.sft,
        "sft_val.jsonl": demo.sft,
        "sft_train.jsonl": demo.sft,
        "train.jsonl": demo.train,
        "val.jsonl": demo.val,
    }.items():
        shutil.copy(source, data / name)
    # The user's own files, as the pages show them.
    (root / "grpo.yaml").write_text((REPO / "examples" / "grpo.yaml").read_text())
    sft_yaml = [block for block in yaml_blocks("docs/sft.md") if "models/base" in block]
    (root / "sft.yaml").write_text(sft_yaml[0])
    reward = [block for block in python_blocks("docs/quickstart.md") if block.startswith("# my_reward.py")]
    (root / "my_reward.py").write_text(reward[0])
    # A run's metrics for `verl-core plot`, in the logger's format.
    (root / "runs" / "grpo").mkdir(parents=True, exist_ok=True)
    records = [{"step": step, "reward/mean": 0.1 * step, "actor/loss": 1.0 / step} for step in (1, 2, 3)]
    (root / "runs" / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def yaml_blocks(page: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (REPO / page).read_text(), re.S)


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), re.S)


def as_run_here(command: str) -> list[str]:
    """The ``verl-core`` arguments to run: ``train|sft ARGS`` as ``config --for train|sft ARGS``."""
    words = shlex.split(command)
    assert words[0] == "verl-core", f"no rule for running {command!r}: add one, or a reason not to"
    if words[1] in ("train", "sft"):
        return ["config", "--for", words[1], *words[2:]]
    return words[1:]


def run_here(command: str, workspace: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> tuple[int, str]:
    """Run ``command`` in this process (``verl_core.cli.main``, as the console script does) from
    ``workspace``, without the caller's ``VERL_CORE_*`` switches; its exit code and output."""
    from verl_core.cli import main

    for key in [key for key in os.environ if key.startswith("VERL_CORE_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(workspace)
    code = main(as_run_here(command))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_the_command_runs_as_written(page, command, workspace, monkeypatch, capsys) -> None:
    reason = why_not_run(command)
    if reason:
        pytest.skip(reason)
    code, output = run_here(command, workspace, monkeypatch, capsys)
    assert code == 0, f"{page}: `{command}` exited {code}:\n{output}"


def test_every_page_has_commands() -> None:
    for page in PAGES:
        assert shell_commands(page), f"{page} has no bash block: the parser missed them"


def test_a_command_with_a_misspelt_key_fails(workspace, monkeypatch, capsys) -> None:
    """The check can fail: the same harness sees a misspelt key refused, exit 2, naming it."""
    code, output = run_here("verl-core train examples/grpo.yaml rollout.nn=4", workspace, monkeypatch, capsys)
    assert code == 2 and "rollout.nn" in output, output
