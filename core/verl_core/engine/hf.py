"""Moved to ``verl_core.toolkit`` (the engine toolkit, docs/engine.md) in verl-core 0.2.0: the names
that were public here still import, each use warning with its new home, until 0.4.0."""

from verl_core.deprecation import moved_names

__getattr__ = moved_names(
    __name__,
    {
        name: f"verl_core.toolkit:{name}"
        for name in (
            "DTYPES",
            "PLAIN_HEAD_MODEL_TYPES",
            "PackedSequences",
            "check_model_dir",
            "export_hf_model",
            "forward_micro_batch",
            "load_hf_model",
            "save_hf_model_from_params",
        )
    }
    | {"ENTROPY": "verl_core.data:ENTROPY", "LOG_PROBS": "verl_core.data:LOG_PROBS"},
    since="0.2.0",
    removed_in="0.4.0",
)
