"""Moved to ``verl_core.toolkit`` (the engine toolkit, docs/engine.md) in verl-core 0.2.0: the names
that were public here still import, each use warning with its new home, until 0.4.0."""

from verl_core.deprecation import moved_names

__getattr__ = moved_names(
    __name__,
    {
        name: f"verl_core.toolkit:{name}"
        for name in (
            "TorchOptimizerSteps",
            "build_lr_scheduler",
            "build_optimizer",
            "clip_grad_norm_and_step",
            "lr_multiplier",
            "move_optimizer_state",
            "validate_optim_config",
        )
    },
    since="0.2.0",
    removed_in="0.4.0",
)
