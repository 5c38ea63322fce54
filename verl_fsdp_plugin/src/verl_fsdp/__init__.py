"""verl-fsdp-plugin: the PyTorch FSDP2 engine backend for verl-core (backend name ``fsdp``).

Select it with ``engine.backend: fsdp``; its options are ``verl_fsdp.config.FSDPConfig`` (the
``engine.fsdp`` section). The distribution registers the backend through its ``verl_core.plugins``
entry point ``fsdp`` (``verl_fsdp.plugin``). This package stays light: the engine (and torch) is
imported only when the backend is used.
"""

__version__ = "0.2.0"
