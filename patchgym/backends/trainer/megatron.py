"""The Megatron trainer: megatron-core `GPTModel` with tensor, pipeline, data and expert parallelism.

One process per rank: `patchgym run` starts them itself (`patchgym.launch.ranks`, the registered
factory), or launch them with torchrun (`torchrun --nproc_per_node=N program.py`, N a multiple
of tp * pp). Every rank builds a `MegatronTrainer`; rank 0 runs the program and calls
the async `Trainer` methods, which broadcast the call to the other ranks, which sit in
`follow()`. Collectives time out after `timeout_s`, so a hung rank stops the others with an
error instead of a hang. Data parallelism splits a batch's samples between the data-parallel ranks by
tokens (`megatron_batching`, reported as `dp_tokens_max_over_mean`); gradients are reduced by megatron's
`DistributedDataParallel` and the step is taken by its (optionally distributed, optionally CPU-offloaded)
optimizer. Micro-batches are packed rows of samples; attention stays inside each sample through
cu_seqlens (`attention: varlen`, memory linear in tokens) or a block-diagonal causal mask (`dense`),
as `megatron_attention` explains; `recompute` trades activation memory for time (`megatron_memory`).
Per-token log-probs come from `vocab_parallel_cross_entropy` on TP-sharded logits.

Pipeline parallelism: each stage builds its share of the layers (megatron-core's split; the
embedding on the first stage, the final norm and output layer on the last, and with tied
embeddings the last stage's copy that megatron keeps in sync through the embedding group).
Forward and backward go through megatron-core's schedule (`get_forward_backward_func`: 1F1B
when pp > 1) with variable sequence lengths; the loss and log-probs are computed on the last
stage and gathered to rank 0. The loss is normalised over the whole step by us
(`Normaliser`), so the config sets `calculate_per_token_loss`: the schedule and DDP then add
micro-batch and data-parallel gradients without averaging them.

Mixture-of-experts models (Qwen3-MoE) use megatron's MoE layers with the all-to-all dispatcher;
`ep` splits the experts between ranks (`megatron_moe`).

Devices: with a GPU each rank trains on its own (`LOCAL_RANK` among the GPUs it sees, as torchrun
and patchgym's launchers set it) over NCCL (RCCL on ROCm); without one the process group is gloo
and `mcore_cpu` redirects megatron's CUDA calls. The GPU path has not been run on a GPU yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from patchgym.backends.trainer import (
    mcore_cpu,
    megatron_attention,
    megatron_batching,
    megatron_checkpoint,
    megatron_load,
    megatron_memory,
    megatron_moe,
    megatron_sync,
)
from patchgym.backends.trainer.common import OptimSettings, TrainerWeights, step_metrics
from patchgym.backends.trainer.megatron_convert import Layout
from patchgym.backends.trainer.parallel import MegatronLayout
from patchgym.core.batch import MicroBatch, TrainBatch
from patchgym.core.errors import ConfigError
from patchgym.core.losses import (
    Loss,
    Normaliser,
    add_sums,
    check_batch,
    has_gradient,
    micro_batch_loss,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed(timeout_s: float) -> None:
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # a single process without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    from datetime import timedelta

    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def bind_device(rank: int) -> torch.device:
    """This rank's device: GPU `LOCAL_RANK` (else the rank) modulo the GPUs this process sees, made
    the current one, or the CPU without a GPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class MegatronTrainer:
    """`Trainer` on megatron-core, loaded from and exported to a Hugging Face model directory."""

    def __init__(
        self,
        model: str | Path,
        *,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        warmup_steps: int = 0,
        micro_batch_tokens: int = 8192,
        use_distributed_optimizer: bool = True,
        attention: str = "varlen",
        recompute: str = "none",
        optimizer_cpu_offload: bool = False,
        dtype: str = "float32",
        seed: int = 0,
        timeout_s: float = 600.0,
        stop_timeout_s: float = 60.0,
        threads: int | None = None,
        sync_bucket_bytes: int = 512 << 20,
    ) -> None:
        """`timeout_s` bounds every collective (a rank that hangs fails the others after it);
        `stop_timeout_s` bounds how long `aclose()` waits for the followers to acknowledge the stop;
        `threads`: this rank's torch threads (None: torch's default). `attention` (varlen or dense,
        `megatron_attention`), `recompute` (none, selective or full) and `optimizer_cpu_offload`
        (`megatron_memory`) trade memory for time; `sync_bucket_bytes`: the most bytes of weights one
        bucket of a streamed weight sync carries (`megatron_sync`)."""
        from transformers import AutoConfig

        path = Path(model)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model {str(model)!r} is not a Hugging Face model directory (no config.json there)")
        self.model_dir = path
        self.hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        self.layout = Layout(self.hf_config)
        self.dtype = getattr(torch, dtype)
        self.tp, self.pp, self.ep, self.etp = tp, pp, ep, etp or tp  # experts split over etp ranks (default tp)
        self.micro_batch_tokens = micro_batch_tokens
        megatron_memory.check_attention(attention)
        self.attention, self.recompute = attention, recompute
        self.recompute_config = megatron_memory.recompute_config(recompute)
        self.offload_config = megatron_memory.offload_config(
            optimizer_cpu_offload, distributed_optimizer=use_distributed_optimizer, gpu=torch.cuda.is_available()
        )
        self.optimizer_cpu_offload = optimizer_cpu_offload
        self._dp_balance = 1.0
        self._check_dense_fits()
        self.use_distributed_optimizer = use_distributed_optimizer
        self.timeout_s = timeout_s
        self.stop_timeout_s = stop_timeout_s
        if sync_bucket_bytes < 1:
            raise ConfigError(f"sync_bucket_bytes must be at least 1, not {sync_bucket_bytes}")
        self.sync_bucket_bytes = sync_bucket_bytes
        self._sync_group = megatron_sync.SyncGroup()
        self._sync_units: list[megatron_sync.Unit] | None = None
        self.placement: Any = None
        self._stages: list[list[tuple[str, str, list[int]]]] | None = None
        """The follower ranks this rank started (`patchgym.launch.ranks.Placement`), stopped by `aclose()`."""
        self.optim = OptimSettings(lr, weight_decay, betas, grad_clip=grad_clip, warmup_steps=warmup_steps)
        self.version = 0
        self.step_count = 0
        _init_distributed(timeout_s)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = bind_device(self.rank)
        self.dp = MegatronLayout.for_world(self.world, tp=tp, pp=pp, ep=ep, etp=self.etp).dp
        torch.manual_seed(seed)
        if threads is not None:
            torch.set_num_threads(threads)
        # the current CUDA device is per thread: the worker that runs every call gets this rank's
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="patchgym-megatron", initializer=bind_device, initargs=(self.rank,)
        )
        self._closed = threading.Event()
        with mcore_cpu.active():
            self._build()
        # only now: a ping during the build would interleave with the build's own collectives
        self._last_call = time.monotonic()
        if self.rank == 0 and self.world > 1:
            threading.Thread(target=self._heartbeat, name="patchgym-megatron-heartbeat", daemon=True).start()

    # -- construction -----------------------------------------------------------------------
    def _build(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=self.tp,
                pipeline_model_parallel_size=self.pp,
                expert_model_parallel_size=self.ep,
                expert_tensor_parallel_size=self.etp,
            )
        self.ps = ps
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.last_stage = ps.is_pipeline_last_stage()
        config = replace(
            self.layout.transformer_config(tp=self.tp, pp=self.pp, dtype=self.dtype, ep=self.ep, etp=self.etp),
            **self.recompute_config,
        )
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.local_experts = self.layout.experts // self.ep
        spec = megatron_attention.with_attention(
            megatron_moe.layer_spec(config, self.layout.experts, self.layout.qk_norm), self.attention
        )
        self.router_gemm = megatron_moe.router_gemm() if self.layout.experts else None  # works without TE
        from patchgym.backends.trainer.megatron_convert import rope_theta

        gpt = GPTModel(
            config,
            spec,
            vocab_size=self.hf_config.vocab_size,
            max_sequence_length=self.hf_config.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=self.last_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=self.layout.tied,
            position_embedding_type="rope",
            rotary_base=int(rope_theta(self.hf_config)),
        )
        self.names = self._full_names(gpt)
        self._load_hf(gpt, self.model_dir)
        gpt.to(self.device)  # built on the CPU (use_cpu_initialization); DDP's buffers go where it is
        module = Float16Module(config, gpt) if self.dtype == torch.bfloat16 else gpt
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(config, ddp_config, module)
        self.gpt = gpt
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=self.optim.lr,
            weight_decay=self.optim.weight_decay,
            adam_beta1=self.optim.betas[0],
            adam_beta2=self.optim.betas[1],
            adam_eps=self.optim.eps,
            clip_grad=self.optim.grad_clip,
            use_distributed_optimizer=self.use_distributed_optimizer,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            **self.offload_config,
        )
        self.optimizer = get_megatron_optimizer(optimizer_config, [self.model])

    def _check_dense_fits(self) -> None:
        """Dense attention's [s, s] scores of one micro-batch must fit in this rank's device memory."""
        if torch.cuda.is_available():
            index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
            memory, device = float(torch.cuda.get_device_properties(index).total_memory), f"GPU {index}"
        else:
            memory, device = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "the host's memory"
        megatron_memory.check_dense_fits(
            attention=self.attention,
            tokens=self.micro_batch_tokens,
            heads=self.layout.heads / self.tp,
            layers=self.hf_config.num_hidden_layers // self.pp,
            act_bytes=self.dtype.itemsize,
            device_bytes=memory,
            device=device,
        )

    def _full_names(self, gpt: Any) -> dict[str, str]:
        """This stage's parameter names -> their names in the whole (unpipelined) model.

        Layers are renumbered by the stage's offset; with tied embeddings the last stage's
        output layer is its copy of the word embedding.
        """
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        offset = get_transformer_layer_offset(gpt.config)
        names = {}
        for name, _ in gpt.named_parameters():
            if name.startswith("decoder.layers."):
                index, rest = name.removeprefix("decoder.layers.").split(".", 1)
                full = f"decoder.layers.{int(index) + offset}.{rest}"
                names[name] = megatron_moe.global_expert_name(full, self.ep_rank, self.local_experts)
            elif self.layout.tied and name == "output_layer.weight":
                names[name] = "embedding.word_embeddings.weight"
            else:
                names[name] = name
        return names

    def _load_hf(self, gpt: Any, directory: Path) -> None:
        """Each rank reads only its shard of the HF weights (`megatron_load`)."""

        def split(name: str) -> tuple[int, int]:
            return (self.etp, self.etp_rank) if megatron_moe.is_expert(name) else (self.tp, self.tp_rank)

        params = {self.names[name]: param for name, param in gpt.named_parameters()}
        self.load_bytes = megatron_load.load_params(directory, self.layout, params, split)

    def settings(self) -> dict[str, Any]:
        """Every limit and knob of this trainer."""
        return {
            "backend": "megatron",
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "etp": self.etp,
            "dp": self.dp,
            "world_size": self.world,
            "micro_batch_tokens": self.micro_batch_tokens,
            "attention": self.attention,
            "recompute": self.recompute,
            "optimizer_cpu_offload": self.optimizer_cpu_offload,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "cpu_shim": mcore_cpu.needed(),
            "hf_load_bytes": self.load_bytes,
            "moe_router_gemm": self.router_gemm,
            "process_group_timeout_s": self.timeout_s,
            "stop_timeout_s": self.stop_timeout_s,
            "threads": torch.get_num_threads(),
            "sync_bucket_bytes": self.sync_bucket_bytes,
            "heartbeat_s": self.heartbeat_s,
            "ranks_started_by": "patchgym" if self.placement is not None else "launcher",
            **self.optim.as_dict(),
        }

    # -- compute ----------------------------------------------------------------------------
    def _stage_forward(self, model: Any, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """This stage's output: logits [b, s, v / tp] on the last stage, hidden states elsewhere."""
        return model(**megatron_attention.model_inputs(t, self.attention))

    def _token_stats(
        self, logits: torch.Tensor, ids: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies [b, s] of logits / temperature, TP-sharded (entry 0 is 0)."""
        from megatron.core import tensor_parallel

        logits = logits[:, :-1].float() / temperature
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), ids[:, 1:])
        with torch.no_grad():
            entropy = self._vocab_parallel_entropy(logits)
        zero = logp.new_zeros(ids.shape[0], 1)
        return torch.cat([zero, logp], dim=1), torch.cat([zero, entropy], dim=1)

    def _vocab_parallel_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        group = self.ps.get_tensor_model_parallel_group()
        peak = logits.max(-1, keepdim=True).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak
        weights = shifted.exp()
        z = weights.sum(-1)
        s = (weights * shifted).sum(-1)
        both = torch.stack([z, s])
        dist.all_reduce(both, group=group)
        return torch.log(both[0]) - both[1] / both[0]

    def _my_micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        """This data-parallel rank's packed micro-batches: the batch split between the ranks by tokens."""
        mbs, split = megatron_batching.rank_share(
            batch, self.micro_batch_tokens, self.dp, self.dp_rank, equal_counts=self.ep > 1
        )
        self._dp_balance = split.max_over_mean
        return mbs

    def _schedule(self, mbs: list[MicroBatch], step: Callable[..., Any], *, forward_only: bool) -> list[Any]:
        """Run megatron-core's forward-backward schedule over `mbs`; the last stage's outputs.

        `step(tensors, model)` returns the stage's output and the function the last stage
        applies to it (a loss triple, or with `forward_only` the data to collect).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not mbs:
            return []

        def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
            t = next(data).tensors(self.device)
            return step(megatron_moe.pad_sequence(t, self.tp) if self.gpt.config.sequence_parallel else t, model)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=self.model,
            num_microbatches=len(mbs),
            seq_length=max(mb.shape[1] for mb in mbs),  # shapes are sent with each tensor (variable_seq_lengths)
            micro_batch_size=max(mb.shape[0] for mb in mbs),
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    def _to_rank0(self, local: list[Any], contribute: bool) -> list[Any] | None:
        """Every contributing rank's `local` items, concatenated on rank 0 (None on other ranks)."""
        mine = local if contribute else []
        if self.world == 1:
            return mine
        parts: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        return None if parts is None else [item for part in parts for item in part]

    def _logprob_step(
        self, temperature: float, t: dict[str, torch.Tensor], model: Any
    ) -> tuple[torch.Tensor, Callable[..., Any]]:
        def collect(logits: torch.Tensor, non_loss_data: bool = True) -> list[torch.Tensor]:
            return list(self._token_stats(logits, t["input_ids"], temperature)[0])

        return self._stage_forward(model, t), collect

    def _logprobs(self, batch: TrainBatch) -> list[list[float]] | None:
        mbs = self._my_micro_batches(batch)
        self.model.eval()
        with torch.no_grad():
            rows = self._schedule(mbs, functools.partial(self._logprob_step, batch.temperature), forward_only=True)
        self.model.train()
        local = []
        for mb, logp in zip(mbs, rows, strict=False):  # rows only on the last stage
            for index, (row, start, length) in mb.spans.items():
                values = logp[row][start : start + length].tolist()
                values[0] = 0.0
                local.append((index, values))
        gathered = self._to_rank0(local, self.last_stage and self.tp_rank == 0)
        return None if gathered is None else [values for _, values in sorted(gathered)]

    def _loss_step(
        self, loss: Loss, norm: Normaliser, temperature: float, t: dict[str, torch.Tensor], model: Any
    ) -> tuple[torch.Tensor, Callable[..., Any]]:
        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
            logp, entropy = self._token_stats(logits, t["input_ids"], temperature)
            value, sums = micro_batch_loss(loss, logp, t, norm, entropy=entropy)
            return value, t["loss_mask"].sum().int(), {"loss": value.item(), **sums}

        return self._stage_forward(model, t), loss_func

    def _train_step(self, batch: TrainBatch, loss: Loss) -> dict[str, float] | None:
        from megatron.core.distributed import finalize_model_grads

        started = time.perf_counter()
        check_batch(loss, batch)
        norm = Normaliser.of(batch)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim.lr_at(self.step_count)
        step = functools.partial(self._loss_step, loss, norm, batch.temperature)
        parts = self._schedule(self._my_micro_batches(batch), step, forward_only=False)
        finalize_model_grads([self.model])
        stepped = has_gradient(loss, batch)
        grad_norm = self.optimizer.step()[1] if stepped else 0.0
        self.step_count += stepped
        self.version += 1
        gathered = self._to_rank0(parts, self.last_stage and self.tp_rank == 0)
        if gathered is None:
            return None
        sums: dict[str, float] = {}
        for part in gathered:
            add_sums(sums, part)
        return step_metrics(
            batch,
            started,
            sums,
            loss=sums.pop("loss", 0.0),
            grad_norm=float(grad_norm or 0.0),
            lr=self.optimizer.param_groups[0]["lr"],
            version=float(self.version),
            optimizer_skipped=float(not stepped),
            dp_tokens_max_over_mean=self._dp_balance,
        )

    def _set_lr(self, lr: float) -> None:
        self.optim = replace(self.optim, lr=lr)

    def _reset_optimizer(self) -> None:
        for optimizer in self._optimizers():
            optimizer.optimizer.state.clear()  # Adam starts its moments afresh at the next step
        self.step_count = 0

    def _stage_state(self) -> dict[str, torch.Tensor]:
        """This pipeline stage's megatron tensors under their whole-model names, gathered over TP.

        The last stage's copy of a tied embedding (megatron marks it `shared`) is left out: the
        first stage's is the same tensor.
        """
        out = {}
        for name, param in self.gpt.named_parameters():
            if getattr(param, "shared", False):
                continue
            gathered = megatron_sync.gather_unit(self, name, param.detach().float().contiguous())
            out.update({k: v.to(self.dtype, copy=True) for k, v in gathered.items()})  # never a live parameter
        return out

    def _full_state(self) -> dict[str, torch.Tensor] | None:
        """Every megatron tensor under its whole-model name, gathered over TP and pipeline stages.

        On rank 0 (on its device); None on the other ranks. Other stages' tensors travel through
        host memory.
        """
        out = self._stage_state()
        if self.pp == 1:
            return out if self.rank == 0 else None
        device = next(self.gpt.parameters()).device
        stages = self._to_rank0([{k: v.cpu() for k, v in out.items()}], self.dp_rank == 0 and self.tp_rank == 0)
        return None if stages is None else {k: v.to(device) for stage in stages for k, v in stage.items()}

    @property
    def _stage_leader(self) -> bool:
        """The rank that sends this pipeline stage's weights: data-parallel rank 0, tensor rank 0."""
        return self.dp_rank == 0 and self.tp_rank == 0

    def _units(self) -> list[megatron_sync.Unit]:
        if self._sync_units is None:
            self._sync_units = megatron_sync.plan(self)
        return self._sync_units

    def _weight_stages(self) -> list[list[tuple[str, str, list[int]]]] | None:
        """(name, dtype, shape) of each pipeline stage's HF tensors, in stage and sending order, on rank 0."""
        metas = [(name, dtype, list(shape)) for unit in self._units() for name, dtype, shape in unit.hf]
        gathered = self._to_rank0([(self.ps.get_pipeline_model_parallel_rank(), metas)], self._stage_leader)
        return None if gathered is None else [metas for _, metas in sorted(gathered)]

    def _open_weight_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Each stage leader binds its stage's group (held from then on); the settings with the bound
        ports, on rank 0."""
        stage = self.ps.get_pipeline_model_parallel_rank()
        port = self._sync_group.open(groups[stage]).master_port if self._stage_leader else 0
        bound = self._to_rank0([(stage, port)], self._stage_leader)
        return None if bound is None else [{**groups[s], "master_port": p} for s, p in sorted(bound)]

    def _broadcast_stages(self, groups: list[dict[str, Any]], buckets: list[list[list[str]]]) -> list[dict] | None:
        """Every rank of each stage gathers its buckets' tensors; the stage leader joins (or reuses) its
        stage's weight-update group as rank 0 and streams them (`megatron_sync`). Each leader's
        `SyncStats`, on rank 0."""
        stage = self.ps.get_pipeline_model_parallel_rank()
        broadcaster = None
        if self._stage_leader:
            broadcaster = self._sync_group.open(groups[stage])
            try:
                broadcaster.join()
            except Exception:
                self._sync_group.close()
                raise
        try:
            stats = megatron_sync.Streamer(self, self._units(), broadcaster).run(buckets[stage])
        except Exception:
            if broadcaster is not None:
                self._sync_group.close()  # the next sync forms a new group
            raise
        mine = [{"stage": stage, **stats.as_dict()}] if self._stage_leader else []
        gathered = self._to_rank0(mine, self._stage_leader)
        return None if gathered is None else sorted(gathered, key=lambda s: s["stage"])

    def _hf_state(self) -> dict[str, torch.Tensor] | None:
        state = self._full_state()
        return None if state is None else self.layout.mcore_to_hf(state)

    def _export(self, directory: Path) -> Path:
        from safetensors.torch import save_file

        state = self._hf_state()
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            self.hf_config.save_pretrained(directory)
            save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        dist.barrier()
        return directory

    def _save(self, directory: Path) -> None:
        megatron_checkpoint.save(self, directory)

    def _optimizers(self) -> list[Any]:
        """The optimizers a megatron `ChainedOptimizer` holds (or the optimizer itself)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _load(self, directory: Path) -> None:
        megatron_checkpoint.load(self, directory)

    # -- rank 0 drives, the others follow ----------------------------------------------------
    def _execute(self, command: str, args: tuple) -> Any:
        handlers = {
            "logprobs": self._logprobs,
            "train_step": self._train_step,
            "hf_state": self._hf_state,
            "weight_stages": self._weight_stages,
            "broadcast_stages": self._broadcast_stages,
            "open_weight_groups": self._open_weight_groups,
            "export": self._export,
            "save": self._save,
            "load": self._load,
            "set_lr": self._set_lr,
            "reset_optimizer": self._reset_optimizer,
        }
        with mcore_cpu.active():
            return handlers[command](*args)

    @property
    def heartbeat_s(self) -> float:
        """Rank 0 sends a no-op when it has called nothing for this long: followers wait for the next
        call inside a collective, which would otherwise time out during a long evaluation."""
        return self.timeout_s / 4

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.heartbeat_s / 4):
            if time.monotonic() - self._last_call >= self.heartbeat_s:
                self._last_call = time.monotonic()
                with contextlib.suppress(RuntimeError):  # the executor shut down meanwhile
                    self._executor.submit(self._call, "ping")

    def _call(self, command: str, *args: Any) -> Any:
        self._last_call = time.monotonic()
        if command == "ping":
            dist.broadcast_object_list([(command, args)], src=0)
            return None
        if self.world > 1:
            dist.broadcast_object_list([(command, args)], src=0)
        return self._execute(command, args)

    def follow(self) -> None:
        """On ranks other than 0: run rank 0's calls until it closes the trainer."""
        if self.rank == 0:
            raise ConfigError("follow() is for ranks other than 0; rank 0 drives the trainer")
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, src=0)
            command, args = message[0]
            if command == "stop":
                self._sync_group.close()
                return
            if command != "ping":
                self._execute(command, args)

    async def _run(self, command: str, *args: Any) -> Any:
        if self.rank != 0:
            raise ConfigError("only rank 0 calls the trainer; other ranks run follow()")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, command, *args)

    async def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-token log-probs of every sample under the current weights (entry 0 is 0.0)."""
        return await self._run("logprobs", batch)

    async def train_step(self, batch: TrainBatch, loss: Loss) -> dict[str, float]:
        """One optimiser step over `batch`, its micro-batches split across data-parallel ranks."""
        return await self._run("train_step", batch, loss)

    async def set_lr(self, lr: float) -> None:
        """Change the peak learning rate for the following steps (warm-up continues where it is)."""
        await self._run("set_lr", lr)

    async def reset_optimizer(self) -> None:
        """Forget the optimiser's moments and restart the warm-up (e.g. between SFT and RL)."""
        await self._run("reset_optimizer")

    async def weights(self, export_to: Path | None = None) -> TrainerWeights:
        """The full weights in HF names (gathered over TP); with `export_to`, also an HF directory."""
        state = await self._run("hf_state")
        path = await self._run("export", Path(export_to)) if export_to is not None else None
        return TrainerWeights(self.version, state, path, {"format": "hf"})

    async def weight_stages(self) -> list[list[tuple[str, str, list[int]]]]:
        """Per pipeline stage, the (HF name, dtype, shape) of the tensors its leader sends; fixed for a run."""
        if self._stages is None:
            self._stages = await self._run("weight_stages")
        return self._stages

    async def open_weight_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Stage s's leader binds `groups[s]` (`WeightBroadcaster` settings; `master_port` 0: a port it
        picks) and holds it; the settings with the ports bound, to tell the engines."""
        return await self._run("open_weight_groups", groups)

    async def broadcast_weights(self, groups: list[dict[str, Any]], buckets: list[list[list[str]]]) -> list[dict]:
        """Stage s's leader joins `groups[s]` (`WeightBroadcaster` settings: rank 0 of a group the
        engines join; kept for the next sync with the same settings) and streams `buckets[s]` (lists
        of names from `weight_stages()`) in order; each stage's `SyncStats` as a dict."""
        return await self._run("broadcast_stages", groups, buckets)

    async def save(self, directory: Path) -> None:
        """A resumable distributed checkpoint (`megatron_checkpoint`): sharded model and optimizer
        (float32 main parameters included), written by every rank; no HF export (see `export`)."""
        await self._run("save", Path(directory))

    async def export(self, directory: Path) -> Path:
        """The current weights as a Hugging Face model directory (written by rank 0)."""
        return await self._run("export", Path(directory))

    async def load(self, directory: Path) -> None:
        await self._run("load", Path(directory))

    def fatal(self) -> str | None:
        """Why training cannot go on: a follower rank this rank started has exited (else None)."""
        dead = self.placement.dead() if self.placement is not None else []
        return dead[0].describe() if dead else None

    async def aclose(self) -> None:
        """Release the followers and the worker thread (rank 0); stop the ranks this rank started.

        A follower that died, or one that does not take the stop within `stop_timeout_s`, is
        not waited for: the placement kills what is left, which also fails a collective rank 0
        may still be blocked in.
        """
        self._closed.set()
        try:
            if self.rank == 0 and self.world > 1 and self.fatal() is None:
                stop = asyncio.get_running_loop().run_in_executor(
                    self._executor, lambda: dist.broadcast_object_list([("stop", ())], src=0)
                )
                with contextlib.suppress(TimeoutError, RuntimeError):
                    await asyncio.wait_for(stop, self.stop_timeout_s)
        finally:
            self._sync_group.close()
            if self.placement is not None:
                await asyncio.to_thread(self.placement.stop)
            self._executor.shutdown(wait=self.placement is None)
