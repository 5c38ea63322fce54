"""Everything about a run that can be checked before a worker starts, reported all at once.

``verl-core config`` runs these checks, and so do ``verl-core train`` / ``sft`` (through the trainers'
``from_config``) before Ray or an engine starts: a missing file, a model folder that is not one, a
tokenizer larger than the model's vocabulary, truncated weights, an engine backend whose engine does
not import or whose options the model or the world size cannot take (``BaseEngine.check_before_start``),
an unwritable or another run's checkpoint folder, a logger whose package is not installed. Each problem
is ``(key, message)``, the key being the config key to fix, as ``ConfigError`` reports it. Reading is
cheap on purpose: file headers, the first rows of a dataset, ``config.json``; the models themselves are
loaded by the engines.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from verl_core.config.engine import EngineConfig, ModelConfig
from verl_core.config.run import RunConfig
from verl_core.config.validators import each_rule
from verl_core.data.files import read_file
from verl_core.errors import CheckpointError, ConfigError, DataError, VerlCoreError
from verl_core.hookspecs import Kind
from verl_core.toolkit.integrity import file_problem
from verl_core.trainer import checkpoints

if TYPE_CHECKING:
    from verl_core.plugins import Registry

#: Which trainer a config is for: ``verl-core train`` (``rl``) or ``verl-core sft``.
TrainerKind = Literal["rl", "sft"]
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def preflight(config: RunConfig, kind: TrainerKind, registry: Registry | None = None) -> None:
    """Raise a ``ConfigError`` listing every problem ``check_run`` finds; nothing when there is none."""
    problems = list(check_run(config, kind, registry))
    if problems:
        raise ConfigError(problems)


def check_run(
    config: RunConfig, kind: TrainerKind, registry: Registry | None = None
) -> Iterator[tuple[str, str]]:
    """Every problem of ``config`` for the ``kind`` of run, each rule independent of the others;
    ``registry`` resolves the backends (default: the installed plugins)."""
    from verl_core.plugins.registry import registry_or_installed

    registry = registry_or_installed(registry)
    yield from each_rule(
        lambda: _datasets(config, kind),
        lambda: _models(config, kind),
        lambda: _engines(config, registry),
        lambda: _rollout(config, kind, registry),
        lambda: _environment_options(config, kind, registry),
        lambda: _adapters(config, registry),
        lambda: _teachers(config, kind, registry),
        lambda: _checkpoint_dir(config, kind),
        lambda: _writable("trainer.run_dir", config.trainer.run_dir),
        lambda: _loggers(config, registry),
    )


def trainer_kind(config: RunConfig) -> TrainerKind:
    """``data_kind``, and ``rl`` when the data cannot tell."""
    return data_kind(config) or "rl"


def data_kind(config: RunConfig) -> TrainerKind | None:
    """``sft`` when the first row of ``data.train_files`` has a ``data.response_key`` column (the
    prompt/response pairs ``verl-core sft`` trains on), ``rl`` when it has not; ``None`` when there is
    no first row to read (no file, a missing or unreadable one, an empty one): then the data cannot
    tell, and ``verl-core config`` guesses from the rules the config meets."""
    if not config.data.train_files:
        return None
    try:
        first = read_file(config.data.train_files[0], "data.train_files[0]")[0]
    except (DataError, IndexError):
        return None  # the file's own problem is reported by the checks
    return "sft" if config.data.response_key in first else "rl"


# -- datasets -------------------------------------------------------------------------------------------


def _datasets(config: RunConfig, kind: TrainerKind) -> Iterator[tuple[str, str]]:
    data = config.data
    columns = [data.prompt_key] + ([data.response_key] if kind == "sft" else [])
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        if not files and key == "data.train_files":
            yield key, "is empty: list the dataset files (data.train_files=[train.jsonl])"
        for index, path in enumerate(files):
            try:
                rows = read_file(path, f"{key}[{index}]")
            except DataError as error:
                yield f"{key}[{index}]", _without_key(str(error), f"{key}[{index}]")
                continue
            if not rows:
                yield f"{key}[{index}]", f"'{path}' holds no rows: add rows, or leave the file out"
                continue
            first = rows[0]
            missing = [column for column in columns if column not in first]
            if missing:
                yield (
                    f"{key}[{index}]",
                    f"'{path}' has no column {missing[0]!r} (its rows have {sorted(first)}): set "
                    f"data.{'prompt_key' if missing[0] == data.prompt_key else 'response_key'} to the column "
                    "that holds it",
                )


def _without_key(message: str, key: str) -> str:
    """A ``DataError``'s message without the key it starts with (``ConfigError`` adds it back)."""
    return message.removeprefix(f"{key}: ").removeprefix(f"{key} ")


