"""``ServiceClient``, ``TrainingClient``, ``SamplingClient``: Tinker's three clients over core's engines and rollouts.

A ``TrainingClient`` owns one engine (any backend, built with ``build_engine``) and one worker thread:
every call checks its arguments at once (a bad ``Datum`` raises in the caller, naming it), then
returns an ``APIFuture`` and runs on that thread in the order of the calls, so that a loop can submit
``forward_backward`` and ``optim_step`` back to back and wait later. ``forward_backward`` accumulates
gradients until ``optim_step`` applies them with the step's ``AdamParams`` and zeroes them, as in
Tinker. A call that fails on the worker fails every later call of that client (its state is no
longer known), as Tinker's poisoned clients do.

Saved states live under ``state_dir``: ``<model_id>/weights/<name>`` (engine checkpoints: model,
optimiser, schedule and RNG, written atomically by the engine) and ``<model_id>/sampler_weights/<name>``
(Hugging Face exports the rollout loads). Their paths are Tinker's ``tinker://<model_id>/weights/<name>``
form; ``load_state`` and ``create_sampling_client`` take those or a local folder.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch

from verl_core.config import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
from verl_core.data import batch as keys
from verl_core.engine import build_engine, resolve_device
from verl_core.errors import did_you_mean
from verl_core.rollout.params import SamplingParams as RolloutSamplingParams
from verl_core.service.losses import (
    LOSS_INPUTS,
    DataBatch,
    build_batch,
    check_loss,
    engine_loss,
    loss_outputs,
    target_log_probs,
)
from verl_core.service.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    LoadWeightsResponse,
    ModelData,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    SupportedModel,
    TensorData,
)

T = TypeVar("T")

#: Tinker's LoRA switches, as the module names of Llama- and Qwen-style models.
LORA_MODULES = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}
#: The LoRA scale's numerator: the adapter's updates are scaled by ``LORA_ALPHA / rank``.
LORA_ALPHA = 32
#: Path segments of saved states: engine checkpoints and sampler (Hugging Face) exports.
WEIGHTS, SAMPLER_WEIGHTS = "weights", "sampler_weights"
#: What a run's folder records about its training client, for ``create_training_client_from_state``.
RUN_FILE = "run.json"


class APIFuture(concurrent.futures.Future):
    """A ``concurrent.futures.Future`` that can also be awaited (``await future``, or
    ``await future.result_async()``), as the tinker client's futures."""

    async def result_async(self, timeout: float | None = None) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(self), timeout)

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


class _Worker:
    """One thread running submitted calls in order, each resolving its ``APIFuture``. With ``poison``,
    a call that fails fails every later one (the state it left is unknown)."""

    def __init__(self, name: str, poison: bool):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._poison = poison
        self._failed: BaseException | None = None

    def submit(self, function: Callable[[], T]) -> APIFuture:
        future = APIFuture()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            if self._failed is not None:
                error = RuntimeError(
                    f"an earlier call of this client failed ({self._failed!r}); create a new client"
                )
                error.__cause__ = self._failed
                future.set_exception(error)
                return
            try:
                future.set_result(function())
            except BaseException as error:  # noqa: BLE001 - handed to the caller through the future
                if self._poison:
                    self._failed = error
                future.set_exception(error)

        self._executor.submit(run)
        return future

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{what} name {name!r}: give a non-empty name without '/' (a folder name)")
    return name


def _read_model_config(path: str) -> dict[str, Any]:
    config = Path(path) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


@attrs.frozen
class _Run:
    """What ``state_dir/<model_id>/run.json`` records."""

    base_model: str
    lora_rank: int | None
    target_modules: list[str] | None = None


