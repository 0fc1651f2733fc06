"""The DeepSpeed backend: builds the engine from the config and owns its checkpoint files.

DeepSpeed picks the accelerator itself: CUDA on GPU nodes, the CPU (gloo) elsewhere. The
process group is the one Ray Train already set up; DeepSpeed joins it instead of making its own.

Checkpoint files are written in the background (`checkpoint_engine.BackgroundCheckpointEngine`):
DeepSpeed hands each state dict to the engine, which snapshots it into host buffers kept from one
checkpoint to the next (pinned on a GPU) and returns, so training goes on while the files are
serialised and written, once, straight into the checkpoint folder in the run folder (local or
s3://).

What a resume needs is written once: the optimizer's fp32 master copy is the model (ZeRO 1-2,
and ZeRO-0 in bf16/fp16: the module's weights are that copy rounded, after every step), so the
module states keep only what it does not hold (buffers, frozen parameters) and a resume rounds the
master copy again -- bit-exact. AdamW then costs 12 bytes a parameter (master weights and two
moments) at every ZeRO stage (ZeRO-3's module holds no weights; ZeRO-0 in fp32 trains the module's
own).
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import Any

import vitray.trainers.engines.deepspeed.light_import  # noqa: F401  (first: DeepSpeed without its mlflow import)

# isort: split
import torch
from torch import nn

from vitray.trainers.config import TrainingConfig
from vitray.trainers.engines.deepspeed import zero_step
from vitray.trainers.engines.deepspeed.checkpoint_engine import DEEPSPEED_SAVE_ROOT, BackgroundCheckpointEngine
from vitray.trainers.engines.deepspeed.resume_files import (
    CHECKPOINT_SUBDIR,
    CHECKPOINT_TAG,
    to_universal,
    universal_ready,
)
from vitray.trainers.engines.seam import PendingSave
from vitray.trainers.step.float8 import convert_to_fp8, local_gpu_fp8_problem
from vitray.trainers.step.optim import build_optimizer
from vitray.trainers.step.schedule import build_lr_schedule

# ZeRO 1-2 reduce gradients in buckets of this many elements, overlapped with the backward pass
# (`overlap_comm`). DeepSpeed's default (5e8) exceeds ViT-B/16's 86M parameters, so the whole
# reduction would wait for the end of the backward pass; 5e7 makes ~2 buckets for B, ~6 for L/16
# and ~13 for H/14, each large enough to keep the interconnect busy.
ZERO_BUCKET_ELEMENTS = 50_000_000


def deepspeed_config(cfg: TrainingConfig, *, world_size: int, load_universal: bool = False) -> dict[str, Any]:
    train = cfg.train
    zero: dict[str, Any] = {"stage": train.zero_stage}
    if train.zero_stage in (1, 2):
        zero.update(
            overlap_comm=True, reduce_bucket_size=ZERO_BUCKET_ELEMENTS, allgather_bucket_size=ZERO_BUCKET_ELEMENTS
        )
    if train.zero_stage == 1 and world_size == 1:
        # Overlapping the reduction with the backward pass takes a hook on every parameter's gradient
        # (host work per parameter, in every step); one worker has nothing to communicate, so ZeRO-1
        # copies the gradients into its flat partition once, after the backward pass, with no hook.
        # (ZeRO-2 and ZeRO-3 always collect gradients through such hooks.)
        zero.update(overlap_comm=False, contiguous_gradients=False)
    if train.zero_stage == 3:
        # Left on, DeepSpeed replaces torch.nn.functional.linear for the whole process with its
        # "memory-efficient" linear, which adds the bias in place to the product it has just made:
        # under remat_policy=dots_saveable that product is the output the block keeps, so the
        # recompute adds the bias twice and every gradient is wrong. It saves the same tensors for
        # the backward pass as torch's linear, so turning it off costs no memory.
        zero.update(memory_efficient_linear=False)
    return {
        "train_batch_size": train.batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accumulation,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        # A checkpoint from another number of workers is converted to DeepSpeed's universal
        # format first (see `to_universal`), which re-partitions the optimizer state on load.
        # Every checkpoint has the one tag CHECKPOINT_TAG: DeepSpeed's check that all ranks name it
        # alike (two all-reduces inside the step's stall at every checkpoint) has nothing to find.
        "checkpoint": {"load_universal": load_universal, "tag_validation": "Ignore"},
        # train.nonfinite=skip: DeepSpeed's overflow check drops a step with non-finite gradients (fp32
        # ZeRO always checks the grad norm; fp16 always checks).
        "bf16": {
            # fp8: bf16 everywhere (weights, activations, master weights as bf16 trains them) but the
            # blocks' float8 products, which the model's Float8Linear layers do themselves.
            "enabled": cfg.precision.dtype in ("bf16", "fp8"),
            "check_grad_overflow": train.check_grad_overflow or train.nonfinite == "skip",
        },
        "fp16": {"enabled": cfg.precision.dtype == "fp16", "initial_scale_power": 16},
        "steps_per_print": 10**12,  # vitray logs its own metrics
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronises the device in every forward and
        # step from the third step on; vitray measures its own throughput on log steps.
        "timers": {"throughput": {"enabled": False}},
        "zero_allow_untested_optimizer": True,
    }


def build_engine(model: nn.Module, cfg: TrainingConfig, *, world_size: int, load_universal: bool = False):
    """Returns the DeepSpeed engine; its lr scheduler is `build_lr_schedule`'s."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    _without_shared_memory_comm_op()
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    if cfg.precision.dtype == "fp8":  # before compiling: the compiler fuses the float8 casts
        convert_to_fp8(model, cfg.precision.fp8_scaling, emulate=fp8_emulated(), layers=cfg.precision.fp8_layers)
    if compile_enabled(cfg.train.compile):
        model.compile()  # in place: parameter names, hence checkpoints, stay those of the bare model
    # Fused AdamW (one kernel for all parameters); ZeRO hands it its flat fp32 partitions. Fused on
    # the CPU too: the CPU tests run the optimizer a GPU runs, and its step count stays a tensor next
    # to the weights (the unfused one reads it back to the host for every tensor it updates, every step).
    optimizer = build_optimizer(model, cfg.optim, fused=True)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=build_lr_schedule(optimizer, cfg),
        config=deepspeed_config(cfg, world_size=world_size, load_universal=load_universal),
        dist_init_required=False,
    )
    zero_step.streamline(engine.optimizer)
    zero_step.mask_nonfinite_norms_on_device()
    return engine


