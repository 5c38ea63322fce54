"""Fixtures shared by the vLLM plugin's tests.

Each test module that starts an engine starts one (vLLM's import and an engine start are most of
their time) and shuts it down before the next module's. Modules that need vLLM skip, saying so, where
it is not installed; they look for it without importing it (vLLM's import patches torch for the rest
of the process, so it happens in the tests that use it, not while pytest collects).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures import session


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo's small assets, the ones core's tests use (tests/fixtures/session.py): its model's
    attention heads have 16 dimensions, too few for vLLM's CPU attention."""
    return session.demo(tmp_path_factory)


@pytest.fixture(scope="session")
def wide_demo(tmp_path_factory):
    """The demo's small assets with a model of 2 attention heads of 32 dimensions (1 KV head), which
    vLLM's CPU attention runs: ``fixtures.demo.build_small_demo``'s rows, another model shape."""
    from fixtures.demo import make_demo_module

    make_demo = make_demo_module()
    task = make_demo.TaskSpec(min_digits=3, max_digits=4, sft_size=16, train_size=32, val_size=8)
    spec = make_demo.ModelSpec(num_attention_heads=2, num_key_value_heads=1)
    return make_demo.build_demo(
        Path(tmp_path_factory.mktemp("wide-demo")), seed=0, task=task, model_spec=spec
    )
