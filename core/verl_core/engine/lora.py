"""LoRA adapters on an engine's Hugging Face model, with ``peft``: docs/lora.md.

``HFEngine`` uses these when ``config.model.lora_rank > 0`` (or ``lora_adapter_path`` is set): the
loaded model is wrapped in a ``peft.PeftModel`` before the backend lays it out, so every backend
built on ``HFEngine`` trains adapters without code of its own. Only the adapter requires gradients
(so only it has optimiser state and only it is checkpointed); it has the base model's dtype (FSDP2
shards one dtype per unit). The weights the rollout receives are merged here, tensor by tensor, from
the current adapter (``W + scale * B @ A``), never by merging into the model and unmerging again: no
export can see the base weights or a merge of an earlier step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from verl_core.config.engine import ModelConfig
from verl_core.engine.seed import seeded
from verl_core.errors import ConfigError

#: The adapter folder inside a LoRA engine's Hugging Face export (``PeftModel.from_pretrained`` loads it).
LORA_ADAPTER_DIR = "lora_adapter"
#: What makes a folder a peft adapter.
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: ``target_modules`` value that adapts every linear layer but the LM head (peft's own shorthand).
ALL_LINEAR = "all-linear"
#: What ``PeftModel`` puts before the wrapped model's names, and around an adapted layer's own weights.
PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"
_ADAPTER_NAME = "default"


def check_lora_role(config: ModelConfig, role: str, where: str = "model") -> None:
    """LoRA trains policies (role ``lm``): a critic's value head is new and must train in full."""
    if config.lora and role != "lm":
        key = "lora_rank" if config.lora_rank else "lora_adapter_path"
        raise ConfigError(
            [
                (
                    f"{where}.{key}",
                    f"LoRA is for the policy (role 'lm'), not role {role!r}: a value model's head starts "
                    "untrained and needs full training; set it to its default for this engine (the actor "
                    "can still use LoRA)",
                )
            ]
        )


def apply_lora(
    module: torch.nn.Module, config: ModelConfig, seed: int = 0, where: str = "model"
) -> torch.nn.Module:
    """``module`` wrapped in a ``PeftModel`` with a trainable adapter: a new one from ``config``'s rank,
    alpha, target modules and dropout (initialised from ``seed``, identically on every rank), or the
    one at ``config.lora_adapter_path``. The adapter has ``module``'s dtype; base weights are frozen."""
    peft = _import_peft(where)

    if config.lora_adapter_path is not None:
        adapter = check_adapter_dir(config.lora_adapter_path, f"{where}.lora_adapter_path")
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
    """``path`` as a peft adapter folder, or a ``ConfigError`` at ``where`` saying what to give."""
    adapter = Path(path).expanduser()
    if not (adapter / ADAPTER_CONFIG_FILE).is_file():
        raise ConfigError(
            [
                (
                    where,
                    f"{path!r} holds no {ADAPTER_CONFIG_FILE}: give the folder that PeftModel.save_pretrained "
                    f"wrote (a LoRA run's hf_model/{LORA_ADAPTER_DIR})",
                )
            ]
        )
    return adapter


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
