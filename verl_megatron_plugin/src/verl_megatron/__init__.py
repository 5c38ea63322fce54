"""verl-megatron-plugin: the Megatron-core engine backend for verl-core (backend name ``megatron``).

The engine is not written yet. Until it is, this distribution registers no backend (it declares no
``verl_core.plugins`` entry point) and does not depend on ``megatron-core``, so ``verl-core plugins``
does not list ``megatron`` and selecting it fails with core's "unknown backend" error instead of
reaching a half-built engine. What exists, for the engine to build on: the options and the layout
checks (``verl_megatron.config``) and the Hugging Face config in megatron-core's terms
(``verl_megatron.hf_config``), neither importing torch or megatron-core.
"""

__version__ = "0.1.0"
