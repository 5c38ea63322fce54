"""Deprecated since verl-core 0.2.0, removed in 0.4.0: the collectives moved to ``verl_core.distributed``
(the data layer below the engine uses them too). Every name still imports from here, with a warning."""

from verl_core.deprecation import moved_module

__getattr__, __dir__, __all__ = moved_module(
    __name__, "verl_core.distributed", since="0.2.0", removed_in="0.4.0"
)
