"""The engine API-version gate fires for the plugins that exist: a core that no longer accepts a plugin's
version refuses the unchanged template plugin, naming both versions; one whose range still includes it
loads it.

The other core is this checkout's ``verl_core`` copied with its version range changed, put
first on ``PYTHONPATH`` in a subprocess; the template plugin (verl-ddp) is found through its real
installed entry point, exactly as a user's upgraded core would find it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import verl_core
from verl_core import ENGINE_API_VERSION

pytest.importorskip("verl_ddp", reason="needs the template plugin: pip install -e plugins/verl_ddp")

OTHER_VERSION = ENGINE_API_VERSION + 1


def core_speaking(version: int, site: Path, oldest: int | None = None) -> Path:
    """A copy of verl_core in ``site`` that speaks engine API ``version`` and accepts versions from
    ``oldest`` (default: ``version`` alone) up to it."""
    copy = site / "verl_core"
    shutil.copytree(Path(verl_core.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    descriptors = copy / "descriptors.py"
    source = descriptors.read_text()
    for name, value in (("ENGINE_API_VERSION", version), ("MIN_ENGINE_API_VERSION", oldest or version)):
        source, count = re.subn(rf"^{name} = \d+$", f"{name} = {value}", source, flags=re.M)
        assert count == 1, f"{name} is no longer assigned in descriptors.py"
    descriptors.write_text(source)
    return site


def plugin_rows(site: Path) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "verl_core", "plugins", "--json"],
        capture_output=True,
        text=True,
        env={name: value for name, value in env.items() if not name.startswith("VERL_CORE_")},
        timeout=120,
        check=True,
    )
    return {row["backend"]: row for row in json.loads(result.stdout) if row["backend"]}


def test_a_core_speaking_another_version_refuses_the_unchanged_template_plugin(tmp_path: Path) -> None:
    site = core_speaking(OTHER_VERSION, tmp_path)
    rows = plugin_rows(site)
    assert rows["ddp"]["status"] == "incompatible", rows["ddp"]
    message = rows["ddp"]["error"]
    assert f"targets engine API version {ENGINE_API_VERSION}" in message
    assert f"speaks engine API version {OTHER_VERSION}" in message
    assert "Upgrade verl-ddp (pip install -U verl-ddp)" in message

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env = {name: value for name, value in env.items() if not name.startswith("VERL_CORE_")}
    probe = (
        "from verl_core.errors import ApiVersionError\n"
        "from verl_core.plugins import get_registry\n"
        "try:\n"
        "    get_registry().get('engine_backends', 'ddp')\n"
        "except ApiVersionError as error:\n"
        "    print(error)\n"
    )
    refused = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    assert f"speaks engine API version {OTHER_VERSION}" in refused.stdout


def test_a_core_that_still_accepts_the_older_version_loads_it(tmp_path: Path) -> None:
    """The range: a core that speaks the next version but still accepts this one loads the plugin."""
    rows = plugin_rows(core_speaking(OTHER_VERSION, tmp_path, oldest=ENGINE_API_VERSION))
    assert rows["ddp"]["status"] == "ok", rows["ddp"]


def test_the_same_copy_at_the_current_version_accepts_it(tmp_path: Path) -> None:
    """The check above can fail only because of the version: the copied core is otherwise sound."""
    assert plugin_rows(core_speaking(ENGINE_API_VERSION, tmp_path))["ddp"]["status"] == "ok"
