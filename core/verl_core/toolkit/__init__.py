"""The engine toolkit: what engine backends are built from (docs/engine.md#the-toolkit).

``verl_core.engine`` is the contract every backend implements; this package is the shared
implementation a backend over a Hugging Face model builds on, so that plugins never copy it:

- ``HFEngine``: model loading, the forward pass of the batch contract, AdamW and the LR schedule,
  offload, weight export and the Hugging Face export; a backend adds its parallel layout;
- what an ``HFEngine`` holds: its ``Adapter`` (``NoAdapter``, or ``LoraAdapter`` for LoRA) and its
  ``CheckpointFormat`` (``ReplicatedCheckpoint``, ``DistributedCheckpoint``);
- the pieces, for engines with a forward pass or checkpoints of their own: models, log-probs,
  padding-free packing, the optimiser, offload, atomic checkpoint directories, RNG state.

Every name below is importable from ``verl_core.toolkit``, which is its one public home; imports are
lazy, so ``import verl_core.toolkit`` pulls in neither torch nor ``transformers`` until a name needs it.
"""

from verl_core.lazy import lazy_exports

_EXPORTS = {
    # the Hugging Face engine and the components it holds
    "HFEngine": "verl_core.toolkit.hf_engine",
    "Adapter": "verl_core.toolkit.lora",
    "NoAdapter": "verl_core.toolkit.lora",
    "LoraAdapter": "verl_core.toolkit.lora",
    "LORA_ADAPTER_DIR": "verl_core.toolkit.lora",
    "CheckpointFormat": "verl_core.toolkit.formats",
    "ReplicatedCheckpoint": "verl_core.toolkit.formats",
    "DistributedCheckpoint": "verl_core.toolkit.formats",
    # models: loading, the forward pass, the Hugging Face export
    "DTYPES": "verl_core.toolkit.model",
    "load_hf_model": "verl_core.toolkit.model",
    "check_model_dir": "verl_core.toolkit.model",
    "forward_micro_batch": "verl_core.toolkit.forward",
    "lm_head_outputs": "verl_core.toolkit.forward",
    "scatter_positions": "verl_core.toolkit.forward",
    "plain_head_model": "verl_core.toolkit.forward",
    "PLAIN_HEAD_MODEL_TYPES": "verl_core.toolkit.forward",
    "export_hf_model": "verl_core.toolkit.export",
    "save_hf_model_from_params": "verl_core.toolkit.export",
    "pack_sequences": "verl_core.toolkit.packing",
    "PackedSequences": "verl_core.toolkit.packing",
    "log_probs_from_logits": "verl_core.toolkit.logprob",
    "entropy_from_logits": "verl_core.toolkit.logprob",
    "log_probs_and_entropy": "verl_core.toolkit.logprob",
    "chunked_log_probs_and_entropy": "verl_core.toolkit.logprob",
    "token_log_probs": "verl_core.toolkit.logprob",
    "chunked_token_log_probs": "verl_core.toolkit.logprob",
    "TokenLogProbs": "verl_core.toolkit.logprob",
    # the optimiser and offload
    "TorchOptimizerSteps": "verl_core.toolkit.optim",
    "build_optimizer": "verl_core.toolkit.optim",
    "build_lr_scheduler": "verl_core.toolkit.optim",
    "lr_multiplier": "verl_core.toolkit.optim",
    "validate_optim_config": "verl_core.toolkit.optim",
    "clip_grad_norm_and_step": "verl_core.toolkit.optim",
    "move_module": "verl_core.toolkit.offload",
    "move_optimizer_state": "verl_core.toolkit.offload",
    # checkpoint directories and randomness
    "atomic_checkpoint": "verl_core.toolkit.checkpoint",
    "atomic_directory": "verl_core.toolkit.checkpoint",
    "open_checkpoint": "verl_core.toolkit.checkpoint",
    "reading_checkpoint": "verl_core.toolkit.checkpoint",
    "load_checkpoint_file": "verl_core.toolkit.checkpoint",
    "load_model_state": "verl_core.toolkit.checkpoint",
    "CheckpointInfo": "verl_core.toolkit.checkpoint",
    "seeded": "verl_core.toolkit.seed",
    "rng_state": "verl_core.toolkit.seed",
    "set_rng_state": "verl_core.toolkit.seed",
    "save_rng_state": "verl_core.toolkit.seed",
    "load_rng_state": "verl_core.toolkit.seed",
    "RNG_FILE": "verl_core.toolkit.seed",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
