"""Session fixtures of core's tests, shared with the plugins' tests in one pytest process
(``fixtures.session``)."""

from __future__ import annotations

import pytest
from fixtures import session


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo's model and data with few rows (``fixtures.demo.build_small_demo``), built once."""
    return session.demo(tmp_path_factory)


@pytest.fixture(scope="session")
def ray_cluster():
    """The local Ray cluster every Ray test of the session runs in (started on first use)."""
    yield session.ray_cluster()
    session.stop_ray_cluster()