class ServiceClient:
    """The entry point: base models by name, each a local Hugging Face folder, trained by engines
    built from ``engine`` (its ``model`` section with the base model's ``path``), sampled by the
    ``rollout`` backend (``hf``: core's own). Saved states go under ``state_dir``.

    ``engine`` defaults to the ``ddp`` backend on ``auto`` device, micro-batches of 8 sequences, and an
    optimiser that each ``optim_step``'s ``AdamParams`` overrides (learning rate, betas, eps, weight
    decay, clipping; the engine's learning-rate schedule is not used).
    """

    def __init__(
        self,
        base_models: Mapping[str, str],
        *,
        state_dir: str | Path,
        engine: EngineConfig | None = None,
        rollout: str = "hf",
        rollout_options: Any = None,
    ):
        if not base_models:
            raise ValueError("base_models is empty: give at least one name -> local model folder")
        self.base_models = dict(base_models)
        self.state_dir = Path(state_dir)
        self.engine_config = engine or EngineConfig(
            backend="ddp",
            model=ModelConfig(path=next(iter(self.base_models.values()))),
            optim=OptimConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, clip_grad=0.0),
            micro_batch=MicroBatchConfig(micro_batch_size=8),
        )
        self.rollout = rollout
        self.rollout_options = rollout_options
        self._worker = _Worker("verl-core-service", poison=False)
        self._clients: list[Any] = []

    # -- what is served ------------------------------------------------------------------------

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        return GetServerCapabilitiesResponse([SupportedModel(model_name=name) for name in self.base_models])

    def _model_path(self, base_model: str) -> str:
        if base_model not in self.base_models:
            raise ValueError(
                f"unknown base model {base_model!r}{did_you_mean(base_model, self.base_models)}: this "
                f"ServiceClient serves {sorted(self.base_models)}"
            )
        return self.base_models[base_model]

    # -- training clients ----------------------------------------------------------------------

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> APIFuture:
        """A future of a ``TrainingClient`` training a LoRA adapter of ``rank`` over ``base_model`` (its
        own engine: clients on one base model train side by side). ``train_attn``, ``train_mlp`` and
        ``train_unembed`` adapt the attention projections, the MLP and the LM head (``LORA_MODULES``)."""
        flags = {"train_attn": train_attn, "train_mlp": train_mlp, "train_unembed": train_unembed}
        run = self._lora_run(base_model, rank, flags)
        return self._worker.submit(lambda: self._create(run, seed))

    def _lora_run(self, base_model: str, rank: Any, flags: Mapping[str, bool]) -> _Run:
        """The run of a LoRA client of ``rank`` adapting the modules of ``flags`` (``LORA_MODULES``'
        switches) over ``base_model``, checked."""
        self._model_path(base_model)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank={rank!r}: the LoRA rank is an int >= 1")
        modules = [name for flag, on in flags.items() if on for name in LORA_MODULES[flag]]
        if not modules:
            raise ValueError("train_mlp, train_attn and train_unembed are all False: nothing would train")
        return _Run(base_model, rank, modules)

    def create_training_client(self, base_model: str, seed: int | None = None) -> APIFuture:
        """A future of a ``TrainingClient`` training every weight of ``base_model`` (not in Tinker,
        which trains LoRA only: for backends without LoRA and full fine-tuning)."""
        self._model_path(base_model)
        return self._worker.submit(lambda: self._create(_Run(base_model, None), seed))

    def create_training_client_from_state(self, path: str) -> APIFuture:
        """A future of a ``TrainingClient`` on the weights saved at ``path`` (``save_state``), with a
        fresh optimiser."""
        return self._from_state(path, optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str) -> APIFuture:
        """The same, restoring the optimiser's state too: training continues exactly."""
        return self._from_state(path, optimizer=True)

    def _from_state(self, path: str, optimizer: bool, model_id: str | None = None) -> APIFuture:
        folder = self.resolve_path(path, WEIGHTS)
        record = folder.parent.parent / RUN_FILE
        if not record.is_file():
            raise ValueError(
                f"{path}: no {RUN_FILE} beside it ({record}): not a state saved by a TrainingClient"
            )
        run = _Run(**json.loads(record.read_text()))
        self._model_path(run.base_model)

        def create() -> TrainingClient:
            client = self._create(run, None, model_id)
            client._load(folder, optimizer)
            return client

        return self._worker.submit(create)

    def _create(self, run: _Run, seed: int | None, model_id: str | None = None) -> TrainingClient:
        """A new training client of ``run``; ``model_id`` (a new one by default) names its folder."""
        template = self.engine_config
        model = attrs.evolve(template.model, path=self._model_path(run.base_model))
        if run.lora_rank is not None:
            model = attrs.evolve(
                model, lora_rank=run.lora_rank, lora_alpha=LORA_ALPHA, target_modules=list(run.target_modules)
            )
        config = attrs.evolve(template, model=model, seed=template.seed if seed is None else seed)
        engine = build_engine(config, role="lm")
        engine.initialize()
        model_id = model_id or uuid.uuid4().hex[:12]
        folder = self.state_dir / model_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RUN_FILE).write_text(json.dumps(attrs.asdict(run)))
        client = TrainingClient(self, model_id, run, engine)
        self._clients.append(client)
        return client

    # -- sampling clients ----------------------------------------------------------------------

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> APIFuture:
        """A future of a ``SamplingClient`` on the sampler weights at ``model_path``
        (``save_weights_for_sampler``'s path, or a local Hugging Face folder), or on ``base_model``."""
        if (model_path is None) == (base_model is None):
            raise ValueError("give one of model_path (saved sampler weights) and base_model")
        if base_model is not None:
            folder, name = Path(self._model_path(base_model)), base_model
        else:
            folder, name = self.resolve_path(model_path, SAMPLER_WEIGHTS), None
        return self._worker.submit(lambda: self._sampling_client(folder, name))

    def _sampling_client(self, folder: Path, base_model: str | None) -> SamplingClient:
        from verl_core.plugins import Kind, get_registry

        rollout_class = get_registry().entry(Kind.ROLLOUT_BACKENDS, self.rollout).load("rollout")
        device = str(resolve_device(self.engine_config.device))
        model = attrs.evolve(self.engine_config.model, path=str(folder), lora_rank=0, lora_adapter_path=None)
        rollout = rollout_class(model, self.rollout_options, device=device)
        rollout.initialize()
        client = SamplingClient(rollout, str(folder), base_model)
        self._clients.append(client)
        return client

    # -- paths ---------------------------------------------------------------------------------

    def resolve_path(self, path: str, kind: str) -> Path:
        """The folder of ``path``: ``tinker://<model_id>/<kind>/<name>`` under ``state_dir``, or a local
        folder; ``kind`` is ``weights`` (training states) or ``sampler_weights``."""
        if path.startswith("tinker://"):
            parts = path[len("tinker://") :].split("/")
            if len(parts) != 3 or parts[1] not in (WEIGHTS, SAMPLER_WEIGHTS):
                raise ValueError(f"{path}: expected tinker://<model_id>/{kind}/<name>")
            if parts[1] != kind:
                use = "load_state" if parts[1] == WEIGHTS else "create_sampling_client"
                raise ValueError(f"{path} holds {parts[1]}, not {kind}: give it to {use}")
            folder = self.state_dir / parts[0] / parts[1] / parts[2]
        else:
            folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{path}: no saved state at {folder}")
        return folder

    def close(self) -> None:
        """Stop every client's worker thread (after the calls already submitted)."""
        self._worker.close()
        for client in self._clients:
            client.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class TrainingClient:
    """One model being trained: ``forward_backward``, ``optim_step``, saving and sampling. Made by a
    ``ServiceClient``; ``engine`` is its engine (any backend)."""

    def __init__(self, service: ServiceClient, model_id: str, run: _Run, engine: Any):
        self.service = service
        self.model_id = model_id
        self.engine = engine
        self._run = run
        self._steps = 0
        self._worker = _Worker(f"verl-core-training-{model_id}", poison=True)
        self._vocab_size = _read_model_config(engine.config.model.path).get("vocab_size")

    # -- compute -------------------------------------------------------------------------------

    def forward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture:
        """A future of the ``ForwardBackwardOutput`` of ``loss_fn`` on ``data``, without gradients."""
        settings = check_loss(loss_fn, loss_fn_config)
        built = self._batch(data, LOSS_INPUTS[loss_fn])
        return self._worker.submit(
            lambda: self._forward_backward(built, loss_fn, settings, forward_only=True)
        )

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture:
        """A future of the ``ForwardBackwardOutput`` of ``loss_fn`` on ``data``; its gradients add to
        those of earlier calls until ``optim_step``."""
        settings = check_loss(loss_fn, loss_fn_config)
        built = self._batch(data, LOSS_INPUTS[loss_fn])
        return self._worker.submit(
            lambda: self._forward_backward(built, loss_fn, settings, forward_only=False)
        )

    def forward_backward_custom(
        self,
        data: Sequence[Datum],
        loss_fn: Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]],
    ) -> APIFuture:
        """``loss_fn(data, logprobs)`` (one tensor of target log-probs per datum) returns a scalar loss
        and metrics; its gradients reach the model as Tinker does it: a forward pass for the
        log-probs, the loss's gradient ``g`` with respect to them, then ``forward_backward`` of the
        linear surrogate ``-sum(weights * logprobs)`` with ``weights = -g`` (the same gradient).
        ``loss_fn_inputs`` may hold anything besides ``target_tokens``: only ``loss_fn`` reads it."""
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn is a {type(loss_fn).__name__}: give a function (data, logprobs) -> (loss, metrics)"
            )
        targets_only = [
            Datum(model_input=datum.model_input, loss_fn_inputs=self._targets(datum, index))
            for index, datum in enumerate(data)
        ]
        built = self._batch(targets_only, {"target_tokens": None})
        data = list(data)
        return self._worker.submit(lambda: self._custom(data, built, loss_fn))

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture:
        """A future of the ``OptimStepResponse`` of one AdamW step with ``adam_params`` (learning rate,
        betas, eps, weight decay and clipping set on the engine's optimiser first); the gradients are
        then zeroed."""
        params = AdamParams() if adam_params is None else adam_params
        if not isinstance(params, AdamParams):
            raise TypeError(f"optim_step takes AdamParams, got {type(params).__name__}")
        optimizer = getattr(self.engine, "optimizer", None)
        if not hasattr(optimizer, "param_groups"):
            raise ValueError(
                f"engine backend {self.engine.config.backend!r} keeps no torch optimiser in .optimizer, so "
                "AdamParams cannot be applied to it; use a backend built on verl_core.toolkit.HFEngine"
            )
        return self._worker.submit(lambda: self._optim_step(params))

    # -- state ---------------------------------------------------------------------------------

    def save_state(self, name: str, overwrite: bool = False) -> APIFuture:
        """A future of the ``SaveWeightsResponse`` whose path ``load_state`` takes: the engine's
        checkpoint (weights or adapter, optimiser, RNG), written atomically."""
        folder = self._folder(WEIGHTS, name, overwrite)

        def save() -> SaveWeightsResponse:
            self.engine.save_checkpoint(str(folder), global_step=self._steps)
            return SaveWeightsResponse(path=self._path(WEIGHTS, name))

        return self._worker.submit(save)

    def load_state(self, path: str) -> APIFuture:
        """Load the weights saved at ``path`` (``save_state``) with a fresh optimiser."""
        folder = self.service.resolve_path(path, WEIGHTS)
        return self._worker.submit(lambda: self._load(folder, optimizer=False, path=path))

    def load_state_with_optimizer(self, path: str) -> APIFuture:
        """Load the weights and the optimiser's state saved at ``path``: training continues exactly."""
        folder = self.service.resolve_path(path, WEIGHTS)
        return self._worker.submit(lambda: self._load(folder, optimizer=True, path=path))

    def save_weights_for_sampler(self, name: str, overwrite: bool = False) -> APIFuture:
        """A future of the ``SaveWeightsForSamplerResponse`` whose path ``create_sampling_client``
        takes: the engine's Hugging Face export (LoRA merged)."""
        folder = self._folder(SAMPLER_WEIGHTS, name, overwrite)

        def save() -> SaveWeightsForSamplerResponse:
            self.engine.save_hf_model(str(folder))
            return SaveWeightsForSamplerResponse(path=self._path(SAMPLER_WEIGHTS, name))

        return self._worker.submit(save)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> APIFuture:
        """A future of a ``SamplingClient`` on the weights as they are after the calls before this one
        (saved as sampler weights ``name``, by default ``step-<optimiser steps>-<n>``)."""
        name = name or f"step-{self._steps}-{uuid.uuid4().hex[:6]}"
        folder = self._folder(SAMPLER_WEIGHTS, name, overwrite=False)

        def save_and_load() -> SamplingClient:
            self.engine.save_hf_model(str(folder))
            return self.service._sampling_client(folder, self._run.base_model)

        return self._worker.submit(save_and_load)

    def create_sampling_client(self, model_path: str) -> APIFuture:
        return self.service.create_sampling_client(model_path=model_path)

    # -- about the model -----------------------------------------------------------------------

    def get_info(self) -> GetInfoResponse:
        rank = self._run.lora_rank
        return GetInfoResponse(
            model_id=self.model_id,
            model_data=ModelData(model_name=self._run.base_model),
            is_lora=rank is not None,
            lora_rank=rank,
        )

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer (from its folder)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.engine.config.model.path, local_files_only=True)

    def close(self) -> None:
        self._worker.close()

    # -- async spellings (the tinker client's): each returns the same future -------------------

    async def forward_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.forward(*args, **kwargs)

    async def forward_backward_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.forward_backward(*args, **kwargs)

    async def forward_backward_custom_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.forward_backward_custom(*args, **kwargs)

    async def optim_step_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.optim_step(*args, **kwargs)

    async def save_state_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.save_state(*args, **kwargs)

    async def load_state_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.load_state(*args, **kwargs)

    async def save_weights_for_sampler_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.save_weights_for_sampler(*args, **kwargs)

    async def save_weights_and_get_sampling_client_async(self, *args: Any, **kwargs: Any) -> SamplingClient:
        return await self.save_weights_and_get_sampling_client(*args, **kwargs)

    # -- on the worker -------------------------------------------------------------------------

    def _batch(self, data: Sequence[Datum], inputs: Mapping[str, str | None]) -> DataBatch:
        vocab_size = self._vocab_size if isinstance(self._vocab_size, int) else 2**63 - 1
        return build_batch(list(data), inputs, vocab_size)

    def _targets(self, datum: Datum, index: int) -> dict[str, TensorData]:
        if not isinstance(datum, Datum):
            raise TypeError(
                f"data[{index}] is a {type(datum).__name__}: build it with verl_core.service.Datum"
            )
        if "target_tokens" not in datum.loss_fn_inputs:
            raise ValueError(
                f"data[{index}].loss_fn_inputs lacks 'target_tokens': the custom loss reads their log-probs"
            )
        return {"target_tokens": datum.loss_fn_inputs["target_tokens"]}

    def _forward_backward(
        self, built: DataBatch, loss_fn: str, settings: Mapping[str, float], forward_only: bool
    ) -> ForwardBackwardOutput:
        engine = self.engine
        loss = engine_loss(loss_fn, settings)
        if forward_only:
            with engine.eval_mode():
                result = engine.infer_batch(built.batch, loss)
        else:
            with engine.train_mode():
                result = engine.forward_backward_batch(built.batch, loss, forward_only=False)
        return ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=loss_outputs(loss_fn, settings, result.outputs, built),
            metrics={"loss:sum": float(result.loss)},
        )

    def _custom(self, data: list[Datum], built: DataBatch, loss_fn: Callable) -> ForwardBackwardOutput:
        with self.engine.eval_mode():
            outputs = self.engine.infer_batch(built.batch).outputs
        log_probs = target_log_probs(outputs, built.batch).detach().float().cpu()
        leaves = [log_probs[row, :n].clone().requires_grad_(True) for row, n in enumerate(built.lengths)]
        loss, metrics = loss_fn(data, leaves)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"the custom loss returned {loss!r}: it must return (a scalar tensor, metrics)")
        loss.backward()
        weights = [
            torch.zeros_like(leaf) if leaf.grad is None else -leaf.grad for leaf in leaves
        ]  # a log-prob the loss ignores has no gradient
        surrogate = [
            Datum(
                model_input=datum.model_input, loss_fn_inputs={**self._targets(datum, i), "weights": weight}
            )
            for i, (datum, weight) in enumerate(zip(data, weights, strict=True))
        ]
        settings = check_loss("cross_entropy", None)
        result = self._forward_backward(
            self._batch(surrogate, LOSS_INPUTS["cross_entropy"]),
            "cross_entropy",
            settings,
            forward_only=False,
        )
        metrics = {name: float(value) for name, value in dict(metrics).items()}
        metrics["surrogate_loss:sum"] = result.metrics["loss:sum"]
        metrics["loss:sum"] = float(loss.detach())
        outputs = [{"logprobs": output["logprobs"]} for output in result.loss_fn_outputs]
        return ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=metrics
        )

    def _optim_step(self, params: AdamParams) -> OptimStepResponse:
        engine = self.engine
        optim = engine.config.optim
        if optim.clip_grad != params.grad_clip_norm:
            # The engine's optimizer_step clips to its config's clip_grad (docs/engine.md).
            engine.config = attrs.evolve(
                engine.config, optim=attrs.evolve(optim, clip_grad=params.grad_clip_norm)
            )
        for group in engine.optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        with engine.train_mode():
            grad_norm = engine.optimizer_step()
            engine.optimizer_zero_grad()
        self._steps += 1
        return OptimStepResponse(metrics={"grad_norm": grad_norm, "learning_rate": params.learning_rate})

    def _load(self, folder: Path, optimizer: bool, path: str | None = None) -> LoadWeightsResponse:
        engine = self.engine
        with engine.train_mode():
            self._steps = engine.load_checkpoint(str(folder))
            engine.optimizer_zero_grad()
            if not optimizer:
                engine.optimizer.state.clear()  # AdamW's moments start again, as a new optimiser's
        return LoadWeightsResponse(path=path or str(folder))

    def _folder(self, kind: str, name: str, overwrite: bool) -> Path:
        folder = self.service.state_dir / self.model_id / kind / _check_name(name, kind)
        if folder.exists() and not overwrite:
            raise FileExistsError(
                f"{self._path(kind, name)} exists ({folder}): pick another name or pass overwrite=True"
            )
        return folder

    def _path(self, kind: str, name: str) -> str:
        return f"tinker://{self.model_id}/{kind}/{name}"


