"""``MegatronEngine``: a Hugging Face Llama/Qwen2 model trained as megatron-core ``GPTModel`` chunks,
with tensor (TP), pipeline (PP, optionally interleaved) and data parallelism (DP).

The ranks of the job form ``world_size / (TP x PP)`` replicas of the model: the ranks of one replica
(its TP and PP ranks) get the same DP share of every batch, and only the last pipeline stage's TP
rank 0 returns outputs (``is_output_rank``); ``dp_group`` is megatron-core's data-parallel group.

The weights come from the Hugging Face checkpoint (``verl_megatron.weights`` maps every tensor to its
megatron-core parameter and TP shard) and go back under Hugging Face names, one whole tensor at a
time, for the rollout and for ``save_hf_model``. Training runs megatron-core's own pieces: its
``DistributedDataParallel`` (gradients reduced in fp32 buffers, averaged over DP), its optimiser
(``get_megatron_optimizer``: AdamW, optionally the distributed optimiser), and
``get_forward_backward_func`` for the micro-batches (1F1B, interleaved with virtual stages); log-probs
and entropy from vocabulary-parallel logits (``verl_megatron.vocab_parallel``). The
loss follows the engine contract: each micro-batch's loss is already globally normalised, so the
schedule's averaging over micro-batches is undone, and nothing depends on the micro-batch count,
TP or PP. Checkpoints are megatron-core ``dist_checkpointing`` directories (model, optimiser),
loadable at another TP/PP/DP layout, with the LR schedule and each rank's RNG state beside them.
"""

from __future__ import annotations

import importlib.util
import math
import re
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_core.config.engine import EngineConfig
from verl_core.data.batch import (
    ATTENTION_MASK,
    ENTROPY,
    INPUT_IDS,
    LOG_PROBS,
    POSITION_IDS,
    RESPONSES,
    VALUES,
    attach_global_counts,
    compute_global_counts,
)
from verl_core.data.microbatch import split_micro_batches
from verl_core.distributed import all_reduce_sum
from verl_core.engine import BaseEngine, ForwardBackwardResult, LossFn, forward_options
from verl_core.errors import ConfigError
from verl_core.toolkit import load_hf_model, log_probs_and_entropy, lr_multiplier, validate_optim_config
from verl_megatron.checkpoints import BACKEND, Checkpoints
from verl_megatron.config import MegatronConfig, check_layout
from verl_megatron.hf_config import megatron_model_config
from verl_megatron.offload import Offload, inner_optimizers
from verl_megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
from verl_megatron.weight_exchange import WeightExchange
from verl_megatron.weights import Heads, TensorMap, hf_order, padded_vocab_size, tensor_maps

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: Checkpoint layout (inside the directory ``atomic_checkpoint`` publishes): one ``dist_checkpointing``
#: ``decoder.layers.{local index}.`` in a chunk's parameter names.
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


