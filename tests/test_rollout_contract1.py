"""A rollout plugin written for rollout contract 1 keeps working under contract 2, unchanged.

The plugin is ``fixtures.contract1_rollout``: the worked example of docs/plugins.md as it stood before
contract 2, unedited but for its package name. Under warnings-as-errors for everything except
``VerlCoreDeprecationWarning`` it registers (its descriptor, without ``api_version``, reads as rollout
API version 1 with the default capabilities, and the warning names the plugin) and passes the
contract-2 rollout kit: ``requests``, ``resume``, ``request_isolation``, ``stopping`` and
``weight_buckets`` through ``BaseRollout``'s defaults, the checks of capabilities it does not declare
(``abort_resume``, ``prefix_caching``, ``sleep``) skipped, each saying why.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from verl_core import RolloutCapabilities
from verl_core.deprecation import VerlCoreDeprecationWarning
from verl_core.plugins import Kind, Registry
from verl_core.testing import ROLLOUT_CHECKS, run_rollout_conformance

pytestmark = pytest.mark.filterwarnings("error", "default::verl_core.deprecation.VerlCoreDeprecationWarning")

PACKAGE = "fixtures.contract1_rollout"
PLUGIN = f"{PACKAGE}.plugin"
#: The checks of capabilities a contract-1 rollout does not declare.
SKIPPED = ("abort_resume", "prefix_caching", "sleep")

torch.set_num_threads(1)


def fresh_plugin_import() -> object:
    """The fixture's modules imported anew, so that import-time warnings fire again."""
    for name in [name for name in sys.modules if name.startswith(PACKAGE)]:
        del sys.modules[name]
    return __import__(PLUGIN, fromlist=["_"])


def test_it_registers_as_rollout_api_version_1_warning_only_about_the_unstated_version() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        warnings.simplefilter("always", VerlCoreDeprecationWarning)
        registry = Registry.from_plugins([fresh_plugin_import()], autoload=False)
    descriptor = registry.get(Kind.ROLLOUT_BACKENDS, "hf-generate")
    assert descriptor.api_version == 1 and descriptor.capabilities == RolloutCapabilities()
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1, messages
    assert "rollout backend 'hf-generate': RolloutBackend without api_version is deprecated" in messages[0]
    assert messages[0].startswith(f"plugin '{PLUGIN}'"), messages[0]


def test_it_passes_the_contract_2_kit_through_the_defaults() -> None:
    report = run_rollout_conformance("hf-generate", plugins=[fresh_plugin_import()], autoload=False)
    statuses = {name: outcome.status for name, outcome in report.outcomes.items()}
    assert statuses == {name: "skipped" if name in SKIPPED else "passed" for name in ROLLOUT_CHECKS}, (
        report.summary()
    )
    for name in SKIPPED:
        assert "backend 'hf-generate' declares" in report[name].describe(), report[name].describe()
