"""``PluginContract`` itself: run on a well-formed fake distribution every test passes, and run on
deliberately broken ones exactly the test for each defect fails.

The distributions are fake installed ones (``fixtures.fake_dist``); the contract tests run in a
pytest subprocess that sees them on ``PYTHONPATH``, as a plugin's own test suite would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from fixtures.fake_dist import fake_distributions

from verl_core import __version__ as core_version

CORE = f"verl-core=={core_version}"

OPTIONS = """
    import attrs

    @attrs.define
    class Options:
        level: int = 1
"""

ENGINE = """
    from verl_core.toolkit import HFEngine
    from {package}.options import Options

    class Engine(HFEngine):
        options_class = Options

        def wrap_model(self, module):
            return module.to(self.device)

        def save_checkpoint(self, path, global_step=0):
            raise NotImplementedError

        def load_checkpoint(self, path):
            raise NotImplementedError
"""

#: An engine that computes without being initialised.
EAGER_ENGINE = """
    from verl_core.engine import BaseEngine, ForwardBackwardResult
    from {package}.options import Options

    class Engine(BaseEngine):
        options_class = Options
        initialize = set_model_mode = to = optimizer_zero_grad = lambda self, *a, **k: None
        optimizer_step = lr_scheduler_step = get_lr = lambda self: 0.0
        get_per_tensor_param = save_checkpoint = load_checkpoint = save_hf_model = lambda self, *a: None

        def forward_backward_batch(self, batch, loss_fn, forward_only):
            return ForwardBackwardResult(outputs=None)
"""

#: An engine that imports a name from where verl-core 0.1 had it (deprecated since 0.2.0).
DEPRECATED_ENGINE = ENGINE.replace(
    "    from verl_core.toolkit import HFEngine\n",
    "    from verl_core.toolkit import HFEngine\n    from verl_core.engine.distributed import barrier\n",
)

#: An engine whose options class is not the one its descriptor names.
MISMATCHED_ENGINE = ENGINE.replace("options_class = Options", "options_class = dict")


ROLLOUT = """
    from verl_core.rollout import HFRollout
    from {package}.options import Options

    class Rollout(HFRollout):
        options_class = Options
"""

#: A rollout that answers before it has loaded a model.
EAGER_ROLLOUT = """
    from verl_core.rollout import BaseRollout
    from {package}.options import Options

    class Rollout(BaseRollout):
        options_class = Options
        initialize = update_weights = lambda self, *a: None

        def generate(self, prompts, sampling, seed):
            return None
