"""verl-ulysses: a VeOmni-style verl-core engine backend (FSDP2 + Ulysses sequence parallelism).

Select it with ``engine.backend: ulysses``. This package stays light: the engine (and torch) is
imported only when the backend is used.
"""

__version__ = "0.1.0"
