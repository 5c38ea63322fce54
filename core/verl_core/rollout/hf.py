"""``HFRollout``: core's built-in rollout, a KV-cache decoding loop over a Hugging Face causal LM.

The prompts of a batch are left-padded and prefilled in one forward pass, each distinct prompt once
(the ``n`` samples of a prompt share its prefill's cache); then each step feeds the
newest token of every row still decoding with the cache, the attention mask grown by one column and
each row's next position. A row finishes at an EOS token (kept as the response's last token) or at
``max_new_tokens``; a finished row leaves the batch and the cache at once, so later steps cost only
what the remaining rows need; decoding stops once every row has finished. Responses come back
right-padded to the longest one, with the log-probs of their tokens (see ``verl_core.rollout.base``).
The forward passes run on a decoder (``verl_core.rollout.decoder``): ``LeanDecoder`` for
Llama-architecture models, the model's own forward otherwise.

The rollout holds its own copy of the weights (in eval mode, no gradients) and takes the trained
ones through ``update_weights``, checking every name and shape against its model.

Rollout contract 2 (``RolloutCapabilities`` in ``verl_core.rollout.catalog``): requests are served one at
a time, each decoded as a call of one prompt is (the same tokens for the same seed), with ``abort``
checked between decoding steps; ``sleep()`` frees the KV cache and the packed weights' copies (the
weights stay: this rollout's weights are the ones it samples with, on its device); the n samples of a
prompt in one call share its prefill. Decoding is one call at a time (a lock): the decoder's cache
belongs to the rollout.

The request path keeps the KV caches of the last ``prefix_cache_sequences`` requests
(``verl_core.rollout.prefix_cache``): a request whose prompt begins as one of theirs did (a
conversation's next turn) prefills only the tokens after the longest such prefix, and samples what a
full prefill would have (the same tokens for the same seed; log-probs equal to float rounding, so
which requests came before may move one by ~1e-7). A weight update and ``sleep()`` clear them.
``prefilled_tokens`` and ``reused_tokens`` count the prompt tokens run through a prefill and those a
cached prefix served.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from verl_core.data.batch import ROLLOUT_LOG_PROBS, concat_batches, join_prompts_and_responses, left_pad
from verl_core.errors import ConfigError, RolloutError, did_you_mean
from verl_core.rollout.base import BaseRollout, SamplingParams
from verl_core.rollout.config import HFRolloutConfig
from verl_core.rollout.decoder import KVPrefix, decoder_for, packing_problem
from verl_core.rollout.prefix_cache import PrefixCache
from verl_core.rollout.requests import FinishReason, RolloutRequest, finish_reason
from verl_core.rollout.sampling import sample_next
from verl_core.toolkit.model import DTYPES, check_model_dir


class HFRollout(BaseRollout):
    """Generation with the rollout's own Hugging Face model on one rank."""

    options_class = HFRolloutConfig

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model: torch.nn.Module | None = None
        #: False while the weights are those of no policy (an update that failed half-way).
        self._consistent = True
        #: Between ``sleep()`` and ``wake_up()``.
        self._asleep = False
        #: Held while decoding: one call (or request) at a time uses the decoder and its cache.
        self._decoding = threading.Lock()
        #: The KV caches of recent requests, for the requests that continue them (sized by ``initialize``).
        self._prefix_cache = PrefixCache(0)
        #: Prompt tokens run through a prefill (by ``generate`` and by requests), and those a cached
        #: prefix served instead.
        self.prefilled_tokens = 0
        self.reused_tokens = 0

    def initialize(self) -> None:
        if self.model is not None:
            raise RuntimeError("HFRollout.initialize() was already called")
        path = check_model_dir(self.model_config.path, f"{self.config_path}.model.path")
        options = self.options
        dtype = DTYPES[self.model_config.dtype]
        lean = options.lean_decoder and options.attn_implementation == "sdpa"
        if lean and options.weight_packing != "auto":
            # A forced layout this machine cannot compute is refused before the model loads.
            problem = packing_problem(options.weight_packing, dtype, self.device)
            if problem:
                raise ConfigError([(f"{self.config_path}.hf.weight_packing", problem)])
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            dtype=dtype,
            attn_implementation=options.attn_implementation,
            trust_remote_code=self.model_config.trust_remote_code,
            local_files_only=True,
        )
        model.requires_grad_(False)
        self.model = model.eval().to(self.device)
        fuse = None if options.fused_projections == "auto" else options.fused_projections
        self._decoder = decoder_for(self.model, lean, packing=options.weight_packing, fuse=fuse)
        self._prefix_cache = PrefixCache(options.prefix_cache_sequences)

    # -- weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        model = self._initialized()
        self._awake("update the weights")
        expected = model.state_dict()
        seen: set[str] = set()
        self._consistent = False  # until every tensor has arrived
        self._prefix_cache.clear()  # computed with the weights this replaces
        for name, tensor in params:
            if name not in expected:
                raise RolloutError(
                    f"weight update: {name!r} is not a weight of the rollout's model"
                    f"{did_you_mean(name, expected)}; the engine must "
                    "export Hugging Face names (get_per_tensor_param)"
                )
            target = expected[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise RolloutError(
                    f"weight update: {name!r} has shape {list(tensor.shape)} but the rollout's model has "
                    f"{list(target.shape)}; the engine must export full (unsharded) tensors"
                )
            target.copy_(tensor)
            seen.add(name)
        missing = [name for name in expected if name not in seen]
        if missing:
            raise RolloutError(
                f"weight update: {len(missing)} weight(s) never arrived ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}); the rollout keeps refusing to generate until an "
                "update sends every weight"
            )
        self._consistent = True

    # -- generation ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> TensorDict:
        self._ready()
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        generator = torch.Generator(self.device).manual_seed(seed)
        size = self.options.max_batch_size or len(prompts)
        with self._decoding:
            try:
                parts = [
                    self._generate(prompts[i : i + size], sampling, generator)
                    for i in range(0, len(prompts), size)
                ]
            finally:
                # The KV cache and the packed weights hold memory the training step can use (as verl
                # frees its inference engine's cache between rollouts); the next weight update outdates
                # the copies.
                self._decoder.release()
        return concat_batches(parts, sampling.pad_token_id)

    # -- contract 2: requests, sleep -------------------------------------------------------------

    @torch.no_grad()
    def _serve_request(
        self, request: RolloutRequest, stop: threading.Event
    ) -> tuple[list[int], list[float], FinishReason]:
        """One request decoded alone, as ``generate`` decodes a call of its one prompt (the same seed
        gives the same tokens), ``stop`` checked between steps, from the longest cached prefix of its
        prompt; its own KV cache is kept for the requests that continue it. The decoder's cache and
        the weights' copies are kept for the next request (``sleep()`` frees them)."""
        self._ready()
        prompt, sampling, seed = request.continuation()
        generator = torch.Generator(self.device).manual_seed(seed)
        caching = self._prefix_cache.size > 0
        with self._decoding, torch.inference_mode():
            weights = self._weights_stamp() if caching else None
            prefix = self._prefix_cache.longest(prompt, weights) if caching else None
            _, tokens, log_probs = self._decode(
                [prompt], torch.ones(1, len(prompt), dtype=torch.int64), sampling, generator, stop, prefix
            )
            tokens = torch.cat(tokens).tolist() if tokens else []
            if caching and tokens:
                # The keys and values of the tokens the model ran: the last one sampled never was.
                ran = [*prompt, *tokens[:-1]]
                # A decoder that cannot hand out its cache (a subclass's own) prefills every prompt whole.
                take = getattr(self._decoder, "kv_prefix", None)
                kv = take(len(ran)) if take is not None else None
                if kv is not None:
                    self._prefix_cache.add(ran, kv, weights)
        log_probs = torch.cat(log_probs).tolist() if log_probs else []
        return tokens, log_probs, finish_reason(tokens, sampling, aborted=stop.is_set())

    def _weights_stamp(self) -> tuple:
        """What the weights are now: each parameter's storage and version counter (a weight update
        writes in place, moving the counter), so that a cached prefix serves only the weights it was
        computed with, whoever changed them."""
        return tuple((p.data_ptr(), p._version) for p in self._initialized().parameters())

    def sleep(self) -> None:
        """Free the KV cache, the requests' cached prefixes and the packed copies of the weights until
        ``wake_up()`` (the weights stay)."""
        self._initialized()
        with self._decoding:
            self._decoder.release()
            self._prefix_cache.clear()
            self._asleep = True

    def wake_up(self) -> None:
        self._asleep = False

    def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generator: torch.Generator
    ) -> TensorDict:
        prompt_ids, prompt_mask = left_pad(list(prompts), sampling.pad_token_id)
        batch = len(prompts)
        # Inference mode skips the bookkeeping no_grad still does per operator (version counters,
        # views): decoding steps of the demo's models take 10-15% less time. Its tensors stay inside:
        # the responses below are ordinary tensors, which the training engine may save for backward.
        with torch.inference_mode():
            sampled_rows, sampled_tokens, sampled_log_probs = self._decode(
                prompts, prompt_mask, sampling, generator
            )
        steps = len(sampled_rows)
        # (row, step) of every sampled token.
        at = (
            torch.cat(sampled_rows),
            torch.arange(steps).repeat_interleave(torch.tensor([len(rows) for rows in sampled_rows])),
        )
        responses = torch.full((batch, steps), sampling.pad_token_id, dtype=torch.int64)
        responses[at] = torch.cat(sampled_tokens).cpu()
        log_probs = torch.zeros(batch, steps)
        log_probs[at] = torch.cat(sampled_log_probs).cpu()
        response_mask = torch.zeros(batch, steps, dtype=torch.int64)
        response_mask[at] = 1
        output = join_prompts_and_responses(prompt_ids, prompt_mask, responses, response_mask)
        output[ROLLOUT_LOG_PROBS] = log_probs
        return output

    def _decode(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_mask: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator,
        stop: threading.Event | None = None,
        prefix: KVPrefix | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The decoding loop over ``prompts`` (left-padded: ``prompt_mask``): each step's rows (indices
        into ``prompts``), sampled tokens and their log-probs, to be written into the responses once
        decoding ends (one indexed write per tensor, not three per step: about 2% of a small model's
        rollout on the CPU). Decoding ends early once ``stop`` is set (an aborted request). ``prefix``:
        the keys and values of the one prompt's first tokens, which then are not prefilled again."""
        batch = len(prompts)
        device = self.device
        eos = torch.tensor(sampling.eos_token_ids, device=device)
        source, distinct = self._shared_prefills(prompts)
        distinct_ids, distinct_mask = left_pad(distinct, sampling.pad_token_id)

        # The rows still decoding: a row that has sampled EOS leaves the batch (and the cache), so
        # the steps after it cost only what the rows still generating need.
        rows = torch.arange(batch)
        sampled_rows: list[torch.Tensor] = []
        sampled_tokens: list[torch.Tensor] = []
        sampled_log_probs: list[torch.Tensor] = []
        next_position = prompt_mask.sum(dim=-1).to(device)  # each row's next position: its prompt length
        decoder = self._decoder
        capacity = prompt_mask.shape[1] + sampling.max_new_tokens
        if prefix is None:
            logits = decoder.prefill(distinct_ids.to(device), distinct_mask.to(device), capacity=capacity)
            self.prefilled_tokens += int(distinct_mask.sum())
        else:  # one unpadded prompt
            logits = decoder.extend(prefix, distinct_ids[:, prefix.length :].to(device), capacity=capacity)
            self.prefilled_tokens += distinct_ids.shape[1] - prefix.length
            self.reused_tokens += prefix.length
        if len(distinct) < batch:
            source = source.to(device)
            logits = logits[source]
            decoder.select(source)
        for step in range(sampling.max_new_tokens):
            tokens, token_log_probs = sample_next(logits, sampling, generator)
            sampled_rows.append(rows)
            sampled_tokens.append(tokens)
            sampled_log_probs.append(token_log_probs)
            going_on = ~torch.isin(tokens, eos)
            if not bool(going_on.any()) or step + 1 == sampling.max_new_tokens:
                break
            if stop is not None and stop.is_set():
                break
            if not bool(going_on.all()):
                keep = going_on.nonzero()[:, 0]
                decoder.select(keep)
                rows, tokens, next_position = rows[keep.cpu()], tokens[keep], next_position[keep]
            logits = decoder.step(tokens, next_position)
            next_position = next_position + 1
        return sampled_rows, sampled_tokens, sampled_log_probs

    @staticmethod
    def _shared_prefills(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[list[int]]]:
        """The prompts to prefill, each distinct prompt once, and for every row the index of its own:
        the n samples of a prompt share its prefill's logits and cache."""
        distinct: dict[tuple[int, ...], int] = {}
        source = torch.tensor([distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts])
        return source, [list(prompt) for prompt in distinct]

    def _initialized(self) -> torch.nn.Module:
        if self.model is None:
            raise RolloutError("HFRollout is not initialised: call initialize() first")
        return self.model

    def _awake(self, action: str) -> None:
        if self._asleep:
            raise RolloutError(
                f"the rollout is asleep (sleep() freed its cache): call wake_up() before you {action}"
            )

    def _ready(self) -> None:
        """Refuse to generate before ``initialize``, while asleep, or after a weight update that failed."""
        self._initialized()
        self._awake("generate")
        if not self._consistent:
            raise RolloutError("the last weight update failed half-way: update the weights before generating")
