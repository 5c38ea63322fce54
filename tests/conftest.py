"""Session fixtures of core's tests, shared with the plugins' tests in one pytest process
(``fixtures.session``)."""

from __future__ import annotations

import signal

import pytest
from fixtures import session


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal delivers it. A pytest started in the background of a non-interactive shell
    (``nox ... &``, ``nohup``) inherits SIGINT ignored, which Python, ``verl-core`` and every process
    they start keep, as they should: the tests that stop runs with Ctrl-C (tests/test_everyday_faults.py,
    the CLI's stop line, a tool call) would fail for how pytest was started. Every process the tests
    start inherits this one's disposition (a handler becomes the default at ``exec``)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo's model and data with few rows (``fixtures.demo.build_small_demo``), built once."""
    return session.demo(tmp_path_factory)


@pytest.fixture(scope="session")
def ray_cluster():
    """The local Ray cluster every Ray test of the session runs in (started on first use)."""
    yield session.ray_cluster()
    session.stop_ray_cluster()
