"""``verl_core.deprecation``: each way of deprecating warns with ``VerlCoreDeprecationWarning`` at the user's
line, once per call site, naming the replacement and the release that removes it, and keeps working."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings

import pytest

from verl_core import EngineBackend, deprecation
from verl_core.deprecation import (
    VerlCoreDeprecationWarning,
    VerlCoreRemovedIn04Warning,
    deprecated,
    deprecated_argument,
    moved_names,
)

pytestmark = pytest.mark.filterwarnings("default::verl_core.deprecation.VerlCoreDeprecationWarning")


@pytest.fixture(autouse=True)
def own_registry() -> dict:
    """The registry of declarations; what this module declares is taken out again after each test (a
    real module imported meanwhile keeps its declaration: the public-API test reads them)."""
    yield deprecation.DEPRECATIONS
    for what in [what for what in deprecation.DEPRECATIONS if __name__ in what or what.startswith("old.")]:
        del deprecation.DEPRECATIONS[what]


@pytest.fixture
def old() -> types.SimpleNamespace:
    @deprecated(since="0.2.0", removed_in="0.4.0", replacement="new_function")
    def old_function(x: int) -> int:
        return x + 1

    @deprecated(since="0.2.0", removed_in="0.4.0", replacement="NewClass")
    class OldClass:
        def __init__(self, value: int) -> None:
            self.value = value

    @deprecated_argument(
        "steps", since="0.2.0", removed_in="0.4.0", replacement="total_steps=", renamed_to="total_steps"
    )
    def schedule(*, total_steps: int = 1) -> int:
        return total_steps

    return types.SimpleNamespace(function=old_function, cls=OldClass, schedule=schedule)


def recorded(action) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own "once per call site"
        action()
    return [w for w in caught if issubclass(w.category, VerlCoreDeprecationWarning)]


def test_it_is_a_deprecation_warning_users_can_filter(old) -> None:
    assert issubclass(VerlCoreDeprecationWarning, DeprecationWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", VerlCoreDeprecationWarning)
        with pytest.raises(VerlCoreDeprecationWarning):
            old.function(1)
        warnings.simplefilter("ignore", VerlCoreDeprecationWarning)
        assert old.function(1) == 2


def test_functions_classes_and_arguments_warn_at_the_caller_and_keep_working(old) -> None:
    results = []
    caught = recorded(lambda: results.extend([old.function(1), old.cls(3).value, old.schedule(steps=5)]))
    assert results == [2, 3, 5]
    assert [w.filename for w in caught] == [__file__] * 3
    assert str(caught[0].message) == (
        f"{__name__}.old.<locals>.old_function is deprecated since verl-core 0.2.0 and will be removed in 0.4.0: "
        "use new_function instead"
    )
    assert "OldClass is deprecated" in str(caught[1].message)
    assert "argument 'steps' of" in str(caught[2].message) and "use total_steps= instead" in str(
        caught[2].message
    )
    with pytest.raises(TypeError, match="total_steps= only"):
        old.schedule(steps=1, total_steps=2)


def test_once_per_call_site(old) -> None:
    def twice_from_one_line() -> None:
        for _ in range(2):
            old.function(0)

    def another_site() -> int:
        return old.function(0)

    assert len(recorded(twice_from_one_line)) == 1
    assert len(recorded(lambda: (old.function(0), old.function(0)))) == 1  # one line, one site
    assert len(recorded(lambda: (old.function(0), another_site()))) == 2


def test_moved_names_serve_the_new_object_and_refuse_unknown_ones(own_registry) -> None:
    getattr_ = moved_names(
        "old.home", {"Thing": "verl_core.errors:ConfigError"}, since="0.2.0", removed_in="0.4.0"
    )
    from verl_core.errors import ConfigError

    caught = recorded(lambda: getattr_("Thing"))
    assert getattr_("Thing") is ConfigError
    assert "old.home.Thing is deprecated" in str(caught[0].message)
    assert "use verl_core.errors.ConfigError instead" in str(caught[0].message)
    with pytest.raises(AttributeError, match="old.home"):
        getattr_("Other")
    assert own_registry["old.home.Thing"].removed_in == "0.4.0"


def test_a_moved_module_keeps_every_name() -> None:
    import verl_core.distributed as new
    import verl_core.engine.distributed as old

    for name in new.__all__:
        caught = recorded(lambda name=name: getattr(old, name))
        assert getattr(old, name) is getattr(new, name)
        assert "use verl_core.distributed instead" in str(caught[0].message)
    with pytest.raises(AttributeError, match="moved to 'verl_core.distributed'"):
        old.no_such_name  # noqa: B018


def test_an_engine_backend_without_api_version_reads_as_1_with_a_warning() -> None:
    caught = recorded(lambda: EngineBackend(name="old", engine="m:E", config="m:C"))
    backend = EngineBackend(name="new", engine="m:E", config="m:C", api_version=1)
    assert backend.api_version == 1
    assert caught[0].filename == __file__, caught[0].filename  # the plugin's line, not attrs' __init__
    assert "EngineBackend without api_version" in str(caught[0].message)
    assert "api_version=1" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert EngineBackend(name="old", engine="m:E", config="m:C").api_version == 1


def run(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """A module (not ``__main__``, where Python shows every DeprecationWarning) that uses a moved name."""
    (tmp_path / "uses_old_name.py").write_text("import verl_core.engine.distributed as d\nd.barrier\n")
    return subprocess.run(
        [sys.executable, *flags, "-c", "import uses_old_name"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )


def test_shown_by_default_and_silenced_or_raised_by_the_users_filters(tmp_path) -> None:
    # Python hides DeprecationWarning outside __main__; core shows its own...
    shown = run(tmp_path)
    assert shown.returncode == 0 and "uses_old_name.py:2: VerlCoreRemovedIn04Warning" in shown.stderr, (
        shown.stderr
    )
    # ...unless the user configured warnings: then theirs decide.
    silenced = run(tmp_path, "-W", "ignore::DeprecationWarning")
    assert silenced.returncode == 0 and "RemovedIn04Warning" not in silenced.stderr, silenced.stderr
    raised = run(tmp_path, "-W", "error::DeprecationWarning")
    assert raised.returncode == 1 and "VerlCoreRemovedIn04Warning" in raised.stderr, raised.stderr


@pytest.mark.parametrize("category", [VerlCoreRemovedIn04Warning, VerlCoreDeprecationWarning])
def test_a_ci_makes_the_removals_of_one_release_errors_by_its_warning_class(category) -> None:
    """What ``pytest -W error::verl_core.deprecation.VerlCoreRemovedIn04Warning`` does (a plain
    ``python -W`` cannot name a class of an installed package: Python reads it before site-packages)."""
    import verl_core.engine.distributed as old

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", category=category)
        with pytest.raises(VerlCoreRemovedIn04Warning, match="removed in 0.4.0: use verl_core.distributed"):
            old.barrier  # noqa: B018


def test_another_releases_class_leaves_these_alone() -> None:
    import verl_core.engine.distributed as old

    class VerlCoreRemovedIn05Warning(VerlCoreDeprecationWarning):
        """Stands for a later release's class."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", category=VerlCoreRemovedIn05Warning)
        assert old.barrier is not None


