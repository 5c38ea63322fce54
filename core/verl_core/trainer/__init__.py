"""The PPO/GRPO and SFT loops, checkpoints, metrics.

Import the modules by name (``verl_core.trainer.metrics``): the package itself imports nothing, so
that using one part (``verl-core plot`` draws curves) does not load the others (torch, Ray).
"""
