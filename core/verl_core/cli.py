"""The ``verl-core`` command (also ``python -m verl_core``).

``verl-core plugins`` lists the installed plugins and what they provide, broken ones included; it
imports no torch, cattrs, yaml or backend so that it answers fast. ``verl-core config`` prints a
fully resolved configuration as YAML, or every validation error. ``verl-core plot`` redraws a run's
curves from its metrics file. ``verl-core serve`` serves Tinker's API over local models.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verl_core import __version__
from verl_core.errors import PluginWarning, VerlCoreError
from verl_core.hookspecs import Kind
from verl_core.plugins import get_registry, messages
from verl_core.plugins.table import (
    BACKEND_COLUMNS,
    backend_rows,
    columns_of,
    entry_rows,
    format_table,
    problem_notes,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on usage errors (2) and after --help (0)
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader went away (`verl-core plugins | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-core", description="Plugin-extensible RL post-training.")
    parser.add_argument(
        "--version", action="version", version=f"verl-core {__version__} ({messages.spoken_api_versions()})"
    )
    parser.set_defaults(run=None)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    plugins = commands.add_parser(
        "plugins",
        help="list installed plugins and their engine backends",
        description="List every plugin (broken and blocked ones too) with its engine backends. "
        "Exits 0 even when some plugin is broken: this is a diagnostic.",
    )
    plugins.add_argument("--json", action="store_true", help="print the rows as JSON")
    plugins.add_argument(
        "--all", action="store_true", help="also list advantage estimators, policy losses, rollouts, rewards"
    )
    plugins.set_defaults(run=_run_plugins)

    config = commands.add_parser(
        "config",
        help="check a configuration and print it fully resolved as YAML",
        description="Merge the YAML FILES in order, apply the dotted overrides, validate (every "
        "component name resolved) and run every check that needs no worker (dataset files, model "
        "folders and their weights and tokenizer, the checkpoint and run folders, optional packages), "
        "then print the result as YAML; on invalid input print every error and exit 2. Options the run "
        "will ignore are printed as warnings on stderr (exit 0). Positional arguments containing '=' are "
        "overrides; -o overrides apply after them. A config is checked for `verl-core sft` when the rows "
        "of data.train_files have the data.response_key column, else for `verl-core train` (--for says).",
    )
    _add_config_arguments(config)
    config.add_argument(
        "--for",
        dest="for_command",
        choices=("train", "sft"),
        help="check the config for this command instead of telling it from the training data",
    )
    config.add_argument(
        "--no-file-checks",
        action="store_true",
        help="skip the checks of files, folders and installed packages (a config for another machine); "
        "keys, values, component names and the rules between them are still checked",
    )
    config.set_defaults(run=_run_config)

    train = commands.add_parser(
        "train",
        help="train with RL (GRPO, PPO, ...) as the configuration says",
        description="Load the configuration like `verl-core config` (every error reported before "
        "anything starts), then train: generate, score, update, validate and checkpoint every step. "
        "Resumes from the newest checkpoint in trainer.checkpoint_dir (trainer.resume_mode: auto). "
        "Exit 2: invalid input; 1: the run failed; 0: done.",
    )
    _add_config_arguments(train)
    train.set_defaults(run=_run_train)

    sft = commands.add_parser(
        "sft",
        help="supervised fine-tuning on prompt/response pairs as the configuration says",
        description="Load the configuration like `verl-core config`, then fine-tune actor.engine's model "
        "on the responses of data.train_files (a prompt and a response column), validating the loss on "
        "data.val_files and checkpointing like `verl-core train`; the Hugging Face export in "
        "RUN_DIR/hf_model is an RL run's starting model. Resumes from the newest checkpoint in "
        "trainer.checkpoint_dir (trainer.resume_mode: auto). Exit 2: invalid input; 1: the run failed; "
        "0: done.",
    )
    _add_config_arguments(sft)
    sft.set_defaults(run=_run_sft)

    plot = commands.add_parser(
        "plot",
        help="redraw a run's curves (reward, validation score, losses) into RUN_DIR/curves.png, or "
        "compare several runs' validation scores",
        description="Read RUN_DIR/metrics.jsonl and draw the training reward, validation score and "
        "loss curves into RUN_DIR/curves.png (a panel whose metrics the run did not log is left out); "
        "print the PNG's path. Works during a run too. With several RUN_DIRs, draw their validation "
        "scores side by side against the step and against the training seconds into --out. Exits 2 "
        "with the reason when there is nothing to draw.",
    )
    plot.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="the run folder, which holds metrics.jsonl"
    )
    plot.add_argument(
        "--out",
        default="comparison.png",
        help="with several RUN_DIRs, the comparison's PNG (default: comparison.png)",
    )
    plot.set_defaults(run=_run_plot)

    serve = commands.add_parser(
        "serve",
        help="serve Tinker's API over local models, for the tinker client and tinker-cookbook's loops",
        description="Load the serve config (FILES and dotted overrides, as `verl-core config`; every "
        "error reported before anything starts), then answer the tinker client on host:port (loopback "
        "by default) for clients that send the token, training and sampling the base models of the "
        "config, with states under state_dir (docs/embedding.md, 'Serving the Tinker API'). Prints "
        "`verl-core serve: listening on http://HOST:PORT` once ready; stops on Ctrl-C or SIGTERM. "
        "Exit 2: invalid input; 0: stopped.",
    )
    _add_config_arguments(serve)
    serve.set_defaults(run=_run_serve)
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The run config's YAML files and dotted overrides, as ``config`` and ``train`` take them."""
    parser.add_argument("items", nargs="*", metavar="FILE|KEY=VALUE", help="YAML files and dotted overrides")
    parser.add_argument(
        "-o", "--override", action="append", default=[], metavar="KEY=VALUE", help="a dotted override"
    )


