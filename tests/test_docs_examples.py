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