def _without_shared_memory_comm_op() -> None:
    """DeepSpeed's CPU backend JIT-builds its shared-memory all-reduce extension in every process that
    starts an engine (or re-checks the build), holding a lock file in torch's extension folder; a
    process killed in that window (a SIGKILLed worker, a node taken away) leaves the lock behind, and
    every later start on the machine waits for it for ever (seen: a whole test run stuck there). The
    extension serves only DeepSpeed's `inference_all_reduce`, which training never calls: marked
    unavailable, nothing is built or locked (and each start saves the build check).

    Marked without reading the table first: its first read probes every op builder DeepSpeed has
    (compiler subprocesses, accelerator queries; ~0.15 s of CPU in every worker here), and its one
    reader (`deepspeed.comm.torch.build_shm_op`) takes an op missing from it as unavailable."""
    import deepspeed.ops

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


def fp8_emulated() -> bool:
    """Float8 products run on float8 tensor cores on a GPU (one too old is refused, in one line) and
    are emulated in high precision on the CPU."""
    problem = local_gpu_fp8_problem()
    if problem:
        raise ValueError(problem)
    return not torch.cuda.is_available()


def compile_enabled(setting: bool | None) -> bool:
    """`train.compile`: null means on for CUDA only."""
    return torch.cuda.is_available() if setting is None else setting