# -- models ---------------------------------------------------------------------------------------------


def _engine_sections(config: RunConfig) -> dict[str, EngineConfig]:
    """Each engine section the run builds (the reference only with a KL term), by its config path."""
    sections = {"actor.engine": config.actor.engine}
    if config.uses_kl and config.ref.engine is not None:
        sections["ref.engine"] = config.ref.engine
    if config.critic.enable and config.critic.engine is not None:
        sections["critic.engine"] = config.critic.engine
    for name, teacher in config.distillation.teachers.items():
        sections[f"distillation.teachers.{name}.engine"] = teacher.engine
    return sections


def _model_paths(config: RunConfig) -> dict[str, str]:
    """Each engine section the run builds -> its model folder."""
    return {f"{where}.model.path": engine.model.path for where, engine in _engine_sections(config).items()}


def _engines(config: RunConfig, registry: Registry) -> Iterator[tuple[str, str]]:
    """Each engine backend the run uses, its engine class imported here on the driver (every rank
    imports it at start-up: one that does not import is refused now, at the key that chose it), then
    asked what the model's config.json and the run's world size tell about its section
    (``BaseEngine.check_before_start``: attention heads per sequence-parallel rank, say)."""
    from verl_core.engine.factory import load_engine_class

    world_size = _world_size(config)
    for where, engine in _engine_sections(config).items():
        key = f"{where}.backend"
        try:
            entry = registry.entry(Kind.ENGINE_BACKENDS, engine.backend, where=key)
        except VerlCoreError:  # an unknown or unusable backend: the config load reports it
            continue
        try:
            engine_class = load_engine_class(entry)
        except VerlCoreError as error:  # naming the plugin, its distribution and the import string
            yield key, str(error)
            continue
        model_config = _model_config(engine.model.path)
        if model_config is None:  # the model folder's own problem: reported by the model checks
            continue
        check = engine_class.check_before_start
        try:
            yield from check(
                engine,
                role="value" if where == "critic.engine" else "lm",
                model_config=model_config,
                world_size=world_size,
                config_path=where,
            )
        except ConfigError as error:
            yield from error.errors
        except Exception as error:  # a bug in the plugin's check: named, not a traceback
            yield (
                key,
                f"engine backend '{entry.name}' from {entry.provider}: {engine_class.__qualname__}."
                f"check_before_start raised {type(error).__name__}: {error}; fix or upgrade the plugin",
            )


def _environment_options(
    config: RunConfig, kind: TrainerKind, registry: Registry
) -> Iterator[tuple[str, str]]:
    """``rollout.agent.options`` against the options class of the environment's descriptor (an
    adapter's server ``url`` or ``command``): each wrong key named, before anything starts. Whether the
    server answers is checked when the trainer starts the environment (``build_agent_loop``)."""
    agent = config.rollout.agent
    if kind != "rl" or agent.environment is None:
        return
    from verl_core.agents.session import ENVIRONMENT_KEY, environment_options

    try:
        entry = registry.entry(Kind.ENVIRONMENTS, agent.environment, where=ENVIRONMENT_KEY)
    except VerlCoreError:  # an unknown or unavailable environment: the config load reports it
        return
    try:
        environment_options(entry, agent)
    except ConfigError as error:
        yield from error.errors
    except VerlCoreError as error:  # the options class does not import: naming the plugin
        yield "rollout.agent.options", str(error)


