"""The engine contract: what every backend implements and what is built on it (docs/engine.md).

``BaseEngine`` (``base``: the methods, the loss contract ``LossFn``, ``ForwardBackwardResult``,
``forward_options``, ``top_k_option``), ``build_engine`` (``factory``: a backend looked up through the
plugins and checked), ``Topology`` and ``check_topologies`` (``topology``: the layout a model-parallel
engine reports), ``run_micro_batches`` (``loop``: the micro-batch loop every backend runs the loss contract
with) and ``resolve_device`` (``device``: ``config.device`` as a ``torch.device``). What backends are
built from (``HFEngine``, models, checkpoints, LoRA, the optimiser) is ``verl_core.toolkit``.

Every name below is importable from ``verl_core.engine``, its one public home; imports are lazy, so
``import verl_core.engine`` does not pull in torch until a name that needs it is used. Names that
lived here before 0.2.0 still import, with a deprecation warning naming their new home.
"""

from verl_core.deprecation import moved_names
from verl_core.lazy import lazy_exports

_EXPORTS = {
    "BaseEngine": "verl_core.engine.base",
    "ForwardBackwardResult": "verl_core.engine.base",
    "LossFn": "verl_core.engine.base",
    "forward_options": "verl_core.engine.base",
    "top_k_option": "verl_core.engine.base",
    "build_engine": "verl_core.engine.factory",
    "run_micro_batches": "verl_core.engine.loop",
    "Topology": "verl_core.engine.topology",
    "check_topologies": "verl_core.engine.topology",
    "resolve_device": "verl_core.engine.device",
}

#: Names this package exported in 0.1.0 whose home is now another package.
_MOVED = {
    **{name: f"verl_core.data:{name}" for name in ("TEMPERATURE", "COMPUTE_ENTROPY", "LOG_PROBS", "ENTROPY")},
    **{name: f"verl_core.distributed:{name}" for name in ("barrier", "all_reduce_sum", "all_reduce_max")},
    "CheckpointError": "verl_core.errors:CheckpointError",
    **{
        name: f"verl_core.toolkit:{name}"
        for name in (
            "HFEngine",
            "load_hf_model",
            "check_model_dir",
            "forward_micro_batch",
            "pack_sequences",
            "export_hf_model",
            "save_hf_model_from_params",
            "log_probs_from_logits",
            "entropy_from_logits",
            "log_probs_and_entropy",
            "chunked_log_probs_and_entropy",
            "TorchOptimizerSteps",
            "build_optimizer",
            "build_lr_scheduler",
            "lr_multiplier",
            "validate_optim_config",
            "clip_grad_norm_and_step",
            "move_optimizer_state",
            "move_module",
            "atomic_checkpoint",
            "atomic_directory",
            "open_checkpoint",
            "reading_checkpoint",
            "load_checkpoint_file",
            "load_model_state",
            "CheckpointInfo",
            "seeded",
            "rng_state",
            "set_rng_state",
            "save_rng_state",
            "load_rng_state",
        )
    },
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(
    __name__, _EXPORTS, moved=moved_names(__name__, _MOVED, since="0.2.0", removed_in="0.4.0")
)