def save(engine, checkpoint_dir: Path, client_state: dict[str, Any]) -> None:
    """Every rank writes its own shards; rank 0 also writes the module states (no `latest` file:
    vitray loads its one tag by name)."""
    engine.save_checkpoint(
        str(checkpoint_dir / CHECKPOINT_SUBDIR), tag=CHECKPOINT_TAG, client_state=client_state, save_latest=False
    )


def load(engine, checkpoint_dir: Path, *, universal_dir: Path | None = None) -> dict[str, Any]:
    """Load every rank's state; `universal_dir` is the output of `to_universal` when re-sharding."""
    load_dir, tag = (
        (universal_dir.parent, universal_dir.name)
        if universal_dir
        else (checkpoint_dir / CHECKPOINT_SUBDIR, CHECKPOINT_TAG)
    )
    masters = weights_from_master(engine)
    path, client_state = engine.load_checkpoint(
        str(load_dir),
        tag=tag,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        # The module states of a checkpoint that dropped what the master copy gives lack those
        # weights (older checkpoints have them: loaded, then replaced by the master copy's).
        load_module_strict=not masters,
    )
    if path is None:
        raise RuntimeError(f"no DeepSpeed state under {load_dir}/{tag}")
    if masters and universal_dir is None:  # (a universal load rounds them itself)
        round_masters_into_module(engine)  # the weights the step trains: the master copy, rounded
    return client_state or {}


def weights_from_master(engine) -> set[str]:
    """The names of the module's parameters whose weights follow from the optimizer's fp32 master
    copy (ZeRO 1-2, and ZeRO-0 in bf16/fp16: DeepSpeed rounds them from it after every step and
    `round_masters_into_module` does the same on a resume), which a checkpoint's module states
    therefore need not hold."""
    stage, optimizer = engine.zero_optimization_stage(), engine.optimizer
    if not (stage in (1, 2) and hasattr(optimizer, "update_lp_params")) and _unfused_masters(engine) is None:
        return set()
    return {name for name, p in engine.module.named_parameters() if p.requires_grad}


def _unfused_masters(engine) -> list[list[str]] | None:
    """ZeRO-0 in bf16/fp16 trains through DeepSpeed's unfused wrapper, which keeps an fp32 master
    copy of each trained parameter in groups (`fp32_groups`, beside the module's `fp16_groups`):
    the parameters' names, group by group in that order; None under any other optimizer."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() != 0 or not getattr(optimizer, "fp32_groups", None):
        return None
    names = {id(p): name for name, p in engine.module.named_parameters()}
    return [[names[id(p)] for p in group] for group in optimizer.fp16_groups]


def round_masters_into_module(engine) -> None:
    """The module's trained weights set to the fp32 master copy rounded to their dtype: what the
    optimizer does after every step, done on a resume whose module states left them out."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "update_lp_params"):  # ZeRO 1-2
        optimizer.update_lp_params()
        return
    with torch.no_grad():  # ZeRO-0's unfused wrapper
        for weights, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            for weight, master in zip(weights, masters):
                weight.copy_(master)


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """The consolidated module weights from the fp32 master copy the optimizer keeps (not the bf16
    weights upcast), whole on rank 0 only (other ranks get {}). Collective: every rank calls it.

    One parameter at a time, so no rank ever holds more than one whole parameter beyond its own
    share; rank 0 keeps the CPU copies it will write."""
    from deepspeed.utils import safe_get_full_fp32_param

    lead = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    params = dict(engine.module.named_parameters())
    flat_masters = _flat_fp32_masters(engine)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        param = params.get(name)
        # ZeRO 1-3 and bf16 keep an fp32 master copy of each trained parameter (ZeRO-0 in bf16/fp16
        # in flat groups); ZeRO-0 in fp32 trains the module's own weights, and buffers and frozen
        # parameters have no master copy.
        whole = safe_get_full_fp32_param(param) if param is not None else None
        if whole is None and param is not None:
            whole = flat_masters.get(id(param))
        if whole is None and param is not None and hasattr(param, "ds_tensor"):  # frozen under ZeRO-3
            whole = _gather_partition(param, param.ds_tensor, to_all=False)
        if whole is None:
            whole = tensor
        if lead:
            out[name] = whole.detach().float().cpu().clone()
    return out