# -- verl-core plugins ----------------------------------------------------------------------------


def _run_plugins(args: argparse.Namespace) -> int:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PluginWarning)
            registry = get_registry()
    except VerlCoreError as error:  # an invalid environment switch
        print(f"error: {error}", file=sys.stderr)
        return 2
    for warning in caught:  # a block-list entry that names nothing installed, say
        print(f"warning: {warning.message}", file=sys.stderr)
    tables = {Kind.ENGINE_BACKENDS: backend_rows(registry)}
    if args.all:
        tables.update(
            {kind: entry_rows(registry, kind) for kind in registry.kinds if kind != Kind.ENGINE_BACKENDS}
        )
    if args.json:
        document = tables if args.all else tables[Kind.ENGINE_BACKENDS]
        print(json.dumps(document, indent=2))
        return 0
    blocks = [format_table(tables.pop(Kind.ENGINE_BACKENDS), BACKEND_COLUMNS)]
    blocks += [f"{kind}:\n" + format_table(rows, columns_of(kind)) for kind, rows in tables.items()]
    problems = [] if args.all else problem_notes(registry)
    if problems:
        blocks.append(
            "Problems with what plugins provide besides engine backends (--all lists it all):\n"
            + "\n".join(problems)
        )
    print("\n\n".join(blocks))
    return 0


# -- verl-core config -----------------------------------------------------------------------------


def _run_config(args: argparse.Namespace) -> int:
    from verl_core.config import dump_yaml
    from verl_core.trainer.preflight import data_kind, describe_kind, preflight

    # The RL rules apply to an RL config, which the training data tells once the config has loaded.
    config = _load_run_config(args, rl_rules=args.for_command == "train")
    if config is None:
        return 2
    kind = {"train": "rl", "sft": "sft"}.get(args.for_command)
    told_by_data = True
    if kind is None:
        kind = data_kind(config)
        if kind is None:  # no data to tell (a fresh clone of the demo): an RL config meets the RL rules
            told_by_data = False
            with contextlib.redirect_stderr(io.StringIO()):
                rl_config = _load_run_config(args, rl_rules=True, quiet=True)
            kind, config = ("rl", rl_config) if rl_config is not None else ("sft", config)
        elif kind == "rl":
            config = _load_run_config(args, rl_rules=True, quiet=True)
            if config is None:
                return 2
    described = describe_kind(kind, detected=args.for_command is None, told_by_data=told_by_data)
    if not args.no_file_checks:
        try:
            preflight(config, kind)
        except VerlCoreError as error:
            print(error, file=sys.stderr)
            if not told_by_data:  # why the RL rules were not among the errors
                print(f"verl-core: {described}", file=sys.stderr)
            return 2
    sys.stdout.write(dump_yaml(config))
    print(f"verl-core: {described}", file=sys.stderr)
    return 0


