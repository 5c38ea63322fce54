"""Laying a Hugging Face model out with FSDP2: the device mesh, the units, mixed precision, offload.

``fully_shard`` is applied bottom-up: first every module of a ``shard_modules`` class (by default the
model's decoder layers, from its ``_no_split_modules``), then the root, which takes what is left
(embeddings, final norm, output head). The mesh has one dimension (FSDP), or two with
``shard_size`` (HSDP: sharded within groups, replicated across them). Parameters are real tensors
when sharded (the model was loaded on the CPU) unless ``load_on_rank0`` built them on the meta
device, in which case ``verl_fsdp.loading`` fills every parameter and buffer from rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from verl_core.errors import ConfigError
from verl_core.toolkit import DTYPES
from verl_fsdp.config import FSDPConfig

#: Where errors about the options point in a config, unless the engine says where its options sit.
OPTIONS_PATH = "engine.fsdp"


def dp_mesh(
    group: dist.ProcessGroup, device: torch.device, shard_size: int | None = None, where: str = OPTIONS_PATH
) -> DeviceMesh:
    """The mesh FSDP shards over: one dimension over the data-parallel ``group`` on ``device``'s type,
    or, with ``shard_size`` (HSDP), two: ``("replicate", "shard")``, consecutive ranks sharing shards.

    The 2-D mesh creates its process groups with every rank of the job (``group`` must be the world,
    as it is for a purely data-parallel engine).
    """
    size = group.size()
    check_shard_size(shard_size, size, where)
    if shard_size is None or shard_size == size:
        return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(size // shard_size, shard_size)
    return DeviceMesh(device.type, ranks, mesh_dim_names=("replicate", "shard"))


def check_shard_size(shard_size: int | None, dp_size: int, where: str = OPTIONS_PATH) -> None:
    """``shard_size`` must split the ``dp_size`` ranks into equal groups."""
    if shard_size is None or dp_size % shard_size == 0:
        return
    divisors = [n for n in range(1, dp_size + 1) if dp_size % n == 0]
    raise ConfigError(
        [
            (
                f"{where}.shard_size",
                f"{shard_size} does not divide the {dp_size} data-parallel ranks into equal groups: use one "
                f"of {divisors}, or leave it unset to shard across all ranks",
            )
        ]
    )


def shard_model(
    model: torch.nn.Module, options: FSDPConfig, mesh: DeviceMesh, where: str = OPTIONS_PATH
) -> FSDPModule:
    """Apply ``fully_shard`` to each unit of ``model`` and then to its root, in place.

    FSDP moves each unit to ``mesh``'s device as it shards it (or keeps it on the CPU under
    ``cpu_offload``), so the full model never has to fit on the device at once.
    """
    check_offload_backend(options, mesh, where)
    common = {
        "mesh": mesh,
        "mp_policy": mixed_precision(options),
        "offload_policy": offload_policy(options, mesh.device_type),
    }
    # Parameters kept gathered for the whole step are not freed between a unit's forward and backward.
    reshard_after_forward = options.reshard_after_forward and not options.keep_params_gathered
    for unit in shard_units(model, options.shard_modules, where):
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **common)
    # The root's parameters (the output head) are needed again as soon as backward starts.
    return fully_shard(model, reshard_after_forward=False, **common)


def shard_units(
    model: torch.nn.Module, class_names: tuple[str, ...], where: str = OPTIONS_PATH
) -> list[torch.nn.Module]:
    """The modules of ``model`` that become FSDP units, children before parents.

    Explicit ``class_names`` must all occur in the model; the default (the model's
    ``_no_split_modules``) may name none, and the root is then the only unit.
    """
    wanted = set(class_names) or set(getattr(model, "_no_split_modules", None) or ())
    units = [module for module in model.modules() if module is not model and type(module).__name__ in wanted]
    missing = sorted(set(class_names) - {type(unit).__name__ for unit in units})
    if missing:
        present = sorted(
            {
                type(m).__name__
                for m in model.modules()
                if m is not model and next(m.parameters(), None) is not None
            }
        )
        raise ConfigError(
            [
                (
                    f"{where}.shard_modules",
                    f"{missing} not found in {type(model).__name__}; its module classes with parameters "
                    f"are {present}; name some of those, or leave shard_modules empty for its decoder layers",
                )
            ]
        )
    # ``modules()`` lists parents before children; FSDP must shard children first.
    return units[::-1]


def mixed_precision(options: FSDPConfig) -> MixedPrecisionPolicy:
    """The policy for ``param_dtype`` / ``reduce_dtype`` (None: no casting)."""
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[options.param_dtype] if options.param_dtype else None,
        reduce_dtype=DTYPES[options.reduce_dtype] if options.reduce_dtype else None,
    )


def offload_policy(options: FSDPConfig, device_type: str) -> OffloadPolicy:
    """``CPUOffloadPolicy`` under ``cpu_offload``; pinned memory only where there is a device to
    copy to (pinning fails on a CPU-only machine)."""
    if not options.cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


def check_offload_backend(options: FSDPConfig, mesh: DeviceMesh, where: str = OPTIONS_PATH) -> None:
    """Under ``cpu_offload`` on an accelerator, gradient norms and weight gathers run on CPU tensors,
    which NCCL cannot reduce: the process group needs a CPU backend as well."""
    if not options.cpu_offload or mesh.device_type == "cpu":
        return
    backend = str(dist.get_backend(mesh.get_group()))
    if "gloo" not in backend:
        raise ConfigError(
            [
                (
                    f"{where}.cpu_offload",
                    f"keeps sharded state on the CPU, but the process group's backend is {backend!r}, which "
                    f"cannot reduce CPU tensors: initialise torch.distributed with "
                    f"backend='cpu:gloo,{mesh.device_type}:{backend}', or turn cpu_offload off",
                )
            ]
        )


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    """Every FSDP unit of a sharded model, the root included."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def discard_unreduced_gradients(model: torch.nn.Module) -> None:
    """Drop the gradients FSDP accumulated unsharded under ``set_requires_gradient_sync(False)`` and
    never reduce-scattered (a step that failed between micro-batches).

    ``FSDPModule.reset_iter_state`` restores FSDP's iteration state after such a failure but keeps
    these gradients, and the next step's reduction would add them in. FSDP has no public call for
    this, so it reaches into FSDP2's parameter groups; the engine's recovery test guards the layout.
    """
    for unit in fsdp_units(model):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):  # allocated once the unit ran
                    fsdp_param.unsharded_param.grad = None


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded (DTensor) tensor, gathered over its mesh; plain tensors pass through."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