def _flat_fp32_masters(engine) -> dict[int, torch.Tensor]:
    """id(parameter) -> its fp32 master copy, for DeepSpeed's fp16-style wrappers (ZeRO-0 with bf16
    or fp16), which keep the copies in their groups instead of a per-parameter mapping."""
    from torch._utils import _unflatten_dense_tensors

    optimizer = engine.optimizer
    groups = getattr(optimizer, "fp16_groups", None)
    if not groups:
        return {}
    if getattr(optimizer, "fp32_groups", None):  # the unfused wrapper (any torch optimizer): per parameter
        return {
            id(p): master for group, masters in zip(groups, optimizer.fp32_groups) for p, master in zip(group, masters)
        }
    if getattr(
        optimizer, "fp32_groups_flat", None
    ):  # the fused wrapper (DeepSpeed's own Adam): one flat tensor per group
        return {
            id(p): master
            for flat, group in zip(optimizer.fp32_groups_flat, groups)
            for p, master in zip(group, _unflatten_dense_tensors(flat, group))
        }
    return {}


def _gather_partition(param, local: torch.Tensor, *, to_all: bool) -> torch.Tensor | None:
    """The whole tensor of a ZeRO-3 parameter from every rank's flat partition `local` (its
    `ds_tensor`, or a tensor shaped like it): on rank 0 (`to_all`: on every rank), else None.

    DeepSpeed partitions a parameter by flattening it, padding it to a multiple of the world size
    and giving rank r the r-th equal slice."""
    dist = torch.distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    local = local.detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(world)] if to_all or rank == 0 else None
    if to_all:
        dist.all_gather(pieces, local)
    else:
        dist.gather(local, pieces, dst=0)
    if pieces is None:
        return None
    return torch.cat(pieces)[: param.ds_numel].view(param.ds_shape)