def _load_run_config(args: argparse.Namespace, rl_rules: bool = True, quiet: bool = False) -> Any:
    """The run config of ``args.items`` (files and overrides) and ``args.override``, or ``None`` after
    printing every error; the options the run will ignore are printed as warnings (unless ``quiet``:
    a second load of the same config)."""
    # The loader imports cattrs and yaml: only the commands that load a config pay for them.
    from verl_core.config import load_config

    return _load_config_arguments(
        args, lambda paths, overrides: load_config(paths, overrides, rl_rules=rl_rules), quiet
    )


def _load_config_arguments(
    args: argparse.Namespace, load: Callable[[list[str], list[str]], Any], quiet: bool = False
) -> Any:
    """``load(paths, overrides)`` of ``args.items`` (files and overrides) and ``args.override``, or
    ``None`` after printing every error; ignored options printed as warnings (unless ``quiet``)."""
    from verl_core.config.loading import OVERRIDES_SOURCE, looks_like_key
    from verl_core.errors import ConfigError, ConfigWarning

    paths, overrides, mistaken = [], [], []
    for item in args.items:
        if "=" in item:
            overrides.append(item)
        elif not os.path.exists(item) and looks_like_key(item):
            mistaken.append(item)  # ``actor.engine.optim.lr 1e-5``: not a file to read
        else:
            paths.append(item)
    if mistaken:
        problems = [
            (
                "",
                f"{item!r} is not a file and looks like an override missing '=': write key=value ({item}=VALUE)",
            )
            for item in mistaken
        ]
        print(ConfigError(problems, source=OVERRIDES_SOURCE), file=sys.stderr)
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            config, error = load(paths, overrides + args.override), None
        except ConfigError as exc:
            config, error = None, exc
    for warning in (
        [] if quiet else caught
    ):  # each option the run will ignore, as ``warning: <path>: <message>``
        if issubclass(warning.category, ConfigWarning):
            print(f"warning: {warning.message}", file=sys.stderr)
        else:  # not ours: as Python would have shown it
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if error is not None:
        print(error, file=sys.stderr)
        return None
    return config


# -- verl-core train, verl-core sft ------------------------------------------------------------------

#: Exit codes of a run stopped by Ctrl-C (SIGINT) or SIGTERM: 128 + the signal, as shells report them.
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM


def _run_train(args: argparse.Namespace) -> int:
    def trainer_class() -> Any:
        from verl_core.trainer.rl import RLTrainer

        return RLTrainer

    return _run_trainer(args, trainer_class, rl_rules=True)


def _run_sft(args: argparse.Namespace) -> int:
    def trainer_class() -> Any:
        from verl_core.trainer.sft import SFTTrainer

        return SFTTrainer

    return _run_trainer(args, trainer_class, rl_rules=False)


