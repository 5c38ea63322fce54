"""The PPO/GRPO and SFT loops, checkpoints, metrics.

The names below are importable from ``verl_core.trainer``; imports are lazy, so that using one part
(``verl-core plot`` draws curves) does not load the others (torch, Ray).
"""

from verl_core.lazy import lazy_exports

_EXPORTS = {
    "RLTrainer": "verl_core.trainer.rl",
    "SFTTrainer": "verl_core.trainer.sft",
    "plot_run": "verl_core.trainer.plot",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