def test_every_core_deprecation_is_of_its_removal_releases_class_and_a_release_without_one_is_refused() -> (
    None
):
    from fixtures.public_api import import_everything

    from verl_core.deprecation import DEPRECATIONS, REMOVAL_WARNINGS, declare

    import_everything()
    assert {d.removed_in: d.category for d in DEPRECATIONS.values()} == {"0.4.0": VerlCoreRemovedIn04Warning}
    assert issubclass(VerlCoreRemovedIn04Warning, VerlCoreDeprecationWarning)
    with pytest.raises(ValueError, match=r"no warning class for removal in 0.9.0 .*REMOVAL_WARNINGS"):
        declare("old.thing", since="0.2.0", removed_in="0.9.0", replacement="new.thing")
    assert "0.9.0" not in REMOVAL_WARNINGS


def test_a_plugin_deprecates_its_own_names_with_its_own_warning_class() -> None:
    from verl_core.errors import ConfigError

    class MyPluginDeprecationWarning(DeprecationWarning):
        pass

    getattr_ = moved_names(
        "old.my_plugin",
        {"Thing": "verl_core.errors:ConfigError"},
        since="1.1",
        removed_in="2.0",
        category=MyPluginDeprecationWarning,
    )
    with pytest.warns(MyPluginDeprecationWarning, match="removed in 2.0: use verl_core.errors.ConfigError"):
        assert getattr_("Thing") is ConfigError
