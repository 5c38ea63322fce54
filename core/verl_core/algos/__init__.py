"""RL algorithms: advantage estimators, policy and value losses, KL, loss aggregation.

Import the submodules directly (``verl_core.algos.advantage`` ...); this package stays light so that
``verl_core.algos.catalog`` can be read without importing torch.
"""