def _run_trainer(args: argparse.Namespace, import_trainer: Any, rl_rules: bool) -> int:
    """Load the config, build the trainer (exit 2 on bad input, 0 if nothing is left to train), fit
    (exit 1 if the run fails), plot.

    Ctrl-C (SIGINT) and SIGTERM stop the run at any point: one line says where the run stopped and how
    to resume it, as soon as the signal arrives, the workers are released, and the exit code is 130 or
    143 (no traceback)."""
    from verl_core.errors import NothingToTrain

    trainer, config = None, None

    def stopped(code: int) -> str:
        return _stopped_message(config, trainer, code)

    with _StopSignals(stopped, bound_exit=True) as stop:
        try:
            if not args.items and not args.override:
                print(
                    f"error: no config given: verl-core {'train' if rl_rules else 'sft'} CONFIG.yaml [KEY=VALUE ...] "
                    "(examples/ has recipes)",
                    file=sys.stderr,
                )
                return 2
            config = _load_run_config(args, rl_rules=rl_rules)
            if config is None:
                if rl_rules:
                    _say_if_sft_config(args)
                return 2
            try:
                trainer_class = import_trainer()
                from verl_core.trainer.build import quiet_progress_bars

                quiet_progress_bars()
                trainer = trainer_class.from_config(config)
            except NothingToTrain as finished:
                print(f"verl-core: {finished}", file=sys.stderr)
                _draw_missing_curves(config.trainer.run_dir)
                return 0
            except VerlCoreError as error:  # bad input found while building: a dataset, a model folder
                if stop.code:
                    raise _StopRequested from None  # a rank that died of the same signal, say
                print(f"error: {error}", file=sys.stderr)
                return 2
            try:
                trainer.fit()
            except VerlCoreError as error:
                if stop.code:
                    raise _StopRequested from None
                print(f"error: {error}", file=sys.stderr)
                return 1
        except (KeyboardInterrupt, _StopRequested):
            stop.ignore_further()  # releasing the workers takes a few seconds: let it finish
            stop.say_stopped()  # before: whoever sent the signal may not wait for the release (nox)
            _release(trainer)
            return stop.code or EXIT_INTERRUPTED
        finally:
            if trainer is not None:
                trainer.shutdown()
        from verl_core.trainer.plot import plot_run

        print(f"verl-core:   curves: {plot_run(config.trainer.run_dir)}", file=sys.stderr)
        return 0


def _draw_missing_curves(run_dir: str) -> None:
    """Draw the curves of a finished run that stopped before drawing them (or before drawing its
    last metrics): nothing is missing from a run that says it has nothing to train."""
    from verl_core.trainer.plot import PLOT_FILE, plot_run
    from verl_core.trainer.run_files import METRICS_FILE

    curves, metrics = Path(run_dir) / PLOT_FILE, Path(run_dir) / METRICS_FILE
    if not metrics.is_file() or (curves.is_file() and curves.stat().st_mtime >= metrics.stat().st_mtime):
        return
    try:
        print(f"verl-core:   curves (drawn now, missing before): {plot_run(run_dir)}", file=sys.stderr)
    except VerlCoreError as error:  # nothing to draw
        print(f"verl-core: warning: no curves drawn: {error}", file=sys.stderr)


def _say_if_sft_config(args: argparse.Namespace) -> None:
    """After ``train`` refused a config: say so when it is an SFT config, the likelier mistake than
    the RL rules it broke (a critic for 'gae', say)."""
    from verl_core.trainer.preflight import data_kind

    with contextlib.redirect_stderr(io.StringIO()):
        config = _load_run_config(args, rl_rules=False, quiet=True)
    if config is None:
        return
    kind = data_kind(config)
    if kind == "sft":
        print(
            "verl-core: this is an SFT config (the rows of data.train_files have the data.response_key "
            "column): run it with `verl-core sft`",
            file=sys.stderr,
        )
    elif kind is None:
        print(
            "verl-core: if this is an SFT config, run it with `verl-core sft`: data.train_files[0] cannot be "
            "read to tell (`verl-core config` with the same arguments lists the missing files)",
            file=sys.stderr,
        )


class _StopRequested(BaseException):
    """Raised in the main thread when SIGTERM arrives (as Python raises KeyboardInterrupt for SIGINT);
    a ``BaseException``, so that no ``except Exception`` on the way swallows it."""


#: Seconds a stopped run may take to release its workers before it exits without them: a signal sent to
#: the whole process group can end Ray's own processes before the trainer's, and Ray's calls then wait
#: for them to come back (a minute by default).
STOP_DEADLINE_S = 30.0


