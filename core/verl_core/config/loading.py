"""A run config from YAML files and dotted overrides, and back to YAML.

Files merge in order (mappings key by key; lists and scalars replaced), then each override sets one
value: ``actor.engine.optim.lr=1e-5``, ``ref.engine=null``, ``data.train_files=[a.jsonl, b.jsonl]``,
``data.train_files[2]=c.jsonl`` (the index just past the end appends). Values are YAML. Every value
remembers where it was set, so that an error (or a warning) names the file or the override to fix.
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import yaml

from verl_core.config import yaml_io
from verl_core.config.convert import join_path, structure_with_warnings, unstructure
from verl_core.config.engine import EngineConfig
from verl_core.config.run import RL_RULES, RunConfig
from verl_core.config.serve import ServeConfig
from verl_core.errors import ConfigError, ConfigWarning

if TYPE_CHECKING:
    from verl_core.plugins import Registry

#: ``ConfigError.source`` of malformed overrides.
OVERRIDES_SOURCE = "overrides"

Step = str | int
_KEY = re.compile(r"[\w\-]+(?:\[\d+\])*(?:\.[\w\-]+(?:\[\d+\])*)*")
_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


@attrs.frozen
class Override:
    """One ``key=value`` override: the key as steps (names and list indices) and the parsed value."""

    text: str
    steps: tuple[Step, ...]
    value: Any

    @property
    def path(self) -> str:
        return _format_path(self.steps)


def parse_override(text: str) -> Override:
    """Parse ``actor.engine.optim.lr=1e-5``; raises ``ValueError`` naming the override and the fix."""
    key, equals, value_text = text.partition("=")
    key = key.strip()
    if not equals:
        raise ValueError(f"override {text!r} has no '=': write key=value, e.g. actor.engine.optim.lr=1e-5")
    if not _KEY.fullmatch(key):
        raise ValueError(
            f"override {text!r}: {key!r} is not a dotted key such as actor.engine.optim.lr or "
            "data.train_files[0]"
        )
    try:
        value = yaml_io.load(value_text)
    except yaml.YAMLError as exc:
        message = yaml_io.syntax_error_message(exc)
        raise ValueError(f"override {text!r}: the value is not valid YAML ({message}); quote it") from None
    steps = tuple(int(index) if index else name for name, index in _STEP.findall(key))
    return Override(text, steps, value)


def looks_like_key(text: str) -> bool:
    """Whether ``text`` (given where a file or an override goes) reads as a dotted config key: it
    starts with a section of ``RunConfig`` (``actor.engine.optim.lr``) and is no ``.yaml`` file name."""
    if not _KEY.fullmatch(text) or text.lower().endswith((".yaml", ".yml")):
        return False
    sections = [field.name for field in attrs.fields(RunConfig)]
    return _STEP.match(text).group(1) in sections


def _format_path(steps: Iterable[Step]) -> str:
    path = ""
    for step in steps:
        path = join_path(path, f"[{step}]" if isinstance(step, int) else step)
    return path


def _is_below(path: str, ancestor: str) -> bool:
    return path.startswith(ancestor + ".") or path.startswith(ancestor + "[")


class _LayeredData:
    """Config data merged from several sources, with the source of every value set."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        #: Dotted path of each value set -> ``file.yaml`` or ``override 'key=value'``.
        self._origins: dict[str, str] = {}

    def merge(self, incoming: Mapping[str, Any], origin: str) -> None:
        self._merge_into(self.data, incoming, "", origin)

    def _merge_into(
        self, target: dict[str, Any], incoming: Mapping[str, Any], path: str, origin: str
    ) -> None:
        for key, value in incoming.items():
            here = join_path(path, str(key))
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                self._merge_into(target[key], value, here, origin)
            else:
                target[key] = copy.deepcopy(value)  # YAML aliases share objects; later changes must not
                self._record(here, value, origin)

    def apply(self, override: Override) -> None:
        """Set one value, creating the sections on the way; ``ValueError`` if the key cannot exist."""
        container: Any = self.data
        for position, step in enumerate(override.steps[:-1]):
            below = override.steps[position + 1]
            child = _get(container, step)
            if child is None:
                child = [] if isinstance(below, int) else {}
                _put(container, step, child, override)
            elif not isinstance(child, list if isinstance(below, int) else dict):
                kind = "a list" if isinstance(below, int) else "a section"
                where = _format_path(override.steps[: position + 1])
                raise ValueError(f"override {override.text!r}: {where} is {child!r}, not {kind}")
            container = child
        _put(container, override.steps[-1], copy.deepcopy(override.value), override)
        self._record(override.path, override.value, f"override {override.text!r}")

    def _record(self, path: str, value: Any, origin: str) -> None:
        for known in [known for known in self._origins if known == path or _is_below(known, path)]:
            del self._origins[known]
        if isinstance(value, dict) and value:
            for key, item in value.items():
                self._record(join_path(path, str(key)), item, origin)
        else:
            self._origins[path] = origin

    def origins_of(self, path: str) -> list[str]:
        """Where the value at ``path`` (or, for a section, the values in it) was set."""
        if not path:
            return []
        enclosing = [known for known in self._origins if known == path or _is_below(path, known)]
        if enclosing:
            return [self._origins[max(enclosing, key=len)]]
        return list(
            dict.fromkeys(origin for known, origin in self._origins.items() if _is_below(known, path))
        )


def _get(container: dict[str, Any] | list[Any], step: Step) -> Any:
    if isinstance(step, int):
        return container[step] if step < len(container) else None
    return container.get(step)