"""


def plugin_module(backend: str, package: str, heavy: bool = False) -> str:
    imports = "import torch  # a heavy import where listing must stay light\n" if heavy else ""
    return imports + textwrap.dedent(f"""
        from verl_core import EngineBackend, hookimpl

        @hookimpl
        def verl_engine_backends():
            return [EngineBackend(
                name={backend!r}, engine="{package}.engine:Engine", config="{package}.options:Options",
                api_version=1, description="a fake backend",
            )]
    """)


def rollout_plugin_module(backend: str, package: str, requires: tuple[str, ...]) -> str:
    return textwrap.dedent(f"""
        from verl_core import RolloutBackend, RolloutCapabilities, hookimpl

        @hookimpl
        def verl_rollout_backends():
            return [RolloutBackend(
                name={backend!r}, rollout="{package}.rollout:Rollout", config="{package}.options:Options",
                api_version=2, capabilities=RolloutCapabilities(), description="a fake rollout",
                requires={requires!r}, install="pip install {backend}-server",
            )]
    """)


def install(
    dists,
    backend: str,
    *,
    version="0.2",
    package_version="0.2",
    requires=(CORE,),
    engine=ENGINE,
    heavy=False,
    rollout=None,
    rollout_requires=(),
):
    """A fake distribution ``<backend>-dist`` with package ``<backend>_pkg`` providing one engine
    backend, or with ``rollout`` (its module's source) one rollout backend."""
    package = f"{backend}_pkg"
    root = dists.site / package
    root.mkdir()
    (root / "__init__.py").write_text(f"__version__ = {package_version!r}\n")
    (root / "options.py").write_text(textwrap.dedent(OPTIONS))
    if rollout is None:
        (root / "engine.py").write_text(textwrap.dedent(engine.format(package=package)))
        (root / "plugin.py").write_text(plugin_module(backend, package, heavy))
        examples = "options_examples"
    else:
        (root / "rollout.py").write_text(textwrap.dedent(rollout.format(package=package)))
        (root / "plugin.py").write_text(rollout_plugin_module(backend, package, rollout_requires))
        examples = "rollout_options_examples"
    dists.add(f"{backend}-dist", version, {backend: (f"{package}.plugin", None)}, requires=requires)
    return textwrap.dedent(f"""
        class Test_{backend}(PluginContract):
            distribution = "{backend}-dist"
            package = "{package}"
            entry_points = {{"{backend}": "{package}.plugin"}}
            {examples} = {{"{backend}": {{"level": 3}}}}
    """)


#: Each fake distribution's one defect, and the contract test that must fail because of it.
DEFECTS = {
    "good": (None, {}),
    "heavy": ("test_listing_imports_nothing_heavy", {"heavy": True}),
    "stale": ("test_package_version_is_the_distribution_version", {"package_version": "0.1"}),
    "unpinned": ("test_installed_core_is_inside_the_required_range", {"requires": ()}),
    "mismatched": ("test_descriptors_are_valid", {"engine": MISMATCHED_ENGINE}),
    "eager": ("test_an_engine_refuses_to_compute_before_initialize", {"engine": EAGER_ENGINE}),
    "deprecated": ("test_uses_no_deprecated_api", {"engine": DEPRECATED_ENGINE}),
    "served": (None, {"rollout": ROLLOUT}),
    "eagerserved": ("test_a_rollout_refuses_to_generate_before_initialize", {"rollout": EAGER_ROLLOUT}),
    # Its inference server is not installed: what needs the rollout class is skipped, saying why.
    "unserved": (None, {"rollout": ROLLOUT, "rollout_requires": ("unserved_inference_server",)}),
}

#: The contract tests that check one kind of backend, skipped (with the reason) on a distribution of the other.
ROLLOUT_ONLY_TESTS = ("test_a_rollout_refuses_to_generate_before_initialize",)
ENGINE_ONLY_TESTS = ("test_an_engine_refuses_to_compute_before_initialize",)
DOCS_TEST = "test_the_options_tables_document_every_option_with_its_default"
#: What cannot be checked without the rollout's required package.
NEEDS_THE_ROLLOUT = (
    "test_descriptors_are_valid",
    "test_options_structure_and_round_trip",
    "test_a_rollout_refuses_to_generate_before_initialize",
)


#: The contract tests that start a fresh interpreter (``PluginContract.fresh_process``).
FRESH_PROCESS_TESTS = ("test_listing_imports_nothing_heavy", "test_uses_no_deprecated_api")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """(class, test) -> PASSED/FAILED/ERROR/SKIPPED of one pytest run over every fake distribution,
    ``"report"`` -> the end of that run's output and ``"skipped"`` -> its summary lines of skipped tests."""
    tmp_path = tmp_path_factory.mktemp("contract")
    with fake_distributions(tmp_path) as dists:
        classes = [install(dists, backend, **changes) for backend, (_, changes) in DEFECTS.items()]
        test_file = tmp_path / "test_fake_plugins.py"
        test_file.write_text("from verl_core.testing import PluginContract\n" + "\n".join(classes))
        # The tests that read a fresh interpreter (one per class, seconds each) run where they are the
        # point: on the good distribution and on the defects they must catch.
        fresh = " or ".join(FRESH_PROCESS_TESTS)
        selected = f"Test_good or Test_heavy or Test_deprecated or Test_served or not ({fresh})"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(dists.site), os.environ.get("PYTHONPATH", "")]),
        }
        env = {k: v for k, v in env.items() if not k.startswith("VERL_CORE_")}
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                str(test_file),
                "-v",
                "-rA",
                "-p",
                "no:cacheprovider",
                "-k",
                selected,
                "-W",
                "ignore",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
        )
    # Verbose lines (``path::class::test STATUS``) name skipped tests too, which -rA's summary does not.
    found = dict(
        ((cls.removeprefix("Test_"), test), status)
        for cls, test, status in re.findall(
            r"^\S*::(\w+)::(\w+) (PASSED|FAILED|ERROR|SKIPPED)", result.stdout, re.M
        )
    )
    assert found, result.stdout + result.stderr
    # Keep the run's report for the assertions' messages: it holds each failure's explanation.
    found["report"] = result.stdout[-6000:]
    # -rA's summary lines of skipped tests, with their reasons (they can lie before the report's tail).
    found["skipped"] = "\n".join(re.findall(r"^SKIPPED .*$", result.stdout, re.M))
    return found