class SamplingClient:
    """Samples from fixed weights with a rollout backend (``rollout``), one call at a time in order."""

    def __init__(self, rollout: Any, model_path: str, base_model: str | None):
        self.rollout = rollout
        self.model_path = model_path
        self.base_model = base_model
        config = _read_model_config(model_path)
        eos = config.get("eos_token_id")
        self._eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        self._pad_token_id = config.get("pad_token_id") or 0
        self._worker = _Worker("verl-core-sampling", poison=False)
        self._seeds = random.Random()

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> APIFuture:
        """A future of the ``SampleResponse``: ``num_samples`` continuations of ``prompt``, each with its
        tokens, their log-probs and why it stopped."""
        tokens = self._prompt(prompt)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples={num_samples!r}: an int >= 1")
        if topk_prompt_logprobs:
            raise ValueError("topk_prompt_logprobs is not supported: leave it 0")
        sampling = self._sampling(sampling_params)
        seed = self._seeds.randrange(2**31) if sampling_params.seed is None else sampling_params.seed
        return self._worker.submit(
            lambda: self._sample(tokens, num_samples, sampling, seed, include_prompt_logprobs)
        )

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture:
        """A future of each prompt token's log-prob given the tokens before it (``None`` for the first)."""
        tokens = self._prompt(prompt)
        return self._worker.submit(lambda: self._prompt_logprobs(tokens))

    async def sample_async(self, *args: Any, **kwargs: Any) -> SampleResponse:
        return await self.sample(*args, **kwargs)

    async def compute_logprobs_async(self, *args: Any, **kwargs: Any) -> list[float | None]:
        return await self.compute_logprobs(*args, **kwargs)

    def get_base_model(self) -> str | None:
        return self.base_model

    def close(self) -> None:
        self._worker.close()

    def _prompt(self, prompt: ModelInput) -> list[int]:
        if not isinstance(prompt, ModelInput):
            raise TypeError(f"prompt is a {type(prompt).__name__}: build it with ModelInput.from_ints")
        tokens = prompt.to_ints()
        if not tokens:
            raise ValueError("the prompt has no tokens")
        return tokens

    def _sampling(self, params: SamplingParams) -> RolloutSamplingParams:
        if params.max_tokens is None:
            raise ValueError("SamplingParams.max_tokens is required: the most tokens a sample may have")
        if params.stop is None:
            stop = self._eos_token_ids
        elif isinstance(params.stop, str) or any(isinstance(item, str) for item in params.stop):
            raise ValueError(
                f"SamplingParams.stop={params.stop!r}: stop strings are not supported; give stop token ids "
                "(a list of ints), [] for none, or None for the model's EOS token"
            )
        else:
            stop = tuple(int(item) for item in params.stop)
        return RolloutSamplingParams(
            max_new_tokens=params.max_tokens,
            eos_token_ids=stop,
            pad_token_id=self._pad_token_id,
            temperature=params.temperature,
            top_k=0 if params.top_k == -1 else params.top_k,
            top_p=params.top_p,
        )

    def _sample(
        self, prompt: list[int], count: int, sampling: RolloutSamplingParams, seed: int, prompt_logprobs: bool
    ) -> SampleResponse:
        batch = self.rollout.generate([prompt] * count, sampling, seed=seed)
        sequences = []
        for row in range(count):
            keep = batch[keys.RESPONSE_MASK][row].bool()
            tokens = batch[keys.RESPONSES][row][keep].tolist()
            log_probs = batch[keys.ROLLOUT_LOG_PROBS][row][keep].tolist()
            stopped = bool(tokens) and tokens[-1] in sampling.eos_token_ids
            sequences.append(SampledSequence("stop" if stopped else "length", tokens, log_probs))
        return SampleResponse(sequences, self._prompt_logprobs(prompt) if prompt_logprobs else None)

    @torch.no_grad()
    def _prompt_logprobs(self, prompt: list[int]) -> list[float | None]:
        model = getattr(self.rollout, "model", None)
        if model is None:
            raise ValueError(
                f"the rollout backend {type(self.rollout).__name__} exposes no model (.model) to score a "
                "prompt with: prompt log-probs need the hf rollout"
            )
        device = next(model.parameters()).device
        logits = model(torch.tensor([prompt], device=device)).logits[0, :-1].float()
        scores = torch.log_softmax(logits, dim=-1).gather(
            -1, torch.tensor(prompt[1:], device=device)[:, None]
        )
        return [None, *scores[:, 0].cpu().tolist()]