def _rollout(config: RunConfig, kind: TrainerKind, registry: Registry) -> Iterator[tuple[str, str]]:
    """The rollout backend of an RL run: its rollout class imported here on the driver (a backend whose
    class does not import is refused at ``rollout.backend``), then asked what the model, the world size
    and the batch tell about its section (``BaseRollout.check_before_start``: a maximum length below
    prompt plus response, a cache too small for the batch, an architecture it cannot load)."""
    if kind != "rl":
        return
    key = "rollout.backend"
    try:
        entry = registry.entry(Kind.ROLLOUT_BACKENDS, config.rollout.backend, where=key)
    except VerlCoreError:  # an unknown or unusable backend: the config load reports it
        return
    try:
        rollout_class = entry.load("rollout")
    except VerlCoreError as error:  # naming the plugin, its distribution and the import string
        yield key, str(error)
        return
    model_config = _model_config(config.rollout_model.path)
    if model_config is None:  # the model folder's own problem: reported by the model checks
        return
    try:
        yield from rollout_class.check_before_start(
            config.rollout,
            model=config.rollout_model,
            model_config=model_config,
            world_size=_world_size(config),
            batch_size=config.data.train_batch_size,
            config_path="rollout",
        )
    except ConfigError as error:
        yield from error.errors
    except Exception as error:  # a bug in the plugin's check: named, not a traceback
        yield (
            key,
            f"rollout backend '{entry.name}' from {entry.provider}: {rollout_class.__qualname__}."
            f"check_before_start raised {type(error).__name__}: {error}; fix or upgrade the plugin",
        )


def _world_size(config: RunConfig) -> int:
    """The ranks each role's engines (and the actor's rollouts) run on."""
    return config.trainer.world_size if config.trainer.workers == "ray" else 1