def statuses_of(outcomes: dict, backend: str) -> dict[str, str]:
    """Test -> status on ``backend``'s distribution, without the tests of the kind it does not provide."""
    other_kind = ENGINE_ONLY_TESTS if "rollout" in DEFECTS[backend][1] else ROLLOUT_ONLY_TESTS
    statuses = {key[1]: status for key, status in outcomes.items() if key[0] == backend}
    # None of the fake distributions names its docs (test_an_options_table_must_list_... checks them).
    assert all(statuses.pop(test) == "SKIPPED" for test in (*other_kind, DOCS_TEST)), outcomes["report"]
    return statuses


@pytest.mark.parametrize("backend", ["good", "served"])
def test_a_well_formed_distribution_passes_every_contract_test(outcomes, backend) -> None:
    good = statuses_of(outcomes, backend)
    assert len(good) >= 8 and set(good.values()) == {"PASSED"}, outcomes["report"]


def test_a_rollout_whose_package_is_missing_is_skipped_where_it_cannot_be_checked(outcomes) -> None:
    statuses = statuses_of(outcomes, "unserved")
    assert {test for test, status in statuses.items() if status == "SKIPPED"} == set(NEEDS_THE_ROLLOUT)
    assert {status for test, status in statuses.items() if test not in NEEDS_THE_ROLLOUT} == {"PASSED"}
    assert "needs the module 'unserved_inference_server', which is not installed" in outcomes["skipped"]


@pytest.mark.parametrize("backend", [name for name, (test, _) in DEFECTS.items() if test])
def test_each_defect_fails_exactly_its_test(outcomes, backend) -> None:
    expected_failure = DEFECTS[backend][0]
    statuses = statuses_of(outcomes, backend)
    assert statuses[expected_failure] == "FAILED", outcomes["report"]
    others = {test: status for test, status in statuses.items() if test != expected_failure}
    if backend == "mismatched":  # build_engine refuses the mismatch too, so the engine test cannot run
        others.pop("test_an_engine_refuses_to_compute_before_initialize")
    assert set(others.values()) == {"PASSED"}, outcomes["report"]


def test_an_options_table_must_list_every_option_with_its_default(tmp_path) -> None:
    from verl_core.plugins import Registry
    from verl_core.testing import PluginContract

    rows = {
        "bucket_cap_mb": "25.0",
        "find_unused_parameters": "false",
        "gradient_as_bucket_view": "true",
        "forward_sync_buffers": "false",
        "static_graph": "false",
    }

    def check(table: dict[str, str], heading: str = "") -> None:
        doc = tmp_path / "ddp.md"
        rows = "".join(f"| `{name}` | `{default}` | meaning |\n" for name, default in table.items())
        doc.write_text(
            heading + rows + ("\n## Capabilities\n\n| `requests` | `batch` | |\n" if heading else "")
        )

        class Contract(PluginContract):
            distribution = "verl-ddp"
            options_docs = {"ddp": doc}

        registry = Registry.from_plugins(autoload=True)
        Contract().test_the_options_tables_document_every_option_with_its_default(registry)

    check(rows)
    with pytest.raises(AssertionError, match="the options table lists"):
        check({name: default for name, default in rows.items() if name != "static_graph"})
    with pytest.raises(AssertionError, match="`bucket_cap_mb` is documented as 8"):
        check({**rows, "bucket_cap_mb": "8"})
    # Under an "## Options" heading, the page's other tables are not read as options.
    check(rows, heading="# ddp\n\n## Options (`DDPConfig`)\n\n")
    with pytest.raises(AssertionError, match="the options table lists"):
        check(
            {name: default for name, default in rows.items() if name != "static_graph"},
            heading="## Options\n",
        )