def _put(container: dict[str, Any] | list[Any], step: Step, value: Any, override: Override) -> None:
    if isinstance(container, dict):
        container[step] = value
    elif step < len(container):
        container[step] = value
    elif step == len(container):
        container.append(value)
    else:
        raise ValueError(
            f"override {override.text!r}: index {step} is past the end of a list of {len(container)} "
            f"item(s); use [{len(container)}] to append"
        )


def load_config(
    paths: Iterable[str | os.PathLike[str]] = (),
    overrides: Iterable[str] = (),
    *,
    registry: Registry | None = None,
    rl_rules: bool = True,
) -> RunConfig:
    """Merge the YAML files ``paths`` in order, apply ``overrides`` (``key=value``), structure.

    ``rl_rules=False`` (an SFT run's config) leaves out the RL trainer's cross-section rules
    (mini-batches dividing the batch, a group per prompt for group estimators, a critic for ``gae``).

    Raises ``ConfigError`` with every problem: each at its dotted path, naming the file
    (``source``) and, where another source set the value, that file or override.
    ``registry`` resolves backend and component names (default: the installed plugins). Options
    the run will ignore are issued as ``ConfigWarning`` s (``path: message``, where it was set).
    A decaying learning rate's ``optim.total_steps: 0`` stays 0 here: the trainer fills in the run's
    optimiser steps once it knows the run's length (``fill_total_steps``).
    """
    token = RL_RULES.set(rl_rules)
    try:
        return _load(paths, overrides, RunConfig, registry)
    finally:
        RL_RULES.reset(token)


def load_serve_config(
    paths: Iterable[str | os.PathLike[str]] = (),
    overrides: Iterable[str] = (),
    *,
    registry: Registry | None = None,
) -> ServeConfig:
    """``verl-core serve``'s config, as ``load_config`` loads a run's; ``engine.model`` defaults to
    the first base model's folder."""

    def default_model(data: dict[str, Any]) -> None:
        engine, models = data.get("engine"), data.get("base_models")
        if isinstance(engine, dict) and "model" not in engine and isinstance(models, dict) and models:
            engine["model"] = {"path": next(iter(models.values()))}

    return _load(paths, overrides, ServeConfig, registry, prepare=default_model)


def _load(
    paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str],
    overrides: Iterable[str] | str,
    cls: type[Any],
    registry: Registry | None,
    prepare: Any = None,
) -> Any:
    """``cls`` from the YAML files ``paths`` and ``overrides`` (``load_config``'s rules); ``prepare``
    may fill in defaults of the merged data first."""
    files = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    layers = _LayeredData()
    for file in files:
        layers.merge(yaml_io.load_file(file), file)

    override_errors = []
    for text in [overrides] if isinstance(overrides, str) else overrides:
        try:
            layers.apply(parse_override(text))
        except ValueError as exc:
            override_errors.append(("", str(exc)))
    if override_errors:
        raise ConfigError(override_errors, source=OVERRIDES_SOURCE)
    if prepare is not None:
        prepare(layers.data)

    named_by_source = files if len(files) == 1 else []

    def with_origin(path: str, message: str) -> str:
        origins = layers.origins_of(path)
        return f"{message} (from {', '.join(origins)})" if origins and origins != named_by_source else message

    source = ", ".join(files) or None
    try:
        config, ignored = structure_with_warnings(layers.data, cls, registry=registry)
    except ConfigError as exc:
        errors = [(path, with_origin(path, message)) for path, message in exc.errors]
        raise ConfigError(errors, source=source) from None
    for path, message in ignored:
        warnings.warn(ConfigWarning(f"{path}: {with_origin(path, message)}"), stacklevel=3)
    return config


#: The engine sections of a run, by path.
ENGINE_PATHS = ("actor.engine", "ref.engine", "critic.engine")


def fill_total_steps(
    config: RunConfig, total_steps: int | None = None, updates_per_step: int = 1
) -> RunConfig:
    """``config`` with ``optim.total_steps`` of each engine whose learning rate decays (``linear``,
    ``cosine``) and whose ``total_steps`` is 0 ("the run's length") set to the run's optimiser steps:
    ``total_steps`` trainer steps (default ``trainer.total_training_steps``; nothing is filled when
    neither is known) of ``updates_per_step`` optimiser steps each (the RL trainer's mini-batches
    times epochs; 1 for SFT). The trainers call it once they know the run's length. Raises
    ``ConfigError`` where the filled-in value leaves no decay after the warmup.
    """
    steps = config.trainer.total_training_steps if total_steps is None else total_steps
    if steps is None:
        return config
    steps *= updates_per_step
    errors = []
    for path in ENGINE_PATHS:
        section, name = path.split(".")
        engine: EngineConfig | None = getattr(getattr(config, section), name)
        if engine is None or engine.optim.lr_scheduler == "constant" or engine.optim.total_steps != 0:
            continue
        optim = attrs.evolve(engine.optim, total_steps=steps)
        errors += [
            (
                f"{path}.optim.{key}",
                f"{message}, filled in from the run's length for total_steps: 0 (its optimiser steps: "
                "trainer steps x updates per step)",
            )
            for key, message in optim.check()
        ]
        filled = attrs.evolve(getattr(config, section), **{name: attrs.evolve(engine, optim=optim)})
        config = attrs.evolve(config, **{section: filled})
    if errors:
        raise ConfigError(errors)
    return config


def dump_yaml(obj: Any) -> str:
    """YAML text for a config object (or plain data) that ``load_config`` reads back unchanged."""
    return yaml_io.dump(unstructure(obj) if attrs.has(type(obj)) else obj)