class _StopSignals:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` and SIGTERM ``_StopRequested`` in the main
    thread, and ``code`` records the exit code the first one asks for; the handlers are restored after.

    ``say_stopped`` prints the line ``describe(code)`` once. A thread woken by the signal itself
    (``signal.set_wakeup_fd``) prints it as the signal arrives: the main thread may be inside a call that
    returns to Python only a second later (a wait on Ray's ranks), and ``nox`` forwards Ctrl-C to the
    run, then kills it 0.5 s later, so the line must not wait for the main thread or the release.

    A run that has not left the block ``STOP_DEADLINE_S`` after the first signal exits there, saying so,
    with that signal's exit code. With ``bound_exit`` (the CLI's runs) the deadline also holds after the
    block, until the process has exited: a thread or an exit handler still waiting on workers that are
    gone would hold the interpreter's exit forever (seen in CI after a SIGTERM while saving a checkpoint)."""

    SIGNALS = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}

    def __init__(self, describe: Callable[[int], str], bound_exit: bool = False) -> None:
        self.code = 0
        self.describe = describe
        self.bound_exit = bound_exit
        self.previous: dict[int, Any] = {}
        self._said = False
        self._lock = threading.RLock()  # a second signal may interrupt the handler holding it
        self._wakeup: tuple[socket.socket, socket.socket, threading.Thread] | None = None
        self._previous_wakeup = -1
        self._deadline: threading.Timer | None = None

    def __enter__(self) -> _StopSignals:
        for number in self.SIGNALS:
            if signal.getsignal(number) != signal.SIG_IGN:  # ignored by whoever started us: stays so
                self.previous[number] = signal.signal(number, self._handle)
        if self.previous and threading.current_thread() is threading.main_thread():
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            watcher = threading.Thread(target=self._watch, args=(reader,), name="verl-core-stop", daemon=True)
            watcher.start()
            self._wakeup = (reader, writer, watcher)
        return self

    def _record(self, number: int) -> None:
        with self._lock:
            if not self.code:
                self.code = self.SIGNALS[number]
                self._deadline = threading.Timer(STOP_DEADLINE_S, self._exit_now)
                self._deadline.daemon = True
                self._deadline.start()

    def _exit_now(self) -> None:
        """The stop took longer than ``STOP_DEADLINE_S``: leave without the workers (what is saved stays
        saved; a checkpoint being written is not complete, and the next run ignores it)."""
        from verl_core.trainer import console

        console.say(
            f"verl-core: the run did not end within {STOP_DEADLINE_S:.0f} s of the stop (the release of its "
            "workers, or what waits on them; their processes may have stopped first): exiting without them"
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.code)

    def _handle(self, number: int, frame: Any) -> None:
        self._record(number)
        raise KeyboardInterrupt if number == signal.SIGINT else _StopRequested

    def _watch(self, reader: socket.socket) -> None:
        """Print the stop line as each signal arrives (the C-level handler writes its number to the
        wakeup socket at once); ends when the block does."""
        while data := reader.recv(64):
            for number in data:
                if number in self.previous:
                    self._record(number)
                    self.say_stopped()

    def say_stopped(self) -> None:
        """The line saying where the run stopped and how to resume it, printed once."""
        from verl_core.trainer import console

        with self._lock:
            if self._said:
                return
            self._said = True
        console.say(self.describe(self.code or EXIT_INTERRUPTED))  # above a progress bar, if one shows

    def ignore_further(self) -> None:
        for number in self.previous:
            signal.signal(number, signal.SIG_IGN)

    def __exit__(self, *exc_info: Any) -> None:
        if self._deadline is not None and not self.bound_exit:
            self._deadline.cancel()  # (a daemon thread: with bound_exit, it ends with the process)
        for number, handler in self.previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            reader, writer, watcher = self._wakeup
            writer.close()  # the watcher reads the end of the stream and returns
            watcher.join(timeout=5)
            reader.close()


def _release(trainer: Any) -> None:
    """Stop the run's workers now: the trainer's groups, and any Ray actors of a trainer still being
    built (disconnecting the driver ends them; a local cluster stops with it)."""
    if trainer is not None:
        trainer.shutdown()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _stopped_message(config: Any, trainer: Any, code: int) -> str:
    """``interrupted during step 13 of 150; the last checkpoint is runs/x/global_step_10: run the same
    command to resume``, with the paths as the user gave them."""
    what = "interrupted" if code == EXIT_INTERRUPTED else "stopped by SIGTERM"
    if config is None:
        return f"{what} while loading the configuration"
    if trainer is None:
        where = "while starting (before the first step)"
    elif trainer.stage is not None:
        where = trainer.stage
    elif trainer.global_step >= trainer.total_steps:
        where = f"after the last step ({trainer.global_step})"
    else:
        where = f"during step {trainer.global_step + 1} of {trainer.total_steps}"
    from verl_core.trainer.checkpoints import complete_checkpoints

    settings = config.trainer
    saved = complete_checkpoints(settings.checkpoint_dir)
    if not saved:
        if not settings.save_freq:
            return f"{what} {where}; no checkpoint is saved (trainer.save_freq is 0): the same command starts over"
        return f"{what} {where}; no checkpoint yet: the same command starts over"
    step, folder = saved[-1]
    path = os.path.join(settings.checkpoint_dir, folder.name)
    resume = "run the same command to resume"
    if settings.resume_mode != "auto":
        resume = "run the same command with trainer.resume_mode=auto to resume"
    return f"{what} {where}; the last checkpoint is {path} (step {step}): {resume}"


# -- verl-core serve ------------------------------------------------------------------------------


def _run_serve(args: argparse.Namespace) -> int:
    from verl_core.config import load_serve_config

    if not args.items and not args.override:
        print(
            "error: no config given: verl-core serve CONFIG.yaml [KEY=VALUE ...] (examples/serve/ has one)",
            file=sys.stderr,
        )
        return 2
    config = _load_config_arguments(args, load_serve_config)
    if config is None:
        return 2
    from verl_core.service import ServiceClient
    from verl_core.service.server import TinkerServer

    service = ServiceClient(
        config.base_models, state_dir=config.state_dir, engine=config.engine, rollout=config.rollout
    )
    try:
        server = TinkerServer(
            service,
            config.resolved_token(),
            host=config.host,
            port=config.port,
            samplers_in_memory=config.samplers_in_memory,
            session_timeout_s=config.session_timeout_s,
        )
    except OSError as error:
        print(f"error: cannot listen on {config.host}:{config.port} (host, port): {error}", file=sys.stderr)
        return 2
    host, port = server.address
    if not _is_loopback(host):
        print(
            f"verl-core serve: warning: host {host} serves other machines too: anyone who reaches it with "
            "the token trains and samples here (host: 127.0.0.1 keeps it to this machine)",
            file=sys.stderr,
        )
    url_host = f"[{host}]" if ":" in host else host
    print(
        f"verl-core serve: listening on http://{url_host}:{port} (base models: {', '.join(config.base_models)})",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()

    def stopped(number: int, frame: Any) -> None:
        stop.set()

    previous = signal.signal(signal.SIGTERM, stopped)
    thread = threading.Thread(target=server.serve_forever, name="verl-core-serve", daemon=True)
    thread.start()
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.shutdown()
        service.close()
    print("verl-core serve: stopped", file=sys.stderr)
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


# -- verl-core plot -------------------------------------------------------------------------------


def _run_plot(args: argparse.Namespace) -> int:
    # matplotlib is imported only when drawing: the other commands do not pay for it.
    from verl_core.trainer.plot import plot_comparison, plot_run

    try:
        if len(args.run_dirs) == 1:
            path = plot_run(args.run_dirs[0])
        else:
            path = plot_comparison(args.run_dirs, args.out)
    except VerlCoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0
