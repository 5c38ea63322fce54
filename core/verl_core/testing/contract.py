"""``PluginContract``: the tests every plugin distribution runs on itself as a plugin (pytest).

The conformance kit (``EngineConformance``) checks what an engine computes; this checks that the
installed distribution is a well-formed verl-core plugin. Subclass it in the plugin's tests::

    from verl_core.testing import PluginContract

    class TestPlugin(PluginContract):
        distribution = "verl-ddp"
        package = "verl_ddp"
        entry_points = {"ddp": "verl_ddp.plugin"}
        options_examples = {"ddp": {"bucket_cap_mb": 8, "static_graph": True}}

A distribution of rollout backends lists them in ``rollout_options_examples`` (options as under
``rollout.<backend>``) instead, or beside its engine backends.

What it asserts, each as its own test:

- the package's ``__version__`` is the installed distribution's version, and the installed verl-core
  is inside the range the distribution requires;
- the distribution declares exactly ``entry_points`` in the ``verl_core.plugins`` group (none, for a
  distribution that provides nothing yet), and discovery finds each backend of ``options_examples``
  and ``rollout_options_examples`` through them, attributed to this distribution, with status ``ok``
  (or ``unavailable``, for a rollout whose ``requires`` are not installed here);
- listing the plugins and loading every backend's options class import no torch, transformers, engine
  or inference-engine module (a fresh subprocess);
- importing the plugin, calling its hooks, importing its engines and rollouts and building each one
  uses no deprecated verl-core API (a fresh subprocess: every ``VerlCoreDeprecationWarning`` is listed
  with its file and line);
- each backend's descriptor is valid: a literal ``api_version`` that core accepts, an engine class that
  subclasses ``BaseEngine`` (a rollout class that subclasses ``BaseRollout``) whose ``options_class`` is
  the descriptor's config class, and a description;
- the options structure from a run config's section (``actor.engine.<backend>: {...}``,
  ``rollout.<backend>: {...}``), round-trip through plain data (defaults and the example), and an
  unknown key is refused at its full path;
- an engine (a rollout) built but not initialised refuses to compute (to generate), naming
  ``initialize()``;
- with ``options_docs``: each backend's (engine or rollout) documentation has an options table (rows of
  ``| `name` | `default` | meaning |``, under an ``## Options`` heading where the page has one) listing
  every option of its options class with its default.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from typing import Any, ClassVar

import pytest

#: Modules that listing plugins must not import.
HEAVY_MODULES = ("torch", "transformers", "tensordict", "megatron", "vllm", "sglang")


class PluginContract:
    """Base class of a plugin distribution's own contract tests (see the module docstring)."""

    #: The distribution's name, as installed (``verl-ddp``).
    distribution: ClassVar[str] = ""
    #: Its import package, whose ``__version__`` must match the distribution's (empty: not checked).
    package: ClassVar[str] = ""
    #: Every ``verl_core.plugins`` entry point it declares: name -> module.
    entry_points: ClassVar[dict[str, str]] = {}
    #: The engine backends it provides, each with a non-default options mapping as it would appear in
    #: a run config under ``actor.engine.<backend>`` (``{}`` for a backend without options).
    options_examples: ClassVar[dict[str, dict[str, Any]]] = {}
    #: The rollout backends it provides, each with a non-default options mapping as it would appear in
    #: a run config under ``rollout.<backend>``.
    rollout_options_examples: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Backend -> the Markdown file documenting its options (empty: not checked).
    options_docs: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls) -> Any:
        """The registry a user gets: core's built-ins and every installed entry point."""
        from verl_core.plugins import Registry

        if not cls.distribution:
            pytest.fail(f"{cls.__name__}: set distribution = '<the distribution's name>'")
        return Registry.from_plugins(autoload=True)

    # -- the distribution ------------------------------------------------------------------------

    def test_package_version_is_the_distribution_version(self) -> None:
        if not self.package:
            pytest.skip("no package named: set package = '<import package>' to check its __version__")
        installed = metadata.version(self.distribution)
        declared = importlib.import_module(self.package).__version__
        assert declared == installed, (
            f"{self.package}.__version__ is {declared} but {self.distribution} is installed as {installed}: bump "
            "both together (the package's __init__.py and pyproject.toml), then reinstall"
        )

    def test_installed_core_is_inside_the_required_range(self) -> None:
        from packaging.requirements import Requirement

        requirements = [Requirement(r) for r in metadata.requires(self.distribution) or []]
        cores = [r for r in requirements if r.name == "verl-core"]
        assert len(cores) == 1, (
            f"{self.distribution} must require verl-core once, with a version range: {cores}"
        )
        installed = metadata.version("verl-core")
        assert cores[0].specifier.contains(installed), (
            f"{self.distribution} requires {cores[0]} but verl-core {installed} is installed"
        )

    def test_entry_points_are_declared_by_the_distribution(self) -> None:
        from verl_core.hookspecs import ENTRY_POINT_GROUP

        declared = metadata.distribution(self.distribution).entry_points.select(group=ENTRY_POINT_GROUP)
        assert {ep.name: ep.value for ep in declared} == self.entry_points, (
            f"{self.distribution} declares {list(declared)} in {ENTRY_POINT_GROUP!r}, expected "
            f"{self.entry_points} (reinstall the distribution after editing its pyproject.toml)"
        )

    def test_backends_are_found_through_the_entry_points(self, registry: Any) -> None:
        from verl_core.plugins.discovery import same_distribution

        for kind, examples, attribute in _BACKEND_KINDS:
            expected = getattr(self, examples)
            provided = {
                entry.name: entry
                for entry in registry.entries(kind)
                if entry.distribution and same_distribution(entry.distribution, self.distribution)
            }
            assert sorted(provided) == sorted(expected), (
                f"{self.distribution} provides {attribute} {sorted(provided)}; the test expects "
                f"{sorted(expected)} (list each in {examples})"
            )
            for entry in provided.values():
                assert entry.plugin in self.entry_points and entry.status in ("ok", "unavailable"), entry
                assert entry.version == metadata.version(self.distribution)

    @pytest.fixture(scope="class")
    @classmethod
    def fresh_process(cls) -> dict[str, list[str]]:
        """What a fresh interpreter with only this distribution's plugins (so that no other installed
        plugin can be blamed on it) records: ``heavy``, the heavy modules listing the plugins and loading
        the options classes imported; ``deprecated``, every use of deprecated verl-core API (file, line,
        message) while importing the plugins, calling their hooks, and importing and building each
        engine (not initialised: no model is read)."""
        from verl_core.plugins.switches import ENV_DISABLE_AUTOLOAD, ENV_PLUGINS

        env = {name: value for name, value in os.environ.items() if not name.startswith("VERL_CORE_")}
        env |= {ENV_DISABLE_AUTOLOAD: "1", ENV_PLUGINS: ",".join(cls.entry_points.values())}
        env.pop("PYTHONWARNINGS", None)
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                _FRESH_PROCESS.format(
                    backends=sorted(cls.options_examples),
                    rollouts=sorted(cls.rollout_options_examples),
                    heavy=HEAVY_MODULES,
                ),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.splitlines()[-1])

    def test_listing_imports_nothing_heavy(self, fresh_process: dict[str, list[str]]) -> None:
        heavy = fresh_process["heavy"]
        assert heavy == [], (
            f"listing the plugins and loading the options classes of {self.distribution} imported {heavy}: keep "
            "the plugin module and the options module free of them (name the engine by import string)"
        )

    def test_uses_no_deprecated_api(self, fresh_process: dict[str, list[str]]) -> None:
        used = fresh_process["deprecated"]
        assert used == [], (
            f"{self.distribution} uses deprecated verl-core API, which a later release removes (docs/api.md "
            "says when; each warning names the replacement):\n" + "\n".join(used)
        )

    # -- each backend ----------------------------------------------------------------------------

    def test_descriptors_are_valid(self, registry: Any) -> None:
        from verl_core.descriptors import (
            ENGINE_API_VERSION,
            MIN_ENGINE_API_VERSION,
            MIN_ROLLOUT_API_VERSION,
            ROLLOUT_API_VERSION,
        )
        from verl_core.engine.base import BaseEngine
        from verl_core.hookspecs import Kind
        from verl_core.rollout.base import BaseRollout

        versions = {
            Kind.ENGINE_BACKENDS: (MIN_ENGINE_API_VERSION, ENGINE_API_VERSION, "engine", BaseEngine),
            Kind.ROLLOUT_BACKENDS: (MIN_ROLLOUT_API_VERSION, ROLLOUT_API_VERSION, "rollout", BaseRollout),
        }
        for kind, examples, _ in _BACKEND_KINDS:
            oldest, newest, field, base = versions[kind]
            for name in getattr(self, examples):
                entry = _usable_entry(registry, kind, name)
                descriptor = entry.descriptor
                assert oldest <= descriptor.api_version <= newest, descriptor
                assert descriptor.description, (
                    f"backend {name!r}: give the {type(descriptor).__name__} a description"
                )
                implementation = entry.load(field)
                assert isinstance(implementation, type) and issubclass(implementation, base), implementation
                assert implementation.options_class is entry.load("config"), (
                    f"backend {name!r}: {implementation.__qualname__}.options_class must be the descriptor's "
                    "config class"
                )

    def test_options_structure_and_round_trip(self, registry: Any) -> None:
        from verl_core.config import EngineConfig, ModelConfig, RolloutConfig, structure, unstructure
        from verl_core.errors import ConfigError
        from verl_core.hookspecs import Kind

        sections = {  # the config class of a section, its path, and what else it needs
            Kind.ENGINE_BACKENDS: (EngineConfig, "actor.engine", {"model": ModelConfig(path="m")}),
            Kind.ROLLOUT_BACKENDS: (RolloutConfig, "rollout", {}),
        }
        for kind, examples, _ in _BACKEND_KINDS:
            config_class, where, needed = sections[kind]
            for name, example in getattr(self, examples).items():
                options_class = _usable_entry(registry, kind, name).load("config")
                section = {"backend": name, **unstructure(needed), name: example}
                config = structure(section, config_class, where, registry=registry)
                assert config.options == structure(example, options_class, registry=registry), config.options
                if example:
                    assert config.options != options_class(), (
                        f"{examples}[{name!r}] should differ from the defaults"
                    )
                for options in (options_class(), config.options):
                    built = config_class(backend=name, options=options, **needed)
                    assert structure(unstructure(built), config_class, registry=registry) == built
                typo = {**section, name: {**example, "no_such_option": 1}}
                with pytest.raises(ConfigError) as caught:
                    structure(typo, config_class, where, registry=registry)
                assert f"{where}.{name}.no_such_option" in [path for path, _ in caught.value.errors]

    def test_an_engine_refuses_to_compute_before_initialize(
        self, registry: Any, tmp_path_factory: Any
    ) -> None:
        from verl_core.config import EngineConfig, ModelConfig
        from verl_core.engine.factory import build_engine
        from verl_core.testing.tiny import collate, make_samples, save_tiny_models

        if not self.options_examples:
            pytest.skip("no engine backends: list them in options_examples")
        model = save_tiny_models(tmp_path_factory.mktemp("contract")).lm
        for name in self.options_examples:
            engine = build_engine(
                EngineConfig(backend=name, model=ModelConfig(path=model), device="cpu"), registry=registry
            )
            with pytest.raises(RuntimeError, match=r"initialize\(\)"):
                engine.infer_batch(collate(make_samples(0)[:2]))

    def test_a_rollout_refuses_to_generate_before_initialize(self, registry: Any) -> None:
        from verl_core.config import ModelConfig
        from verl_core.errors import RolloutError
        from verl_core.hookspecs import Kind
        from verl_core.rollout import SamplingParams

        if not self.rollout_options_examples:
            pytest.skip("no rollout backends: list them in rollout_options_examples")
        for name in self.rollout_options_examples:
            rollout_class = _usable_entry(registry, Kind.ROLLOUT_BACKENDS, name).load("rollout")
            rollout = rollout_class(ModelConfig(path="unused"), None, device="cpu")
            with pytest.raises((RolloutError, RuntimeError), match=r"initialize\(\)"):
                sampling = SamplingParams(max_new_tokens=2, eos_token_ids=(0,), pad_token_id=0)
                rollout.generate([[1, 2, 3]], sampling, seed=0)

    def test_the_options_tables_document_every_option_with_its_default(self, registry: Any) -> None:
        import re
        from pathlib import Path

        import attrs
        import yaml

        if not self.options_docs:
            pytest.skip("no options_docs: set options_docs = {'<backend>': '<path of its options table>'}")
        for name, path in self.options_docs.items():
            options_class = _options_class(registry, name)
            text = Path(path).read_text()
            # Under an "## Options" heading where there is one: the other tables of the page are not it.
            section = re.search(r"^## Options.*?(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
            rows = dict(
                re.findall(
                    r"^\| `(\w+)` \| `([^`]*)` \|", section[0] if section else text, flags=re.MULTILINE
                )
            )
            defaults = {
                field.name: field.default.factory()
                if isinstance(field.default, attrs.Factory) and not field.default.takes_self
                else field.default
                for field in attrs.fields(options_class)
            }
            assert sorted(rows) == sorted(defaults), (
                f"{path}: the options table lists {sorted(rows)}, {options_class.__qualname__} has {sorted(defaults)}"
            )
            for option, default in defaults.items():
                documented = yaml.safe_load(rows[option])
                expected = list(default) if isinstance(default, tuple) else default
                assert documented == expected, (
                    f"{path}: `{option}` is documented as {documented!r}, defaults to {expected!r}"
                )


#: The kinds of backend a distribution lists: the registry kind, the ``PluginContract`` attribute of its
#: examples, and how messages call them.
_BACKEND_KINDS = (
    ("engine_backends", "options_examples", "engine backends"),
    ("rollout_backends", "rollout_options_examples", "rollout backends"),
)


def _usable_entry(registry: Any, kind: str, name: str) -> Any:
    """The registry entry of backend ``name``; a rollout whose ``requires`` are not installed here
    cannot be checked, and the calling test says so as a skip (never a pass)."""
    from verl_core.plugins.registry import Entry

    entry = next((entry for entry in registry.entries(kind) if entry.name == name), None)
    if isinstance(entry, Entry) and entry.status == "unavailable":
        pytest.skip(f"{entry.error}: this check runs where it is installed")
    return registry.entry(kind, name)


def _options_class(registry: Any, name: str) -> type:
    """The options class of the engine or rollout backend ``name`` (its config module imports without
    the backend's heavy packages, so an unavailable rollout's is loaded too)."""
    for kind, _, _ in _BACKEND_KINDS:
        for entry in registry.entries(kind):
            if entry.name == name:
                return entry.load("config")
    raise AssertionError(f"options_docs names {name!r}, which is neither an engine nor a rollout backend")


#: The script ``PluginContract.fresh_process`` runs (``{backends}``, ``{heavy}`` filled in).
_FRESH_PROCESS = """
import json, sys, warnings

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from verl_core.plugins import get_registry

    registry = get_registry()
    for name in {backends!r}:
        registry.entry("engine_backends", name).load("config")
    for entry in registry.entries("rollout_backends"):
        if entry.name in {rollouts!r}:
            entry.load("config")
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})

    from verl_core.config import EngineConfig, ModelConfig
    from verl_core.deprecation import VerlCoreDeprecationWarning
    from verl_core.engine import build_engine

    for name in {backends!r}:
        try:  # a backend that cannot be built fails test_descriptors_are_valid, not this
            build_engine(EngineConfig(backend=name, model=ModelConfig(path="unused"), device="cpu"), registry=registry)
        except Exception:
            pass
    for name in {rollouts!r}:
        try:  # built, not initialised: no model is read, no inference engine starts
            registry.entry("rollout_backends", name).load("rollout")(ModelConfig(path="unused"), None, device="cpu")
        except Exception:
            pass
deprecated = [
    f"{{w.filename}}:{{w.lineno}}: {{w.message}}" for w in caught if issubclass(w.category, VerlCoreDeprecationWarning)
]
print(json.dumps({{"heavy": heavy, "deprecated": deprecated}}))
"""
