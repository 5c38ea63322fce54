"""The runnable examples in docs/ run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).parents[1] / "docs"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


@pytest.mark.distributed
def test_the_programmatic_conformance_example_runs_as_a_script(tmp_path: Path) -> None:
    (script,) = [block for block in python_blocks("conformance.md") if "run_conformance(" in block]
    assert 'if __name__ == "__main__":' in script  # spawned ranks import the script again
    path = tmp_path / "check_my_backend.py"
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "first_step               passed" in result.stdout
        and "dp_invariance            passed" in result.stdout
    )


def test_the_programmatic_rollout_conformance_example_runs() -> None:
    (snippet,) = [block for block in python_blocks("conformance.md") if "run_rollout_conformance(" in block]
    exec(snippet, {})  # in this process: the rollout kit spawns nothing


@pytest.fixture
def my_rollout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The worked rollout plugin of docs/plugins.md, its files written as the page shows them."""
    files = {
        block.splitlines()[0].removeprefix("# "): block
        for block in python_blocks("plugins.md")
        if block.startswith("# my_rollout/")
    }
    assert set(files) == {"my_rollout/config.py", "my_rollout/rollout.py", "my_rollout/plugin.py"}
    (tmp_path / "my_rollout").mkdir()
    (tmp_path / "my_rollout" / "__init__.py").write_text("")
    for path, text in files.items():
        (tmp_path / path).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "my_rollout"
    for name in [name for name in sys.modules if name.split(".")[0] == "my_rollout"]:
        del sys.modules[name]


#: The one line the page's worked rollout plugin has beyond the copy of it that predates rollout contract 2.
STATED_API_VERSION = (
    "            api_version=1,  # rollout contract 1: BaseRollout supplies contract 2's methods\n"
)


def test_the_worked_rollout_plugin_passes_the_rollout_kit(my_rollout: Path) -> None:
    import torch

    from verl_core.testing import RolloutConformance, run_rollout_conformance

    torch.set_num_threads(1)
    # The page's files are tests/fixtures/contract1_rollout's but for the package name and the stated
    # api_version, and tests/test_rollout_contract1.py runs the whole kit on those: one run serves both.
    fixture = Path(__file__).parent / "fixtures" / "contract1_rollout"
    for name in ("config.py", "rollout.py", "plugin.py"):
        page = (my_rollout / name).read_text()
        assert page.count(STATED_API_VERSION) == (name == "plugin.py"), name
        as_fixture = page.replace(STATED_API_VERSION, "").replace(
            "my_rollout/", "fixtures/contract1_rollout/"
        )
        assert (
            as_fixture.replace("my_rollout", "fixtures.contract1_rollout") == (fixture / name).read_text()
        ), f"docs/plugins.md's my_rollout/{name} is no longer tests/fixtures/contract1_rollout/{name}"

    (test,) = [
        block for block in python_blocks("plugins.md") if block.startswith("# tests/test_rollout_conf")
    ]
    namespace: dict = {}
    exec(test, namespace)
    kit_test = namespace["TestGenerateRolloutConformance"]
    assert issubclass(kit_test, RolloutConformance) and kit_test.backend == "hf-generate"

    # As the page says: without top_k, generate filters with its default top_k=50, and sampling fails.
    source = (my_rollout / "rollout.py").read_text()
    assert source.count('"top_k": sampling.top_k,\n') == 1
    (my_rollout / "rollout.py").write_text(source.replace('"top_k": sampling.top_k,\n', ""))
    sys.modules.pop("my_rollout.rollout", None)
    report = run_rollout_conformance(
        "hf-generate", plugins=["my_rollout.plugin"], autoload=False, checks=["sampling"]
    )
    assert [c.quantity for c in report["sampling"].failures] == [
        "T=0.7: sampled tokens follow softmax(logits / T)",
        "T=1.0: sampled tokens follow softmax(logits / T)",
        "T=0.7: first tokens follow softmax(logits / T)",
    ], report.summary()
    assert "more likely than T makes them" in report["sampling"].describe()
