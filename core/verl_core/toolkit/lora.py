"""LoRA adapters on an engine's Hugging Face model, with ``peft``: docs/lora.md.

An ``HFEngine`` holds an ``Adapter``: ``NoAdapter`` trains every weight, ``LoraAdapter`` (when
``config.model.lora_rank > 0`` or ``lora_adapter_path`` is set) wraps the loaded model in a
``peft.PeftModel`` before the backend lays it out, so that every backend built on ``HFEngine`` trains
adapters without code of its own. The engine asks its adapter, never ``config.model.lora``, what to
train, export, checkpoint and serve as the reference policy.

With LoRA only the adapter requires gradients (so only it has optimiser state and only it is
checkpointed); it has the base model's dtype (FSDP2 shards one dtype per unit). The weights the
rollout receives are merged here, tensor by tensor, from the current adapter (``W + scale * B @ A``),
never by merging into the model and unmerging again: no export can see the base weights or a merge
of an earlier step.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from verl_core.config.engine import ModelConfig
from verl_core.errors import CheckpointError, ConfigError
from verl_core.toolkit.integrity import file_problem, model_fingerprint, safetensors_header
from verl_core.toolkit.seed import seeded

#: The adapter folder inside a LoRA engine's Hugging Face export (``PeftModel.from_pretrained`` loads it).
LORA_ADAPTER_DIR = "lora_adapter"
#: What makes a folder a peft adapter: its config, and its weights (the first the newer format).
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: ``target_modules`` value that adapts every linear layer but the LM head (peft's own shorthand).
ALL_LINEAR = "all-linear"
#: What ``PeftModel`` puts before the wrapped model's names, and around an adapted layer's own weights.
PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"
#: What a LoRA engine's checkpoint records of its adapter and base model (``Adapter.check_checkpoint``).
LORA_CHECKPOINT_FILE = "lora.json"
_ADAPTER_NAME = "default"

#: Makes a whole tensor of a state-dict value (``HFEngine.full_tensor``: a collective on sharded engines).
FullTensor = Callable[[torch.Tensor], torch.Tensor]


class Adapter:
    """What an ``HFEngine`` trains of its model, and so what it exports, checkpoints and serves as the
    reference policy. This base class trains every weight (``NoAdapter``); ``LoraAdapter`` trains an
    adapter over frozen base weights. ``adapter_for`` picks one for an engine's model config."""

    #: Whether the engine runs the reference policy itself (``BaseEngine.reference()``).
    serves_reference: bool = False

    def wrap(self, module: torch.nn.Module, seed: int) -> torch.nn.Module:
        """What the engine trains, from the loaded model (before the backend lays it out)."""
        return module

    def reference(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Run ``model`` as the reference policy; only when ``serves_reference``."""
        raise NotImplementedError(f"{type(self).__name__} does not serve the reference policy")

    def weights(self, model: torch.nn.Module, full_tensor: FullTensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight of ``model`` as the policy runs it, whole, under Hugging Face names, in
        state-dict order, one at a time (``full_tensor`` is a collective on sharded engines)."""
        for name, tensor in model.state_dict().items():
            yield name, full_tensor(tensor.detach())

    def checkpointed_state(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict:
        """The entries of ``model``'s state dict that checkpoints hold: all of them."""
        return state_dict

    def export(
        self, model: torch.nn.Module, full_tensor: FullTensor
    ) -> tuple[torch.nn.Module, Callable[[Path], None] | None]:
        """The model whose config and file layout the Hugging Face export takes, and what else to
        write into the export's folder (``None``: nothing). A collective where ``full_tensor`` is."""
        return model, None

    def save_checkpoint_info(self, directory: Path) -> None:
        """Record in a checkpoint's directory what loading it requires (one rank writes)."""

    def check_checkpoint(self, directory: Path) -> None:
        """Refuse, before anything loads, a checkpoint this adapter cannot continue: a LoRA checkpoint
        into full training."""
        if (directory / LORA_CHECKPOINT_FILE).is_file():
            raise CheckpointError(
                f"{directory} holds a LoRA adapter ({LORA_CHECKPOINT_FILE}), but this engine trains the full "
                "model: set the model's lora_rank as the run that saved it did, or start from another checkpoint"
            )


class NoAdapter(Adapter):
    """Every weight trains: the model as loaded."""


class LoraAdapter(Adapter):
    """A LoRA adapter over frozen base weights (``config.lora_rank``, or ``config.lora_adapter_path``):
    only the adapter trains and is checkpointed, the rollout and the export receive the merged weights,
    and the base model is the reference policy. ``where`` is the model config's path, for errors."""

    serves_reference = True

    def __init__(self, config: ModelConfig, where: str = "model"):
        self.config = config
        self.where = where

    def wrap(self, module: torch.nn.Module, seed: int) -> torch.nn.Module:
        return apply_lora(module, self.config, seed, self.where)

    def reference(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return adapter_disabled(model)

    def weights(self, model: torch.nn.Module, full_tensor: FullTensor) -> Iterator[tuple[str, torch.Tensor]]:
        return merged_params(model, full_tensor)

    def checkpointed_state(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict:
        """The adapter's entries only: the base weights are ``config.path``'s and never change."""
        trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
        return {name: value for name, value in state_dict.items() if name in trainable}

    def export(
        self, model: torch.nn.Module, full_tensor: FullTensor
    ) -> tuple[torch.nn.Module, Callable[[Path], None] | None]:
        """The merged model's layout, and the adapter in ``LORA_ADAPTER_DIR`` for ``PeftModel``."""
        adapter = adapter_params(model, full_tensor)  # a collective: every rank gathers

        def write_adapter(staging: Path) -> None:
            save_adapter(model, adapter, staging / LORA_ADAPTER_DIR)

        return model.get_base_model(), write_adapter

    def save_checkpoint_info(self, directory: Path) -> None:
        (directory / LORA_CHECKPOINT_FILE).write_text(json.dumps(self._identity(), indent=1, sort_keys=True))

    def check_checkpoint(self, directory: Path) -> None:
        """Refuse a checkpoint of another adapter (rank, alpha, target modules) or of an adapter trained
        over other base weights (``config.path`` changed since), naming what differs."""
        problems = lora_checkpoint_problems(directory, self.config)
        if problems:
            raise CheckpointError(f"{directory} cannot be resumed by this engine: " + "; ".join(problems))

    def _identity(self) -> dict[str, object]:
        return lora_identity(self.config)


def adapter_for(config: ModelConfig, role: str, where: str = "model") -> Adapter:
    """The adapter an engine with model config ``config`` (at ``where``) trains for ``role``: a LoRA
    adapter when ``config.lora``, refused for roles that cannot train one; else ``NoAdapter``."""
    problem = config.lora_role_problem(role)
    if problem is not None:
        key, message = problem
        raise ConfigError([(f"{where}.{key}", message)])
    return LoraAdapter(config, where) if config.lora else NoAdapter()


def lora_identity(config: ModelConfig) -> dict[str, object]:
    """What a LoRA checkpoint must agree on with the engine that resumes it: the adapter's shape and
    scale, and the base weights it was trained over (``model_fingerprint``)."""
    if config.lora_adapter_path is not None:
        adapter = json.loads((Path(config.lora_adapter_path).expanduser() / ADAPTER_CONFIG_FILE).read_text())
        shape = {key: adapter.get(key) for key in ("r", "lora_alpha", "target_modules")}
    else:
        shape = {
            "r": config.lora_rank,
            "lora_alpha": config.lora_alpha,
            "target_modules": config.target_modules,
        }
    if isinstance(shape["target_modules"], list):
        shape["target_modules"] = sorted(shape["target_modules"])
    return {**shape, "base_model": model_fingerprint(config.path)}


def lora_checkpoint_problems(directory: Path, config: ModelConfig) -> list[str]:
    """Why ``directory`` (an engine checkpoint) cannot continue LoRA training with ``config``: each
    difference in the adapter's shape, or base weights that changed; ``[]`` when it can (or when the
    checkpoint records nothing to compare)."""
    recorded_file = directory / LORA_CHECKPOINT_FILE
    if not recorded_file.is_file():
        return [
            f"it holds no {LORA_CHECKPOINT_FILE}: it is not a LoRA checkpoint (the run that saved it trained the full model)"
        ]
    recorded = json.loads(recorded_file.read_text())
    current = lora_identity(config)
    names = {"r": "lora_rank", "lora_alpha": "lora_alpha", "target_modules": "target_modules"}
    problems = [
        f"its adapter has {names[key]} {recorded.get(key)!r}, this run's {current[key]!r}"
        for key in names
        if recorded.get(key) != current[key]
    ]
    if recorded.get("base_model") != current["base_model"]:
        problems.append(
            f"its adapter was trained over other base weights than {config.path!r} holds now (the model "
            "folder changed since it was saved): an adapter only continues over the weights it was "
            "trained on; restore that model folder, or start a new run"
        )
    return problems


def apply_lora(
    module: torch.nn.Module, config: ModelConfig, seed: int = 0, where: str = "model"
) -> torch.nn.Module:
    """``module`` wrapped in a ``PeftModel`` with a trainable adapter: a new one from ``config``'s rank,
    alpha, target modules and dropout (initialised from ``seed``, identically on every rank), or the
    one at ``config.lora_adapter_path``. The adapter has ``module``'s dtype; base weights are frozen."""
    peft = _import_peft(where)

    if config.lora_adapter_path is not None:
        adapter = check_adapter_dir(config.lora_adapter_path, f"{where}.lora_adapter_path")
        problems = adapter_shape_problems(config.lora_adapter_path, module)
        if problems:
            raise ConfigError([(f"{where}.lora_adapter_path", "; ".join(problems))])
        with seeded(seed), _peft_asking_deprecated_questions():
            return peft.PeftModel.from_pretrained(
                module, str(adapter), is_trainable=True, autocast_adapter_dtype=False
            )
    check_target_modules(module, config.target_modules, f"{where}.target_modules")
    lora_config = peft.LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=config.target_modules,
        lora_dropout=config.lora_dropout,
        bias="none",
    )
    with seeded(seed), _peft_asking_deprecated_questions():
        return peft.get_peft_model(module, lora_config, autocast_adapter_dtype=False)


@contextlib.contextmanager
def _peft_asking_deprecated_questions() -> Iterator[None]:
    """peft (0.21) asks transformers (5.x) ``is_gradient_checkpointing``, which warns at every run; the
    answer is right, and neither the user nor this code can change the question."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def _import_peft(where: str):
    try:
        import peft
    except ImportError as error:
        key = f"{where}.lora_rank"
        raise ConfigError([(key, f"LoRA needs peft ({error}): pip install 'verl-core[lora]'")]) from error
    return peft


def check_adapter_dir(path: str, where: str = "model.lora_adapter_path") -> Path:
    """``path`` as a whole peft LoRA adapter folder, or a ``ConfigError`` at ``where`` saying what is
    wrong with it (``adapter_dir_problems``) and what to give."""
    problems = adapter_dir_problems(path)
    if problems:
        raise ConfigError([(where, "; ".join(problems))])
    return Path(path).expanduser()


def adapter_dir_problems(path: str) -> list[str]:
    """What keeps the folder ``path`` from being a LoRA adapter to start from, read from its files
    alone: no such folder, no ``adapter_config.json`` or one that is not a LoRA adapter's, no weights
    file, or one cut short."""
    adapter = Path(path).expanduser()
    give = f"give the folder that PeftModel.save_pretrained wrote (a LoRA run's hf_model/{LORA_ADAPTER_DIR})"
    if not adapter.is_dir():
        return [f"{path!r} {'is a file' if adapter.exists() else 'does not exist'}: {give}"]
    config_file = adapter / ADAPTER_CONFIG_FILE
    if not config_file.is_file():
        return [f"{path!r} holds no {ADAPTER_CONFIG_FILE}: {give}"]
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        return [
            f"{config_file} is not valid JSON ({error}): the copy was cut short, or it is not an adapter's"
        ]
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        return [f"{config_file} describes a {kind!r} adapter, not a LoRA one (peft_type 'LORA'): {give}"]
    problems = [f"{config_file} has no {key!r}" for key in ("r", "lora_alpha") if key not in config]
    weights = next((adapter / name for name in ADAPTER_WEIGHT_FILES if (adapter / name).is_file()), None)
    if weights is None:
        problems.append(
            f"{path!r} holds no adapter weights ({' or '.join(ADAPTER_WEIGHT_FILES)}): the save or the copy "
            "was cut short"
        )
    elif (problem := file_problem(weights)) is not None:
        problems.append(f"{weights} {problem}: the save or the copy was cut short")
    return problems


def adapter_shape_problems(path: str, model: torch.nn.Module) -> list[str]:
    """Where the adapter at ``path`` (``adapter_model.safetensors``, read from its header) does not fit
    ``model`` (the Hugging Face model, on the meta device is enough): a layer it adapts that the model
    lacks, or whose sizes differ: an adapter trained for another model."""
    weights = Path(path).expanduser() / ADAPTER_WEIGHT_FILES[0]
    if not weights.is_file():
        return []  # a .bin adapter: its shapes are checked when it loads
    layers = dict(model.named_modules())
    problems = []
    for name, entry in safetensors_header(weights).items():
        for part, axis, size in ((".lora_A.", 1, "in_features"), (".lora_B.", 0, "out_features")):
            if part not in name:
                continue
            layer_path = name.removeprefix(PEFT_PREFIX).split(part)[0]
            layer = layers.get(layer_path)
            if layer is None:
                problems.append(f"it adapts {layer_path!r}, which {type(model).__name__} does not have")
            elif getattr(layer, size, None) != entry["shape"][axis]:
                problems.append(
                    f"its {layer_path!r} has {size} {entry['shape'][axis]}, the model's {getattr(layer, size, None)}"
                )
    if not problems:
        return []
    base = json.loads((weights.parent / ADAPTER_CONFIG_FILE).read_text()).get("base_model_name_or_path")
    return [
        f"the adapter at {path!r} was trained for another model (its base_model_name_or_path: {base!r}): "
        + "; ".join(dict.fromkeys(problems[:3]))
        + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
    ]


def check_target_modules(module: torch.nn.Module, target_modules: str | list[str], where: str) -> None:
    """Each name in ``target_modules`` names linear layers of ``module`` (by the last part of their
    path, as peft matches, or the whole path); an unknown name is a ``ConfigError`` listing the
    linear layers the model has. An LM head tied to the input embeddings cannot take an adapter: the
    merged head would no longer be the embeddings, which a tied export cannot hold."""
    if isinstance(target_modules, str):
        if target_modules == ALL_LINEAR:
            return  # peft leaves the LM head out
        target_modules = [target_modules]
    linear = [name for name, layer in module.named_modules() if isinstance(layer, torch.nn.Linear)]
    known = {name.rsplit(".", 1)[-1] for name in linear} | set(linear)
    problems = []
    unknown = [name for name in target_modules if name not in known]
    if unknown:
        have = sorted({name.rsplit(".", 1)[-1] for name in linear})
        problems.append(
            f"{unknown} name no linear layer of {type(module).__name__}; it has {have} (or use {ALL_LINEAR!r})"
        )
    head = _tied_head_name(module)
    if head is not None and any(name in (head, head.rsplit(".", 1)[-1]) for name in target_modules):
        problems.append(
            f"{head!r} is tied to the input embeddings (tie_word_embeddings): an adapter on it cannot be "
            "merged into the one tensor both share; leave it out"
        )
    if problems:
        raise ConfigError([(where, "; ".join(problems))])


def _tied_head_name(module: torch.nn.Module) -> str | None:
    """The path of ``module``'s LM head when it is tied to the input embeddings, else None."""
    config = getattr(module, "config", None)
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is None or not getattr(config, "tie_word_embeddings", False):
        return None
    return next(name for name, layer in module.named_modules() if layer is head)


def hf_name(peft_name: str) -> str:
    """The Hugging Face name of a ``PeftModel`` state-dict entry: without ``base_model.model.`` and
    ``.base_layer``, as the rollout and ``from_pretrained`` expect."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    return name.replace(BASE_LAYER + ".", ".")


def is_adapter_weight(name: str) -> bool:
    return ".lora_" in name


def merged_params(
    model: torch.nn.Module, full_tensor: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged weights of a ``PeftModel`` under Hugging Face names, in state-dict order, one at a
    time: each adapted layer's ``W + scale * B @ A`` from the adapter as it is now. ``full_tensor``
    makes a whole tensor of a state-dict value (a collective on sharded engines: every rank iterates
    to the end)."""
    state = model.state_dict()
    layers = dict(model.named_modules())
    for name, tensor in state.items():
        if is_adapter_weight(name):
            continue
        weight = full_tensor(tensor.detach())
        if name.endswith(BASE_LAYER + ".weight"):
            path = name.removesuffix(BASE_LAYER + ".weight")
            weight = weight + _delta_weight(layers[path], path, state, full_tensor).to(weight.dtype)
        yield hf_name(name), weight


def _delta_weight(
    layer: torch.nn.Module, path: str, state: dict[str, torch.Tensor], full_tensor: Callable
) -> torch.Tensor:
    """``scale * B @ A`` of one adapted linear layer, in float32 (transposed for fan-in-fan-out layers)."""
    down = full_tensor(state[f"{path}.lora_A.{_ADAPTER_NAME}.weight"].detach()).float()
    up = full_tensor(state[f"{path}.lora_B.{_ADAPTER_NAME}.weight"].detach()).float()
    delta = (up @ down) * layer.scaling[_ADAPTER_NAME]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def adapter_params(
    model: torch.nn.Module, full_tensor: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The adapter's weights, whole and on the CPU, under ``PeftModel`` state-dict names (a collective
    on sharded engines)."""
    return {
        name: full_tensor(tensor.detach()).to("cpu")
        for name, tensor in model.state_dict().items()
        if is_adapter_weight(name)
    }


def save_adapter(model: torch.nn.Module, adapter: dict[str, torch.Tensor], directory: Path) -> None:
    """Write the adapter folder ``PeftModel.from_pretrained`` loads (``adapter_config.json`` and
    ``adapter_model.safetensors``) from ``adapter_params``' result."""
    model.save_pretrained(str(directory), state_dict=adapter)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` (a ``PeftModel``) as its base model: the reference policy without a second copy."""
    with model.disable_adapter():
        yield