def _partition_of(param, whole: torch.Tensor) -> torch.Tensor:
    """This rank's flat slice of a ZeRO-3 parameter's whole tensor (as `_gather_partition` joins them)."""
    size = param.ds_tensor.numel()
    flat = whole.reshape(-1)
    padded = torch.zeros(size * torch.distributed.get_world_size(), dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    rank = torch.distributed.get_rank()
    return padded[rank * size : (rank + 1) * size].clone()


class DeepSpeedBackend:
    """:class:`vitray.trainers.engines.seam.TrainBackend` on a DeepSpeed engine."""

    name = "deepspeed"
    spmd = False

    def __init__(
        self, cfg: TrainingConfig, model: nn.Module, world_size: int, restore: tuple[Path, dict[str, Any]] | None
    ):
        self._universal_dir = None
        if restore is not None and restore[1]["world_size"] != world_size and cfg.train.zero_stage > 0:
            # The driver converted once into the checkpoint (`shared_universal`); a checkpoint
            # opened without it (a loop built outside `vitray pretrain`) is converted here, privately.
            self._universal_dir = universal_ready(restore[0]) or to_universal(
                restore[0], Path(tempfile.mkdtemp(prefix="vitray-universal-"))
            )
        self.engine = build_engine(model, cfg, world_size=world_size, load_universal=self._universal_dir is not None)
        # DeepSpeed copies its zero_to_fp32.py recovery script into every checkpoint, on the training
        # thread and past the checkpoint engine: into DEEPSPEED_SAVE_ROOT, which is never made. vitray
        # derives the weights itself (runfolder's derived_weights), so it is not copied at all.
        self.engine._copy_recovery_script = lambda save_path: None
        self._checkpoints = BackgroundCheckpointEngine(self.engine._config)
        self._checkpoints.drop_module_weights = weights_from_master(self.engine)
        groups = _unfused_masters(self.engine)
        if groups is not None:
            shapes = {name: p.shape for name, p in self.engine.module.named_parameters()}
            self._checkpoints.master_shapes = [{name: shapes[name] for name in group} for group in groups]
        # The shards hold the fp32 weights whole (runfolder's derived_weights): ZeRO 1-3's optimizer
        # partitions, ZeRO-0's master copies (bf16/fp16) or its module itself (fp32). (ZeRO-3's frozen
        # parameters lie partitioned outside the optimizer, where derived_weights does not look.)
        stage = self.engine.zero_optimization_stage()
        frozen = any(not p.requires_grad for p in self.engine.module.parameters())
        zero0 = groups is not None or not getattr(self.engine.optimizer, "fp16_groups", None)  # no wrapper: fp32
        self.weights_in_shards = {1: True, 2: True, 3: not frozen}.get(stage, zero0)
        if stage in (1, 2):  # DeepSpeed copies a shard's master weights into these on a resume
            self._checkpoints.master_partitions = list(
                getattr(self.engine.optimizer, "single_partition_of_fp32_groups", [])
            )
        self.engine.checkpoint_engine = self._checkpoints
        self._buffers_reserved = False
        self.module = self.engine.module
        self.device = self.engine.device
        self.dtype = next(self.module.parameters()).dtype
        # ZeRO-3 gathers each layer's weights from every rank inside the forward pass: every rank
        # must make the same forward calls (evaluation and probes included).
        self.collective_forward = self.engine.zero_optimization_stage() == 3
        # ZeRO-0 in fp32 steps DeepSpeed's plain optimizer, which keeps no gradient norm (its wrappers
        # do): the norm of the (all-reduced) gradients is taken here, on the device, before the step.
        self._plain_optimizer = stage == 0 and self.dtype == torch.float32
        self._plain_grad_norm: torch.Tensor | float = float("nan")
        self._step_lr = float(self.engine.get_lr()[0])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def device_loader(self, loader):
        from vitray.trainers.step.feed import DeviceFeed

        return DeviceFeed(loader, self.device)

    def begin_step(self, seed: int) -> None:
        pass  # the loop's torch.manual_seed covers the CPU and CUDA generators

    def backward_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        # The rate this step trains at, read before the step moves the schedule on (a host value).
        self._step_lr = float(self.engine.get_lr()[0])
        if self._plain_optimizer and self.engine.is_gradient_accumulation_boundary():
            self._plain_grad_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.module.parameters() if p.grad is not None]
            )
        try:
            self.engine.step()  # DeepSpeed steps the optimizer only at accumulation boundaries
        except Exception as error:
            if "loss scale already at minimum" not in str(error):
                raise
            # fp16: the scaled gradients overflowed at every scale the scaler tried, not once
            raise FloatingPointError(
                "fp16's loss scale fell to its minimum and the gradients still overflow: they are not finite at "
                "any scale (not one step's overflow). Train in bf16, or look for the cause (optim.lr too high, a bad "
                "sample)"
            ) from None
        if not self._buffers_reserved and self.engine.global_steps > 0:
            # The optimizer's state exists from its first step on: the checkpoint's host buffers are
            # allocated now, in the background, rather than in the first checkpoint's stall.
            self._buffers_reserved = True
            self._checkpoints.reserve_buffers(_checkpointed_tensors(self.engine, self._checkpoints.drop_module_weights))

    def end_step(self) -> None:
        pass

    def grad_norm(self) -> torch.Tensor | float:
        # ZeRO 1-2 keep the norm as a device tensor: handed on as is, read by the loop on log steps.
        if self._plain_optimizer:
            return self._plain_grad_norm
        norm = self.engine.get_global_grad_norm()
        return norm if norm is not None else float("nan")

    def lr(self) -> float:
        return self._step_lr

    def skipped_steps(self) -> int:
        # Counted on the host by the overflow check itself; part of DeepSpeed's checkpointed state.
        return int(self.engine.skipped_steps)

    def metrics(self) -> dict[str, float]:
        if self.dtype != torch.float16:
            return {}
        # fp16's dynamic loss scale (a host value), and the steps dropped so far to find it
        return {
            "loss_scale": float(self.engine.optimizer.loss_scale),
            "loss_scale_skips": int(self.engine.skipped_steps),
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.engine)

    # -- the module's weights as this rank holds them (EMA, evaluation with other weights) --------
    def _partitioned(self) -> dict[str, nn.Parameter]:
        """ZeRO-3's parameters by name (each rank holds a flat slice in `ds_tensor`); {} otherwise."""
        if not self.collective_forward:
            return {}
        return dict(self.module.named_parameters())

    def local_weights(self) -> dict[str, torch.Tensor]:
        partitioned = self._partitioned()
        return {
            name: partitioned[name].ds_tensor if name in partitioned else tensor
            for name, tensor in self.module.state_dict(keep_vars=True).items()
        }

    def local_part(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        partitioned = self._partitioned()
        return {
            name: _partition_of(partitioned[name], value) if name in partitioned else value
            for name, value in tensors.items()
        }

    def weights_changed(self) -> None:
        # ZeRO-3 keeps small parameters whole on every rank between steps (`ds_persist`, gathered
        # after each optimizer step): after their slices were written, gather them again.
        for param in self._partitioned().values():
            if param.data.numel() == param.ds_numel and param.ds_numel:
                param.data.copy_(_gather_partition(param, param.ds_tensor, to_all=True))

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        partitioned = self._partitioned()
        lead = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        out = {}
        for name, value in tensors.items():
            whole = _gather_partition(partitioned[name], value, to_all=False) if name in partitioned else value
            if lead:
                out[name] = whole.detach().float().cpu().clone()
        return out

    def save(self, folder: str) -> PendingSave:
        # DeepSpeed names its files under a folder of its own; every file goes to `folder` instead
        # (see BackgroundCheckpointEngine), and that folder is never made.
        self._checkpoints.begin(folder)
        save(self.engine, DEEPSPEED_SAVE_ROOT, client_state={})
        return self._checkpoints.pending()

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        settings = _group_settings(self.engine)
        load(self.engine, folder, universal_dir=self._universal_dir)
        if self._universal_dir is not None:
            # DeepSpeed 0.19's ZeRO-3 universal load gives every parameter group the settings of the
            # first (stage3.py: "the hyperparameters of each parameter should be the same"): the
            # no-decay group (biases, norms, embeddings) would be decayed from then on. Put back each
            # group's own, as this run's config makes them; lr is the schedule's (restored with it).
            for group, own in zip(_wrapped_optimizer(self.engine).param_groups, settings):
                group.update(own)


def _checkpointed_tensors(engine, dropped: set[str]) -> list[torch.Tensor]:
    """The tensors this rank's checkpoint holds, as near as can be told without saving one: the
    wrapped optimizer's parameters (the fp32 master partitions, under a ZeRO or bf16 wrapper) and
    their state (Adam's moments), and the module states the checkpoint keeps (not `dropped`, nor
    ZeRO-3's partitioned parameters, which it saves empty); a tensor seen twice (ZeRO-0 in fp32
    trains the module's own parameters) counts once."""
    optimizer = _wrapped_optimizer(engine)
    # (ZeRO-3 puts its partitions into the optimizer's groups only while it steps: the state's keys
    # are those parameters all the time.)
    tensors = [p for group in optimizer.param_groups for p in group["params"]] + list(optimizer.state)
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    dropped = dropped | {name for name, p in engine.module.named_parameters() if hasattr(p, "ds_tensor")}
    tensors += [v for k, v in engine.module.state_dict().items() if k not in dropped]
    unique = {(t.data_ptr(), t.numel(), t.dtype): t.detach() for t in tensors if t.numel()}
    return list(unique.values())


def _wrapped_optimizer(engine):
    """The torch optimizer inside DeepSpeed's ZeRO / bf16 wrapper (the one whose groups step)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _group_settings(engine) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters but its parameters and learning rate."""
    return [
        {k: copy.deepcopy(v) for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
        for group in _wrapped_optimizer(engine).param_groups
    ]
