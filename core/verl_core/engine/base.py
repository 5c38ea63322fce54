"""The engine contract: what every backend implements, and what is built on top of it.

An engine owns one model on one rank of a (possibly) distributed job: its parallel layout,
optimiser, learning-rate schedule, offload and checkpoints. A backend implements the abstract
methods; ``train_batch``, ``infer_batch`` and the mode contexts are written once, here.

The loss contract (``LossFn``): ``loss_fn(model_output, micro_batch, dp_group) -> (loss, metrics)``
is called once per micro-batch. ``micro_batch`` carries the global counts of the whole step (see
``verl_core.data.batch.compute_global_counts``) so that the returned loss is already normalised by global
token / sequence counts and by the DP size: summing the returned losses over micro-batches and
ranks gives the full-batch loss, whatever the split.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_core.config.engine import EngineConfig
from verl_core.data import batch as batch_keys
from verl_core.deprecation import moved_names
from verl_core.descriptors import ModelRole
from verl_core.engine.device import resolve_device
from verl_core.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: ``loss_fn(model_output, micro_batch, dp_group) -> (loss, metrics)``.
LossFn = Callable[
    ["dict[str, torch.Tensor]", TensorDict, "ProcessGroup | None"], "tuple[torch.Tensor, dict[str, Any]]"
]


def forward_options(batch: TensorDict) -> tuple[float, bool]:
    """The batch's ``temperature`` (default 1.0) and ``compute_entropy`` (default off), as a backend's
    forward pass reads them."""

    def read(key: str, default: object) -> object:
        value = batch.get_non_tensor(key, default)
        return value.item() if isinstance(value, torch.Tensor) else value

    return float(read(batch_keys.TEMPERATURE, 1.0)), bool(read(batch_keys.COMPUTE_ENTROPY, False))


def top_k_option(batch: TensorDict) -> int:
    """The batch's ``top_k`` (default 0: none), as a backend declaring ``top_k_log_probs`` reads it:
    with ``k > 0`` an ``lm`` forward pass also returns ``top_k_log_probs`` and ``top_k_ids``."""
    value = batch.get_non_tensor(batch_keys.TOP_K, 0)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"the batch's {batch_keys.TOP_K!r} is {value!r}: it must be an int >= 0 (0: no top-k), "
            f"set with batch.set_non_tensor({batch_keys.TOP_K!r}, k)"
        )
    return value


@attrs.define
class ForwardBackwardResult:
    """What ``forward_backward_batch`` returns on each rank.

    ``outputs``: model outputs (``log_probs``, ``entropy``, ``values``) for this rank's batch, in the
    batch's original order, or ``None`` on ranks that do not own outputs.
    ``loss``: the full-batch loss, or ``None`` without a loss function. Each rank's micro-batch losses
    are scaled by the DP size (to undo the gradient averaging of data parallelism), so this is their
    sum over micro-batches and ranks divided by the DP size. ``metrics``: each loss-function metric, one entry per micro-batch.
    """

    outputs: TensorDict | None
    loss: float | None = None
    metrics: dict[str, list[float]] = attrs.field(factory=dict)


class BaseEngine(abc.ABC):
    """Base class of every engine backend. Construct through ``verl_core.engine.build_engine``.

    ``config_path`` is where ``config`` sits in a run config (``actor.engine``): errors about it name
    that path. docs/engine.md documents every method: who calls it, when, on which ranks.
    """

    #: The backend's own options class (its ``EngineBackend.config``, the one source of truth that
    #: ``build_engine`` checks against): ``config.options`` must be an instance of it, or ``None`` for
    #: its defaults. ``self.options`` holds the resolved instance.
    options_class: ClassVar[type | None] = None

    def __init__(
        self, config: EngineConfig, role: ModelRole | str = ModelRole.LM, *, config_path: str = "engine"
    ):
        #: What the model computes (a ``ModelRole``: ``lm`` or ``value``).
        self.role = ModelRole(role)
        self.config_path = config_path
        self.config = config
        self.options = self._resolve_options(config.options)
        if config.options is not self.options:  # the defaults: ``self.config`` says what runs
            self.config = attrs.evolve(config, options=self.options)
        self._device = resolve_device(config.device, where=f"{config_path}.device")

    def _resolve_options(self, options: Any) -> Any:
        cls = self.options_class
        if cls is None:
            return options
        if options is None:
            return cls()
        if not isinstance(options, cls):
            raise ConfigError(
                [
                    (
                        f"{self.config_path}.options",
                        f"expected an instance of {cls.__module__}.{cls.__qualname__} (the options of engine "
                        f"backend '{self.config.backend}') or None for its defaults, got "
                        f"{type(options).__module__}.{type(options).__qualname__}",
                    )
                ]
            )
        return options

    @classmethod
    def check_before_start(
        cls,
        config: EngineConfig,
        *,
        role: str,
        model_config: Mapping[str, Any],
        world_size: int,
        config_path: str,
    ) -> list[tuple[str, str]]:
        """The problems of ``config`` that its model and the job's size tell before any rank starts,
        each ``(key, message)``: the key under ``config_path`` (``actor.engine.ulysses.sp_size``), the
        message naming the fix. ``model_config`` is the model folder's ``config.json``, ``world_size``
        the ranks the role runs on, ``config.options`` the backend's options (an instance of
        ``options_class``, or ``None`` for its defaults). The run's checks (``verl-core config``,
        ``train``, ``sft``) call it on the driver, where no process group exists, before any worker
        starts; a backend whose layout depends on the model or the world (attention heads per
        sequence-parallel rank, say) overrides it, and can call it from ``initialize()`` too, so that
        each rule has one home. The default finds nothing."""
        return []

    # -- lifecycle -------------------------------------------------------------------------------

    @abc.abstractmethod
    def initialize(self) -> None:
        """Build the model, wrap it for the parallel layout, build optimiser and LR schedule."""

    @abc.abstractmethod
    def set_model_mode(self, train: bool) -> None:
        """Put the model in train or eval mode (dropout and the like)."""

    @abc.abstractmethod
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move parameters, optimiser state and/or gradients to ``device`` (``"cpu"`` offloads)."""

    @property
    def device(self) -> torch.device:
        """The device this rank computes on (``config.device``; ``auto`` picks CUDA when available)."""
        return self._device

    @contextlib.contextmanager
    def train_mode(self) -> Iterator[BaseEngine]:
        """Load what ``param_offload`` / ``optimizer_offload`` keep on CPU, train, offload again."""
        with self._loaded(optimizer=True):
            self.set_model_mode(True)
            yield self

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[BaseEngine]:
        """Load offloaded parameters (not the optimiser), run in eval mode, offload again."""
        with self._loaded(optimizer=False):
            self.set_model_mode(False)
            yield self

    def offload_per_config(self, device: str = "cpu", optimizer: bool = True) -> None:
        """Move what ``param_offload`` / ``optimizer_offload`` select to ``device``: ``"cpu"`` at the
        end of ``initialize()`` and after each mode context, the compute device on entering one."""
        model = self.config.param_offload
        optimizer = optimizer and self.config.optimizer_offload
        if model or optimizer:
            self.to(device, model=model, optimizer=optimizer, grad=model)

    @contextlib.contextmanager
    def _loaded(self, optimizer: bool) -> Iterator[None]:
        self.offload_per_config(str(self.device), optimizer=optimizer)
        try:
            yield
        finally:
            self.offload_per_config("cpu", optimizer=optimizer)

    # -- compute ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def forward_backward_batch(
        self, batch: TensorDict, loss_fn: LossFn | None, forward_only: bool
    ) -> ForwardBackwardResult:
        """Split ``batch`` (this rank's share) into micro-batches, run forward (and backward unless
        ``forward_only``), call ``loss_fn`` once per micro-batch, collect outputs in batch order."""

    @abc.abstractmethod
    def optimizer_zero_grad(self) -> None: ...

    @abc.abstractmethod
    def optimizer_step(self) -> float:
        """Clip gradients to ``optim.clip_grad``, step the optimiser; return the global grad norm
        (before clipping). A non-finite norm skips the step."""

    @abc.abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step; return the new learning rate."""

    @abc.abstractmethod
    def get_lr(self) -> float:
        """The learning rate the next optimiser step uses."""

    def train_batch(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        """One optimiser step on ``batch``: zero grad, forward/backward, clip, step, LR step.

        Returns ``loss`` (global), ``grad_norm``, ``lr`` (the rate this step used) and the mean of
        each loss-function metric over micro-batches.
        """
        self.optimizer_zero_grad()
        result = self.forward_backward_batch(batch, loss_fn, forward_only=False)
        lr = self.get_lr()
        grad_norm = self.optimizer_step()
        self.lr_scheduler_step()
        metrics = {name: sum(values) / len(values) for name, values in result.metrics.items() if values}
        metrics.update(loss=result.loss, grad_norm=grad_norm, lr=lr)
        return metrics

    @torch.no_grad()
    def infer_batch(self, batch: TensorDict, loss_fn: LossFn | None = None) -> ForwardBackwardResult:
        """Forward only: log-probs (and entropy when ``compute_entropy``) or values for ``batch``."""
        return self.forward_backward_batch(batch, loss_fn, forward_only=True)

    # -- the reference policy --------------------------------------------------------------------

    @property
    def serves_reference(self) -> bool:
        """Whether this engine also runs the policy's reference, inside ``reference()`` (LoRA: the
        base model is the reference); the trainer then builds no reference engine."""
        return False

    def reference(self) -> contextlib.AbstractContextManager:
        """Inside, forward passes (``infer_batch``) run the reference policy; only when
        ``serves_reference``."""
        raise NotImplementedError(f"{type(self).__name__} does not serve a reference policy")

    # -- weights and checkpoints -----------------------------------------------------------------

    @abc.abstractmethod
    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every weight as a full (unsharded) tensor under its Hugging Face name, in the order
        of the Hugging Face state dict. Used for weight sync to the rollout."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str, global_step: int = 0) -> None:
        """Save model, optimiser and LR-schedule state to the directory ``path``, atomically: a
        crash mid-save leaves no directory at ``path`` that ``load_checkpoint`` would trust."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> int:
        """Restore what ``save_checkpoint`` wrote; return its global step."""

    @abc.abstractmethod
    def save_hf_model(self, path: str) -> None:
        """Write a Hugging Face directory (config + safetensors) that ``from_pretrained`` loads."""

    # -- topology --------------------------------------------------------------------------------

    @property
    def dp_group(self) -> ProcessGroup | None:
        """The data-parallel process group (``None`` when not distributed)."""
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    @property
    def dp_size(self) -> int:
        group = self.dp_group
        return dist.get_world_size(group) if group is not None else 1

    @property
    def dp_rank(self) -> int:
        group = self.dp_group
        return dist.get_rank(group) if group is not None else 0

    @property
    def is_output_rank(self) -> bool:
        """Whether this rank holds model outputs (all DP ranks do; with TP/PP only some)."""
        return True


# First defined here; their home is the batch vocabulary (its keys are not the engine's own names).
__getattr__ = moved_names(
    __name__,
    {name: f"verl_core.data:{name}" for name in ("TEMPERATURE", "COMPUTE_ENTROPY")},
    since="0.2.0",
    removed_in="0.4.0",
)
