"""The engine contract and the toolkit every backend reuses; docs/engine.md documents each name.

The contract: ``BaseEngine`` (``base``), ``build_engine`` (``factory``), ``Topology`` (``topology``).
The toolkit: ``HFEngine`` (``hf_engine``: everything a Hugging Face + ``torch.optim`` engine shares),
``hf`` (load a model for a role), ``hf_forward`` (one micro-batch of the batch contract through it),
``hf_export`` (its Hugging Face export), ``packing`` and ``varlen`` (padding-free micro-batches),
``loop`` (the micro-batch loop), ``logprob``, ``optim`` (AdamW,
the LR schedule, clipping, ``TorchOptimizerSteps``), ``checkpoint`` (atomic directories, reading them
back with named errors), ``seed`` (RNG state), ``device`` (moving modules), and
``verl_core.distributed`` (collectives over an optional group).

Every name below is importable from ``verl_core.engine`` directly; imports are lazy, so that
``import verl_core.engine`` does not pull in ``transformers`` until a name that needs it is used.
"""

from verl_core.lazy import lazy_exports

_EXPORTS = {
    # the contract
    "BaseEngine": "verl_core.engine.base",
    "ForwardBackwardResult": "verl_core.engine.base",
    "LossFn": "verl_core.engine.base",
    "TEMPERATURE": "verl_core.data.batch",
    "COMPUTE_ENTROPY": "verl_core.data.batch",
    "forward_options": "verl_core.engine.base",
    "build_engine": "verl_core.engine.factory",
    # the Hugging Face engine and its pieces
    "HFEngine": "verl_core.engine.hf_engine",
    "load_hf_model": "verl_core.engine.hf",
    "check_model_dir": "verl_core.engine.hf",
    "forward_micro_batch": "verl_core.engine.hf_forward",
    "pack_sequences": "verl_core.engine.packing",
    "export_hf_model": "verl_core.engine.hf_export",
    "save_hf_model_from_params": "verl_core.engine.hf_export",
    "LOG_PROBS": "verl_core.data.batch",
    "ENTROPY": "verl_core.data.batch",
    "DTYPES": "verl_core.engine.hf",
    "PLAIN_HEAD_MODEL_TYPES": "verl_core.engine.hf_forward",
    "run_micro_batches": "verl_core.engine.loop",
    "log_probs_from_logits": "verl_core.engine.logprob",
    "entropy_from_logits": "verl_core.engine.logprob",
    "log_probs_and_entropy": "verl_core.engine.logprob",
    "chunked_log_probs_and_entropy": "verl_core.engine.logprob",
    # optimiser
    "TorchOptimizerSteps": "verl_core.engine.optim",
    "build_optimizer": "verl_core.engine.optim",
    "build_lr_scheduler": "verl_core.engine.optim",
    "lr_multiplier": "verl_core.engine.optim",
    "validate_optim_config": "verl_core.engine.optim",
    "clip_grad_norm_and_step": "verl_core.engine.optim",
    "move_optimizer_state": "verl_core.engine.optim",
    # devices and collectives
    "resolve_device": "verl_core.engine.device",
    "move_module": "verl_core.engine.device",
    "device_type": "verl_core.engine.device",
    "barrier": "verl_core.distributed",
    "all_reduce_sum": "verl_core.distributed",
    "all_reduce_max": "verl_core.distributed",
    # checkpoints and randomness
    "atomic_checkpoint": "verl_core.engine.checkpoint",
    "atomic_directory": "verl_core.engine.checkpoint",
    "open_checkpoint": "verl_core.engine.checkpoint",
    "reading_checkpoint": "verl_core.engine.checkpoint",
    "load_checkpoint_file": "verl_core.engine.checkpoint",
    "load_model_state": "verl_core.engine.checkpoint",
    "CheckpointError": "verl_core.engine.checkpoint",
    "CheckpointInfo": "verl_core.engine.checkpoint",
    "seeded": "verl_core.engine.seed",
    "rng_state": "verl_core.engine.seed",
    "set_rng_state": "verl_core.engine.seed",
    "save_rng_state": "verl_core.engine.seed",
    "load_rng_state": "verl_core.engine.seed",
    "RNG_FILE": "verl_core.engine.seed",
    # the layout a (model-parallel) engine reports
    "Topology": "verl_core.engine.topology",
    "check_topologies": "verl_core.engine.topology",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
