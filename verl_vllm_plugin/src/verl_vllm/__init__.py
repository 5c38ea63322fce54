"""verl-vllm-plugin: the vLLM rollout backend for verl-core (backend name ``vllm``).

Select it with ``rollout.backend: vllm``; its options are ``verl_vllm.config.VLLMRolloutConfig`` (the
``rollout.vllm`` section). The distribution registers the backend through its ``verl_core.plugins``
entry point ``vllm`` (``verl_vllm.plugin``). This package stays light: the rollout (and torch and vLLM)
is imported only when the backend is used.
"""

__version__ = "0.2.0"