class MegatronEngine(WeightExchange, Offload, Checkpoints, BaseEngine):
    """megatron-core ``GPTModel`` with TP, PP and DP (gloo on CPU with ``cpu_bridge``, NCCL on GPU)."""

    options_class = MegatronConfig

    def __init__(self, config: EngineConfig, role: str = "lm", *, config_path: str = "engine"):
        super().__init__(config, role, config_path=config_path)
        #: This rank's ``GPTModel`` chunks, and the same wrapped by megatron-core's DDP.
        self.chunks: list[torch.nn.Module] = []
        self.model: list[torch.nn.Module] = []
        self.optimizer = None
        #: Optimiser steps taken: the LR schedule's position (``verl_core.engine.lr_multiplier``).
        self.schedule_steps = 0
        #: The Hugging Face architecture on the meta device: names, order, shapes and config of exports.
        self.hf_module: torch.nn.Module | None = None
        self._maps: list[TensorMap] = []
        self._heads: Heads | None = None
        self._params: dict[str, torch.nn.Parameter] = {}  # global megatron-core name -> this rank's shard
        self._stage_of: dict[str | int, int] = {}  # TensorMap.stage -> pipeline rank holding it
        self._optimizer_device = self.device
        self._vocab_size = 0  # the Hugging Face vocabulary (megatron-core's may be padded for TP)
        self._export_order: list[tuple[str, TensorMap, int]] = []
        self._export_shapes: list[torch.Tensor] = []

    # -- layout ----------------------------------------------------------------------------------

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self._parallel_state().get_data_parallel_group() if self.chunks else super().dp_group

    @property
    def is_output_rank(self) -> bool:
        """The last pipeline stage's TP rank 0 (known once ``initialize()`` set up the layout)."""
        if not self.chunks:
            return super().is_output_rank
        state = self._parallel_state()
        return state.is_pipeline_last_stage() and state.get_tensor_model_parallel_rank() == 0

    @property
    def tp_size(self) -> int:
        return self.options.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        return self.options.pipeline_model_parallel_size

    def _parallel_state(self):
        from megatron.core import parallel_state

        return parallel_state

    # -- lifecycle -------------------------------------------------------------------------------

    def initialize(self) -> None:
        if self.chunks:
            raise RuntimeError("MegatronEngine.initialize() was already called")
        validate_optim_config(self.config.optim, f"{self.config_path}.optim")
        if self.config.model.compile_layers:
            raise ConfigError(
                [
                    (
                        f"{self.config_path}.model.compile_layers",
                        "compiles Hugging Face decoder layers, and the megatron backend runs megatron-core's "
                        "own: unset it",
                    )
                ]
            )
        self._check_device_and_bridge()
        hf_model = load_hf_model(
            self.config.model, self.role, seed=self.config.seed, where=f"{self.config_path}.model"
        )
        hf_config = hf_model.config.to_dict()
        model = megatron_model_config(hf_config, where=f"{self.config_path}.model.path")
        transformer_engine = self._uses_transformer_engine()
        check_layout(
            self.options, hf_config, dist.get_world_size(), transformer_engine_available(), self._options_path
        )
        self._initialize_parallel_state()

        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from verl_megatron.model import build_model_chunks, transformer_config

        vocab = model["gpt"]["vocab_size"]
        padded_vocab = padded_vocab_size(vocab, self.tp_size)
        model["gpt"]["vocab_size"] = padded_vocab
        self._vocab_size = vocab
        dtype = hf_model.dtype
        config = transformer_config(
            model,
            self.options,
            dtype,
            transformer_engine,
            gloo=dist.get_backend() == "gloo",
            recompute=self.config.model.gradient_checkpointing,
        )
        model_parallel_cuda_manual_seed(self.config.seed)
        self.chunks = build_model_chunks(model, config, self.role, transformer_engine, self.device)
        self._heads = Heads.of(model["transformer"])
        self._maps = tensor_maps(
            model["transformer"]["num_layers"],
            self.role,
            model["gpt"]["share_embeddings_and_output_weights"],
            model["transformer"]["add_qkv_bias"],
            fused_norms=transformer_engine,
            vocab=(vocab, padded_vocab),
        )
        self._params = self._global_parameter_names()
        self._stage_of = self._pipeline_ranks_of_stages()
        self._load_hf_state(hf_model.state_dict())
        self.hf_module = load_hf_model(
            self.config.model, self.role, where=f"{self.config_path}.model", on_meta=True
        )
        # What every export yields, in order: the Hugging Face names with their maps, and the shapes
        # (meta tensors) of what the stages that do not hold a tensor receive.
        meta_state = self.hf_module.state_dict()
        self._export_order = hf_order(self._maps, list(meta_state))
        self._export_shapes = list(meta_state.values())
        del hf_model
        self._wrap(config)
        self.offload_per_config("cpu")

    def _check_device_and_bridge(self) -> None:
        """On the CPU megatron-core runs only through the opt-in bridge; it needs a process group."""
        where = f"{self._options_path}.cpu_bridge"
        if self.device.type == "cpu" and not self.options.cpu_bridge:
            raise ConfigError(
                [
                    (
                        where,
                        "false, and the engine runs on the CPU: megatron-core assumes CUDA; set "
                        f"{where}: true to run it on the CPU (tests and development, "
                        "docs/backends/megatron.md), or use device: cuda",
                    )
                ]
            )
        if self.device.type != "cpu" and self.options.cpu_bridge:
            raise ConfigError(
                [
                    (
                        where,
                        f"true, but the engine runs on {self.device}, where megatron-core runs unpatched: unset it",
                    )
                ]
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                [
                    (
                        self.config_path,
                        "the megatron backend needs an initialised torch.distributed process group (one rank "
                        "suffices): in the trainer set trainer.workers=ray (its workers form one, also for "
                        "trainer.world_size=1); embedding the engine, call torch.distributed.init_process_group "
                        "before initialize()",
                    )
                ]
            )
        if self.device.type == "cpu":
            from verl_megatron import cpu_bridge

            cpu_bridge.enable()
        else:
            torch.cuda.set_device(self.device)

    def _uses_transformer_engine(self) -> bool:
        impl = self.options.transformer_impl
        return impl == "transformer_engine" or (impl == "auto" and transformer_engine_available())

    def _initialize_parallel_state(self) -> None:
        """megatron-core keeps one layout per process: every megatron engine of a process shares it."""
        state = self._parallel_state()
        wanted = (self.tp_size, self.pp_size, self.options.virtual_pipeline_model_parallel_size)
        if not state.model_parallel_is_initialized():
            # megatron-core's groups would wait 30 minutes in a hung collective; they get the job's limit.
            state.initialize_model_parallel(
                *wanted, distributed_timeout_minutes=self._collective_timeout_minutes()
            )
            return
        current = (
            state.get_tensor_model_parallel_world_size(),
            state.get_pipeline_model_parallel_world_size(),
            state.get_virtual_pipeline_model_parallel_world_size(),
        )
        if current != wanted:
            raise ConfigError(
                [
                    (
                        self._options_path,
                        f"TP/PP/virtual PP {wanted}, but an earlier megatron engine of this process set up "
                        f"{current}: megatron-core holds one parallel layout per process, so every megatron "
                        "engine of a worker (actor, reference, critic) must use the same sizes",
                    )
                ]
            )

    def _collective_timeout_minutes(self) -> int:
        """The world group's collective timeout (what the job set at ``init_process_group``), in whole
        minutes; megatron-core's default (30) where torch does not say."""
        try:
            seconds = dist.group.WORLD._get_backend(self.device).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):  # private API: other backends or torch releases
            return 30
        return max(1, math.ceil(seconds / 60))

    def _wrap(self, config) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.options.use_distributed_optimizer,
        )
        self.model = [
            DistributedDataParallel(
                config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0
            )
            for index, chunk in enumerate(self.chunks)
        ]
        config.no_sync_func = (
            [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        )
        config.finalize_model_grads_func = finalize_model_grads
        optim = self.config.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                min_lr=0.0,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.betas[0],
                adam_beta2=optim.betas[1],
                adam_eps=optim.eps,
                clip_grad=optim.clip_grad,
                use_distributed_optimizer=self.options.use_distributed_optimizer,
                params_dtype=config.params_dtype,
                bf16=config.bf16,
                fp16=config.fp16,
            ),
            self.model,
            config_overrides={},  # weight decay on every tensor, as AdamW over the Hugging Face model
        )
        if config.fp16:
            config.grad_scale_func = self.optimizer.scale_loss
        self._apply_lr()

    def set_model_mode(self, train: bool) -> None:
        for chunk in self._initialized():
            chunk.train(train)

    # -- compute ---------------------------------------------------------------------------------

    def forward_backward_batch(
        self, batch: TensorDict, loss_fn: LossFn | None, forward_only: bool
    ) -> ForwardBackwardResult:
        self._initialized()
        if loss_fn is None and not forward_only:
            raise ValueError("a backward pass needs a loss_fn: pass one, or forward_only=True")
        from megatron.core.pipeline_parallel import get_forward_backward_func

        dp_group = self.dp_group
        if loss_fn is not None:
            batch = attach_global_counts(batch.copy(), compute_global_counts(batch, dp_group))
        split = split_micro_batches(batch, self.config.micro_batch, dp_group)
        micro_batches = [micro_batch.to(self.device) for micro_batch in split.micro_batches]
        count = len(micro_batches)
        outputs: dict[str, list[torch.Tensor]] = {}
        metrics: dict[str, list[float]] = {}
        losses: list[float] = []
        output_device = batch[INPUT_IDS].device

        def forward_step(data_iterator, model):
            micro_batch = next(data_iterator)
            output = model(
                input_ids=micro_batch[INPUT_IDS],
                position_ids=micro_batch[POSITION_IDS],
                attention_mask=_attention_mask(micro_batch[ATTENTION_MASK]),
                runtime_gather_output=False,  # each TP rank keeps its vocabulary columns
            )

            def loss_func(output_tensor):
                model_output = self._outputs(output_tensor, micro_batch)
                for name, value in model_output.items():
                    outputs.setdefault(name, []).append(value.detach().to(output_device))
                if loss_fn is None:
                    return output_tensor.new_zeros(()), {}
                loss, loss_metrics = loss_fn(model_output, micro_batch, dp_group)
                losses.append(float(loss.detach()))
                for name, value in loss_metrics.items():
                    metrics.setdefault(name, []).append(float(value))
                return self._undo_schedule_averaging(loss, count), {}

            return output, loss_func

        lengths = [micro_batch[INPUT_IDS].shape for micro_batch in micro_batches]
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro_batches) for _ in self.model]
            if len(self.model) > 1
            else iter(micro_batches),
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=count,
            seq_length=max(shape[1] for shape in lengths),
            micro_batch_size=max(shape[0] for shape in lengths),
            forward_only=forward_only,
        )
        loss, metrics = self._from_last_stage(sum(losses), metrics, loss_fn is not None)
        result_outputs = None
        if self.is_output_rank:
            restored = {name: split.restore(values) for name, values in outputs.items()}
            result_outputs = TensorDict(restored, batch_size=batch.batch_size[:1], device=None)
        return ForwardBackwardResult(outputs=result_outputs, loss=loss, metrics=metrics)

    @staticmethod
    def _undo_schedule_averaging(loss: torch.Tensor, count: int) -> torch.Tensor:
        """megatron-core's schedule divides each micro-batch loss by the micro-batch count; the
        contract's losses are globally normalised already (their sum is the step's loss)."""
        return loss * count

    def _outputs(self, output: torch.Tensor, micro_batch: TensorDict) -> dict[str, torch.Tensor]:
        """The batch contract's outputs from the last stage's ``[b, s, .]`` logits or values."""
        responses = micro_batch[RESPONSES]
        predicting = output[:, -responses.shape[-1] - 1 : -1]
        if self.role == "value":
            return {VALUES: predicting.squeeze(-1).float()}
        temperature, compute_entropy = forward_options(micro_batch)
        if self.tp_size == 1:
            log_probs, entropy = log_probs_and_entropy(predicting, responses, temperature, compute_entropy)
        else:
            state = self._parallel_state()
            log_probs, entropy = vocab_parallel_log_probs_and_entropy(
                predicting,
                responses,
                temperature,
                compute_entropy,
                vocab_start=state.get_tensor_model_parallel_rank() * predicting.shape[-1],
                vocab_size=self._vocab_size,  # columns padded for TP are no tokens
                group=state.get_tensor_model_parallel_group(),
            )
        return {LOG_PROBS: log_probs} if entropy is None else {LOG_PROBS: log_probs, ENTROPY: entropy}

    def _from_last_stage(
        self, local_loss: float, metrics: dict[str, list[float]], has_loss: bool
    ) -> tuple[float | None, dict[str, list[float]]]:
        """The global loss and the metrics, computed on the last stage, on every rank of the replica."""
        state = self._parallel_state()
        loss = None
        if has_loss and state.is_pipeline_last_stage():
            loss = all_reduce_sum(local_loss, self.dp_group) / self.dp_size
        if self.pp_size > 1:
            group = state.get_pipeline_model_parallel_group()
            payload = [(loss, metrics)]
            dist.broadcast_object_list(
                payload, src=dist.get_global_rank(group, self.pp_size - 1), group=group
            )
            loss, metrics = payload[0]
        return loss, metrics

    def optimizer_zero_grad(self) -> None:
        self._initialized()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Clip to ``optim.clip_grad`` by the global norm (megatron-core's, over every TP, PP and
        distributed-optimiser shard), step; a non-finite norm skips the step."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self._initialized()
        optimizer = self.optimizer
        found_inf = optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm()) if not found_inf else math.inf
        if not math.isfinite(grad_norm):
            optimizer.zero_grad()
            return grad_norm
        clip = self.config.optim.clip_grad
        if clip > 0:
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                parameters = inner.get_parameters()
                if parameters:
                    clip_grad_by_total_norm_fp32(parameters, clip, grad_norm)
        optimizer.step_with_ready_grads()
        return grad_norm

    def lr_scheduler_step(self) -> float:
        self._initialized()
        self.schedule_steps += 1
        self._apply_lr()
        return self.get_lr()

    def get_lr(self) -> float:
        self._initialized()
        return float(inner_optimizers(self.optimizer)[0].param_groups[0]["lr"])

    def _apply_lr(self) -> None:
        lr = self.config.optim.lr * lr_multiplier(self.schedule_steps, self.config.optim)
        for inner in inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                group["lr"] = lr

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def _options_path(self) -> str:
        return f"{self.config_path}.{BACKEND}"

    def _initialized(self) -> list[torch.nn.Module]:
        if not self.chunks:
            raise RuntimeError("MegatronEngine is not initialised: call initialize() first")
        return self.chunks


def _attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``[b, 1, s, s]`` mask (True: not attended) from the batch's ``[b, s]`` one:
    causal, and no real token attends padding."""
    length = attention_mask.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).triu(1)
    return causal[None, None] | ~attention_mask.bool()[:, None, None, :]
