"""The batch contract (verl's key names), global counts, micro-batching, and the datasets: prompt
files for RL and prompt/response files for SFT, and the seeded, resumable epoch order of prompts.

The names below are importable from ``verl_core.data`` and from their module; imports are lazy
(``tensordict`` and torch load only when a name that needs them is used).
"""

from verl_core.lazy import lazy_exports

_BATCH = "verl_core.data.batch"
_MICROBATCH = "verl_core.data.microbatch"
_DATASET = "verl_core.data.dataset"
_SAMPLER = "verl_core.data.sampler"

_EXPORTS = {
    # batch keys
    "INPUT_IDS": _BATCH,
    "ATTENTION_MASK": _BATCH,
    "POSITION_IDS": _BATCH,
    "RESPONSES": _BATCH,
    "RESPONSE_MASK": _BATCH,
    "OLD_LOG_PROBS": _BATCH,
    "REF_LOG_PROB": _BATCH,
    "ADVANTAGES": _BATCH,
    "RETURNS": _BATCH,
    "VALUES": _BATCH,
    "TOKEN_LEVEL_REWARDS": _BATCH,
    "ROLLOUT_LOG_PROBS": _BATCH,
    "SCORES": _BATCH,
    "UID": _BATCH,
    "ENVIRONMENT_REWARDS": _BATCH,
    "ROLLOUT_POLICY_VERSIONS": _BATCH,
    "TEMPERATURE": _BATCH,
    "COMPUTE_ENTROPY": _BATCH,
    "TOP_K": _BATCH,
    "CANDIDATE_IDS": _BATCH,
    "TEACHER_LOG_PROBS": _BATCH,
    "TEACHER_TOP_K_LOG_PROBS": _BATCH,
    "TEACHER_TOP_K_IDS": _BATCH,
    "GLOBAL_COUNTS": _BATCH,
    # model outputs
    "LOG_PROBS": _BATCH,
    "ENTROPY": _BATCH,
    "TOP_K_LOG_PROBS": _BATCH,
    "TOP_K_IDS": _BATCH,
    "CANDIDATE_LOG_PROBS": _BATCH,
    # global counts and batch helpers
    "GlobalCounts": _BATCH,
    "compute_global_counts": _BATCH,
    "attach_global_counts": _BATCH,
    "get_global_counts": _BATCH,
    "join_prompts_and_responses": _BATCH,
    "left_pad": _BATCH,
    "responses_batch": _BATCH,
    "concat_batches": _BATCH,
    # micro-batching
    "MicroBatchSplit": _MICROBATCH,
    "split_micro_batches": _MICROBATCH,
    # datasets and their order
    "read_rows": "verl_core.data.files",
    "PromptDataset": _DATASET,
    "PromptRow": _DATASET,
    "SFTDataset": _DATASET,
    "SFTRow": _DATASET,
    "load_prompt_datasets": _DATASET,
    "EpochSampler": _SAMPLER,
    "SamplerBatch": _SAMPLER,
    "sequential_batches": _SAMPLER,
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