def _model_config(path: str) -> dict[str, Any] | None:
    """The model folder's config.json; ``None`` when it cannot be read (``_models`` says why)."""
    from verl_core.toolkit.export import HF_CONFIG_FILE

    try:
        model_config = json.loads((Path(path).expanduser() / HF_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return model_config if isinstance(model_config, dict) else None


def _adapters(config: RunConfig, registry: Registry) -> Iterator[tuple[str, str]]:
    """What the engines ask of their backends (LoRA, shared prompts: ``EngineBackend`` declares them),
    and the adapters the engines start from (``model.lora_adapter_path``)."""
    from verl_core.engine.factory import capability_refusals

    for where, engine in _engine_sections(config).items():
        try:
            yield from capability_refusals(engine, registry, where)
        except VerlCoreError:  # the backend cannot be used: the config load reports why
            pass
        if engine.model.lora:
            yield from _adapter_fits_the_model(engine.model, f"{where}.model")


def _teachers(config: RunConfig, kind: TrainerKind, registry: Registry) -> Iterator[tuple[str, str]]:
    """What distillation asks of its teachers and of the student: the student's tokenizer (the
    student's token ids are scored by the teacher, and GKD compares both over the teacher's token ids),
    ``top_k`` within the vocabulary and a backend that returns top-k log-probs (the student's too, which
    returns its log-probs at the teacher's ids), and a routing column that every training row has,
    naming a configured teacher."""
    distillation = config.distillation
    if kind != "rl" or not distillation.enabled:
        return
    from verl_core.trainer.build import load_tokenizer

    student = _model_config(config.actor.engine.model.path)
    student_vocabulary = None if student is None else student.get("vocab_size")
    try:
        student_tokenizer = load_tokenizer(config.actor.engine.model)  # once, for every teacher
    except ConfigError:  # the student's tokenizer's own problem: reported by the model checks
        student_tokenizer = None
    for name, teacher in distillation.teachers.items():
        where = f"distillation.teachers.{name}"
        if student_tokenizer is not None:
            yield from _same_tokenizer(student_tokenizer, teacher.engine.model, f"{where}.engine.model.path")
        teacher_config = _model_config(teacher.engine.model.path)
        vocabulary = None if teacher_config is None else teacher_config.get("vocab_size")
        if isinstance(vocabulary, int) and teacher.top_k > vocabulary:
            yield (
                f"{where}.top_k",
                f"{teacher.top_k} is more than the teacher's vocabulary ({vocabulary} tokens, config.json "
                "vocab_size): set it to at most that (a few dozen suffice: GKD counts the rest as one outcome)",
            )
        if (
            teacher.top_k
            and isinstance(vocabulary, int)
            and isinstance(student_vocabulary, int)
            and vocabulary > student_vocabulary
        ):
            yield (
                f"{where}.engine.model.path",
                f"the teacher's vocabulary ({vocabulary} tokens) is larger than the student's "
                f"({student_vocabulary}, actor.engine.model.path): its top-k ids could name tokens the student "
                "has no logits for; use a teacher with the student's vocabulary, or distillation.loss=reverse_kl",
            )
        if teacher.top_k:
            yield from _returns_top_k(
                teacher.engine, registry, f"{where}.top_k", "the teacher's top-k tokens"
            )
    if distillation.loss == "gkd":
        yield from _returns_top_k(
            config.actor.engine,
            registry,
            "actor.engine.backend",
            "the student's log-probs at the teacher's top-k ids",
        )
    if distillation.route_by is not None:
        yield from _routes(config)


def _returns_top_k(
    engine: EngineConfig, registry: Registry, key: str, what: str
) -> Iterator[tuple[str, str]]:
    try:
        entry = registry.entry(Kind.ENGINE_BACKENDS, engine.backend)
    except VerlCoreError:  # an unknown or unusable backend: the config load reports it
        return
    if not entry.descriptor.top_k_log_probs:
        from verl_core.engine.factory import declaring_backends

        declaring = declaring_backends(registry, "top_k_log_probs")
        yield (
            key,
            f"engine backend '{engine.backend}' ({entry.provider}) does not declare "
            f"EngineBackend(top_k_log_probs=True), which {what} need: choose a backend that does "
            f"({', '.join(declaring) or 'none is installed'}), or distillation.loss=reverse_kl",
        )


def _same_tokenizer(student: Any, teacher: ModelConfig, key: str) -> Iterator[tuple[str, str]]:
    """The teacher's tokenizer against the ``student``'s: the same vocabulary (every token, same id) and
    the same special tokens. Cross-tokenizer distillation is out of scope (docs/distillation.md)."""
    from verl_core.trainer.build import load_tokenizer

    try:
        theirs = load_tokenizer(teacher)
    except ConfigError as error:
        yield key, "; ".join(message for _, message in error.errors)
        return
    difference = tokenizer_difference(student, theirs)
    if difference is not None:
        yield (
            key,
            f"the teacher's tokenizer is not the student's (actor.engine.model.path): {difference}; "
            "distillation compares the two models token by token, so they need one tokenizer (cross-tokenizer "
            "distillation is not supported: docs/distillation.md)",
        )


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """The first difference between two tokenizers that would make token ids mean different things
    (vocabulary size, a token's id, a special token), or ``None``."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if len(ours) != len(theirs):
        return f"{len(theirs)} tokens against the student's {len(ours)}"
    for token, index in sorted(ours.items(), key=lambda item: item[1]):
        if theirs.get(token) != index:
            return f"token {token!r} is id {theirs.get(token)} for the teacher, {index} for the student"
    for special in ("bos_token_id", "eos_token_id"):
        if getattr(student, special) != getattr(teacher, special):
            return f"{special} {getattr(teacher, special)} against the student's {getattr(student, special)}"
    return None


def _routes(config: RunConfig) -> Iterator[tuple[str, str]]:
    """Every training row names a configured teacher in the ``distillation.route_by`` column."""
    column, teachers = config.distillation.route_by, config.distillation.teachers
    for index, path in enumerate(config.data.train_files):
        try:
            rows = read_file(path, f"data.train_files[{index}]")
        except DataError:  # the file's own problem: reported by the dataset checks
            continue
        for number, row in enumerate(rows):
            if column not in row:
                yield (
                    "distillation.route_by",
                    f"row {number} of '{path}' has no column {column!r} (its columns: {sorted(row)}): add it to "
                    "every row, or route by a column the data has",
                )
                break
            if row[column] not in teachers:
                yield (
                    "distillation.route_by",
                    f"row {number} of '{path}' routes to {row[column]!r}, which is not a teacher "
                    f"(distillation.teachers: {', '.join(teachers)}): add that teacher, or fix the row",
                )
                break


def _adapter_fits_the_model(model: ModelConfig, where: str) -> Iterator[tuple[str, str]]:
    """The adapter against the layers of the model's architecture, built on the meta device from its
    config.json (no weights read): ``model.target_modules`` name layers it has (``all-linear`` fits every
    model), or the adapter at ``lora_adapter_path`` is whole and was trained for this model."""
    from verl_core.toolkit.lora import (
        ALL_LINEAR,
        adapter_dir_problems,
        adapter_shape_problems,
        check_target_modules,
    )
    from verl_core.toolkit.model import load_hf_model

    adapter_path = model.lora_adapter_path
    if adapter_path is not None and (problems := adapter_dir_problems(adapter_path)):
        yield f"{where}.lora_adapter_path", "; ".join(problems)
        return
    if adapter_path is None and model.target_modules == ALL_LINEAR:
        return
    try:
        skeleton = load_hf_model(model, where=where, on_meta=True)
    except Exception:  # the model folder's own problem: reported by the model checks
        return
    if adapter_path is not None:  # a loaded adapter brings its own target modules
        yield from (
            (f"{where}.lora_adapter_path", problem)
            for problem in adapter_shape_problems(adapter_path, skeleton)
        )
        return
    try:
        check_target_modules(skeleton, model.target_modules, f"{where}.target_modules")
    except ConfigError as error:
        yield from error.errors


def _models(config: RunConfig, kind: TrainerKind) -> Iterator[tuple[str, str]]:
    from verl_core.toolkit.export import HF_CONFIG_FILE
    from verl_core.toolkit.model import check_model_dir

    tokenizer_size = None
    for key, path in _model_paths(config).items():
        try:
            directory = check_model_dir(path, key)
        except ConfigError as error:
            yield from error.errors
            continue
        try:
            model_config = json.loads((directory / HF_CONFIG_FILE).read_text())
        except (OSError, ValueError) as error:
            yield key, f"{directory / HF_CONFIG_FILE} cannot be read as JSON ({error}): save the model again"
            continue
        yield from _weights(key, directory)
        if key == "actor.engine.model.path":  # the run's tokenizer: the policy's (trainer.build)
            tokenizer_size = yield from _tokenizer(config, key)
        vocabulary = model_config.get("vocab_size")
        if tokenizer_size and isinstance(vocabulary, int) and tokenizer_size > vocabulary:
            yield (
                key,
                f"the tokenizer (actor.engine.model.path) has {tokenizer_size} tokens but {directory}'s "
                f"vocabulary has {vocabulary} (config.json vocab_size): ids from {vocabulary} on would index "
                "past the embedding; use the tokenizer saved with this model, or resize its embeddings "
                "(model.resize_token_embeddings(len(tokenizer))) and save it again",
            )


def _tokenizer(config: RunConfig, key: str) -> Iterator[tuple[str, str]]:
    """The problems of the run's tokenizer; returns its size (None when it cannot load)."""
    from verl_core.trainer.build import load_tokenizer

    try:
        tokenizer = load_tokenizer(config.actor.engine.model)
    except ConfigError as error:
        yield from error.errors
        return None
    return len(tokenizer)


def _weights(key: str, directory: Path) -> Iterator[tuple[str, str]]:
    """Weight files that are missing or cut short: their headers (or zip directories) are read, not
    their tensors."""
    indexes = [directory / name for name in WEIGHT_INDEXES if (directory / name).is_file()]
    files: list[Path] = []
    for index in indexes:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as error:
            yield (
                key,
                f"{index} is not a weight index ({type(error).__name__}: {error}): save the model again",
            )
            continue
        for shard in shards:
            if not (directory / shard).is_file():
                yield key, f"{index.name} lists {shard}, which is missing from {directory}: copy it again"
            else:
                files.append(directory / shard)
    if not indexes:
        files = [
            path
            for pattern in ("*.safetensors", "pytorch_model*.bin")
            for path in sorted(directory.glob(pattern))
        ]
        if not files:
            yield (
                key,
                f"{directory} holds no weights (*.safetensors or pytorch_model.bin): save the model again",
            )
    for path in files:
        problem = file_problem(path)
        if problem:
            yield (
                key,
                f"{path} {problem}: the file is damaged or was cut short (copy it again, or save the model again)",
            )


# -- folders --------------------------------------------------------------------------------------------


def _checkpoint_dir(config: RunConfig, kind: TrainerKind) -> Iterator[tuple[str, str]]:
    trainer = config.trainer
    if trainer.save_freq:
        yield from _writable("trainer.checkpoint_dir", trainer.checkpoint_dir)
    yield from checkpoints.checkpoint_dir_problems(trainer, kind)
    if trainer.resume_mode == "resume_path" and trainer.resume_from_path:
        try:
            path = checkpoints.resume_point(trainer)  # complete, and every piece a resume needs whole
        except CheckpointError as error:  # naming the folder and what is wrong with it
            yield "trainer.resume_from_path", str(error)
        else:
            yield from checkpoints.engine_problems(config, path)


def _writable(key: str, path: str) -> Iterator[tuple[str, str]]:
    """``path`` is a folder this process can create files in, or can be created as one."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        yield key, f"{path!r} is a file, not a folder: give a folder (it is created if missing)"
        return
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        yield key, f"{path!r} cannot be created: {existing} is a file"
        return
    # Creating something is the only test that holds for root too (os.access says yes to root on a
    # read-only mount or in /proc); a folder made and removed at once changes nothing.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".verl-core-probe-", dir=existing))
    except OSError as error:
        yield (
            key,
            f"{path!r} is not writable ({existing}: {error.strerror}): choose a folder you can write to",
        )


# -- optional packages ----------------------------------------------------------------------------------


def _loggers(config: RunConfig, registry: Registry) -> Iterator[tuple[str, str]]:
    """Each sink of ``trainer.logger`` the registry refuses: an unknown name, or a sink whose package is
    not installed (its descriptor's ``requires``), with the pip command that installs it."""
    for logger in config.trainer.logger:
        try:
            registry.entry(Kind.METRIC_SINKS, logger, where="trainer.logger")
        except VerlCoreError as error:
            yield (
                "trainer.logger",
                " ".join(str(error).splitlines()) + f", or leave {logger!r} out of trainer.logger",
            )


#: Why ``verl-core config`` checked a config as it did, when the data told it.
_KIND_REASONS = {
    "sft": "the rows of data.train_files have the data.response_key column",
    "rl": "no data.response_key column in data.train_files",
}


def describe_kind(kind: TrainerKind, detected: bool, told_by_data: bool = True) -> str:
    """One line saying which trainer a config was checked for, and why: ``detected`` from the data
    (``data_kind``), or, when the data could not be read (``told_by_data=False``), from the rules the
    config meets: an SFT config need not follow the RL trainer's, so one that breaks them is taken for
    an SFT config rather than reported for them."""
    command = "verl-core sft" if kind == "sft" else "verl-core train"
    if not detected:
        return f"checked as a config for `{command}`"
    if told_by_data:
        return f"checked as a config for `{command}` ({_KIND_REASONS[kind]})"
    unread = "data.train_files[0] cannot be read to tell an SFT config from an RL one"
    if kind == "sft":
        return (
            f"checked as a config for `{command}`: {unread}, and this one breaks the rules of "
            "`verl-core train` (--for train lists them); once the data is there the check tells them apart"
        )
    return f"checked as a config for `{command}`: {unread} (--for sft checks it for `verl-core sft`)"
