"""verl-ddp: a verl-core engine backend on ``torch.nn.parallel.DistributedDataParallel``.

Select it with ``engine.backend: ddp``. This package stays light: the engine (and torch) is
imported only when the backend is used.
"""

__version__ = "0.2.0"
