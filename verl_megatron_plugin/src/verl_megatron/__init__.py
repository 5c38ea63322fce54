"""verl-megatron-plugin: the megatron-core engine backend for verl-core (backend name ``megatron``).

Modules: ``plugin`` (the hook implementation the entry point names; imports nothing heavy),
``config`` (``MegatronConfig`` and ``check_layout``), ``hf_config`` (a Hugging Face config in
megatron-core's terms), ``weights`` (Hugging Face <-> megatron-core tensors, TP shards), ``model``
(``GPTModel`` chunks for a pipeline rank), ``vocab_parallel`` (log-probs and entropy from TP-split
logits), ``engine`` (``MegatronEngine``), ``cpu_bridge`` (the opt-in bridge that runs megatron-core on
a machine without CUDA). docs/backends/megatron.md documents them.
"""

__version__ = "0.2.0"
