"""Moved to ``verl_core.toolkit`` (the engine toolkit, docs/engine.md) in verl-core 0.2.0: the names
that were public here still import, each use warning with its new home, until 0.4.0."""

from verl_core.deprecation import moved_names

__getattr__ = moved_names(
    __name__,
    {
        name: f"verl_core.toolkit:{name}"
        for name in (
            "chunked_log_probs_and_entropy",
            "entropy_from_logits",
            "log_probs_and_entropy",
            "log_probs_from_logits",
        )
    },
    since="0.2.0",
    removed_in="0.4.0",
)
