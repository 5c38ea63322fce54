"""A plugin written against verl-core's first release (0.1.0) still works, warning only about deprecations.

The plugin is ``fixtures.first_release_ddp``: the ``ddp`` template as of its first commit, unedited but
for its package name. Under warnings-as-errors for everything except ``VerlCoreDeprecationWarning`` (in
this process and, through ``verl_core.testing.spawn``, in the kit's ranks) it imports, registers, builds
and passes the conformance kit, apart from checks the kit gained since, which it may fail only with a
message naming the fix. The last tests take away a compatibility shim and show the plugin break.
"""

from __future__ import annotations

import sys
import warnings

import pytest

from verl_core.config import EngineConfig, ModelConfig
from verl_core.deprecation import VerlCoreDeprecationWarning
from verl_core.engine import build_engine
from verl_core.plugins import Registry
from verl_core.testing import CHECKS, run_conformance, save_tiny_models

pytestmark = pytest.mark.filterwarnings("error", "default::verl_core.deprecation.VerlCoreDeprecationWarning")

PACKAGE = "fixtures.first_release_ddp"
PLUGIN = f"{PACKAGE}.plugin"
#: Checks the kit gained after 0.1.0 that a 0.1.0 engine cannot pass -> the fix their message must name.
NEWER_CHECKS = {"checkpoint": "wrap loading in verl_core.engine.reading_checkpoint"}
#: What the plugin uses that changed since 0.1.0, each named by its deprecation warning.
DEPRECATED_USES = (
    "EngineBackend without api_version",
    "verl_core.engine.distributed is deprecated",
    "DDPEngine: an engine __init__ without a config_path argument",
)


def fresh_plugin_import() -> object:
    """The fixture's modules imported anew, so that import-time warnings fire again."""
    for name in [name for name in sys.modules if name.startswith(PACKAGE)]:
        del sys.modules[name]
    return __import__(PLUGIN, fromlist=["_"])


def build(registry: Registry, model: str):
    config = EngineConfig(backend="ddp", model=ModelConfig(path=model), device="cpu")
    return build_engine(config, "lm", registry, config_path="actor.engine")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_models(tmp_path_factory.mktemp("tiny")).lm


def test_it_imports_registers_and_builds_warning_only_about_deprecations(model) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")  # anything but a deprecation of ours raises
        warnings.simplefilter("always", VerlCoreDeprecationWarning)
        registry = Registry.from_plugins([fresh_plugin_import()], autoload=False)
        engine = build(registry, model)
        engine.initialize()
    assert registry.entry("engine_backends", "ddp").status == "ok"
    assert engine.config_path == "actor.engine"  # set by build_engine for an __init__ without it
    messages = [str(w.message) for w in caught]
    for use in DEPRECATED_USES:
        assert any(use in message for message in messages), (use, messages)
    assert {w.filename.rpartition("/")[2] for w in caught} == {"plugin.py", "engine.py"}, [
        (w.filename, w.lineno) for w in caught
    ]  # each warning points at the plugin's own line, not at core


def test_the_conformance_kit_passes_but_for_checks_added_since_which_name_the_fix() -> None:
    report = run_conformance("ddp", world_size=2, plugins=[PLUGIN], autoload=False)
    assert report.error is None, report.summary()
    for name in CHECKS:
        outcome = report[name]
        if name in NEWER_CHECKS and not outcome.passed:
            failing = [c for c in outcome.comparisons if not c.passed]
            assert outcome.status == "failed" and failing, outcome.describe()
            assert all(NEWER_CHECKS[name] in c.detail for c in failing), outcome.describe()
        else:
            assert outcome.passed or outcome.status == "skipped", outcome.describe()


# -- without the compatibility, it breaks ------------------------------------------------------------


def test_without_the_moved_module_alias_the_plugin_no_longer_imports(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "verl_core.engine.distributed", None)  # as if the file were gone
    fresh_plugin_import()
    with pytest.raises(ImportError, match="verl_core.engine.distributed"):
        __import__(f"{PACKAGE}.engine")


def test_without_the_constructor_compatibility_it_no_longer_builds(model, monkeypatch) -> None:
    from verl_core.engine import factory

    def construct_as_before(engine_class, config, role, config_path):
        return engine_class(config, role=role, config_path=config_path)

    monkeypatch.setattr(factory, "_construct", construct_as_before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VerlCoreDeprecationWarning)
        registry = Registry.from_plugins([fresh_plugin_import()], autoload=False)
    with pytest.raises(TypeError, match="config_path"):
        build(registry, model)
