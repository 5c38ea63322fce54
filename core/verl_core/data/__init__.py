"""The batch contract (verl's key names), global counts, micro-batching, and the datasets: prompt
files for RL and prompt/response files for SFT, and the seeded, resumable epoch order of prompts."""
