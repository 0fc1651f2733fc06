"""The torch-xla backend (TPU slices; the CPU in tests): one SPMD program over every device.

One process per TPU host (one Ray worker each) runs the same program on a mesh over all devices
of all hosts, with one axis, `fsdp`:

- parameters are sharded FSDP-style by torch-xla's FSDPv2 (`SpmdFullyShardedDataParallel`: each
  parameter along its largest dimension); the optimizer state is created in the parameters'
  sharding, so it is sharded the same way;
- each host feeds its part of the global batch, sharded along the batch dimension, through
  torch-xla's parallel loader (`vitray.trainers.engines.xla.loader`);
- `precision.dtype=bf16` computes in bfloat16 under autocast, with fp32 weights and optimizer state;
- every batch has the same shape and each optimizer step ends in one `torch_xla.sync()`, so the
  graphs compiled in the first steps are reused from then on: `xla/compilations` in the metrics
  counts them and stays constant after warm-up.

Checkpoints: each host writes its shards with `torch.distributed.checkpoint` under `xla/` of the
checkpoint folder (SPMD planners: loading re-shards onto any mesh, e.g. another slice size);
the loop adds the consolidated `model.safetensors` that `vitray export` and the DeepSpeed backend
read. A checkpoint of one backend is not resumed by the other: weights move between them through
`init.checkpoint`.
"""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from vitray.trainers.config import TrainingConfig
from vitray.trainers.engines.seam import PendingSave
from vitray.trainers.engines.xla.loader import DeviceLoader
from vitray.trainers.engines.xla.written_files import WrittenFiles
from vitray.trainers.step.optim import build_optimizer
from vitray.trainers.step.schedule import build_lr_schedule

CHECKPOINT_SUBDIR = "xla"
MESH_AXIS = "fsdp"

# Noise from the libraries this backend drives, not about anything the user can change.
_QUIET = (
    "Full backward hook is firing",  # FSDPv2's optimization barrier on a model whose inputs need no grad
    "torch.distributed is disabled",  # DCP on a single process (tests, one host)
    "The function definition for SavePlanner.set_up_planner",
    "TypedStorage is deprecated",
    "Using a non-tuple sequence for multidimensional indexing",
)


def _quiet_warnings() -> None:
    for message in _QUIET:
        warnings.filterwarnings("ignore", message=f".*{message}.*")


def start_spmd() -> None:
    """Switch the process's XLA runtime to SPMD; must happen before any XLA computation."""
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()


def compilations() -> tuple[int, float]:
    """Graphs compiled by this process so far, and the seconds spent compiling them."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return (int(data[0]), data[1] / 1e9) if data else (0, 0.0)


class XlaBackend:
    """:class:`vitray.trainers.engines.seam.TrainBackend` on torch-xla SPMD."""

    name = "xla"
    weights_in_shards = False  # DCP shards: model.safetensors is always written
    spmd = True  # one program on all hosts: per-step randomness must not depend on the rank

    def __init__(
        self, cfg: TrainingConfig, model: nn.Module, world_size: int, restore: tuple[Path, dict[str, Any]] | None
    ):
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        _quiet_warnings()
        start_spmd()
        # One program over all hosts: a forward on one host alone would wait for the others.
        self.collective_forward = world_size > 1
        train = cfg.train
        local_devices = xr.addressable_runtime_device_count()
        if train.micro_batch_size % local_devices:
            raise ValueError(
                f"train.micro_batch_size={train.micro_batch_size} must be a multiple of this host's {local_devices} XLA "
                "devices: each host's batch is split evenly over its devices"
            )
        devices = xr.global_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(devices), (devices,), (MESH_AXIS,))
        xs.set_global_mesh(self.mesh)
        self.device = torch_xla.device()
        self.dtype = torch.float32  # inputs; bf16 compute comes from autocast
        self._autocast = cfg.precision.dtype == "bf16"
        self._batch_size = train.micro_batch_size
        self.accum = cfg.grad_accumulation
        self._clip = cfg.optim.grad_clip

        if cfg.model.grad_checkpointing:
            model.block_checkpoint = _recompute_block
        self.wrapped = SpmdFullyShardedDataParallel(model, mesh=self.mesh)
        self.module = self.wrapped.module
        self.optimizer = build_optimizer(self.module, cfg.optim)
        self.schedule = build_lr_schedule(self.optimizer, cfg)
        self._create_optimizer_state()
        self._micro = 0
        self._norm: torch.Tensor | None = None
        self._step_lr = float(self.optimizer.param_groups[0]["lr"])
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitray-xla-ckpt")
        # DCP coordinates hosts on the checkpoint thread while the loop trains: a group of its own
        # keeps its collectives apart from the loop's metric all-reduces -- and from the loop's own
        # gathers of whole tensors (`to_host`: the checkpoint's consolidated weights, the EMA's),
        # which on the same group as a save in flight paired up with DCP's and hung every host.
        distributed = dist.is_available() and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if distributed else None
        self._gather_group = dist.new_group(backend="gloo") if distributed else None

    def _create_optimizer_state(self) -> None:
        """Create the optimizer state now, in the parameters' sharding, with the values the first
        step would create it with (zeros; AdamW's step counter 0).

        Then the first training step already runs the steady-state graph (one compilation less),
        and DCP, which loads in place, has the state to load into. It is one optimizer step on zero
        gradients with the learning rate and weight decay at 0, which leaves the weights as they are.
        """
        import torch_xla

        torch_xla.sync()
        for param in self.module.parameters():
            param.grad = torch.zeros_like(param)
            sharding = torch_xla._XLAC._get_xla_op_sharding(param)
            if sharding:
                torch_xla._XLAC._xla_mark_sharding(param.grad, sharding)
        saved = [(group["lr"], group["weight_decay"]) for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
        self.optimizer.step()
        for group, (lr, decay) in zip(self.optimizer.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, decay
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"].zero_()
        self.optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()

    # -- training ---------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=self._autocast):
            return self.wrapped(*args, **kwargs)

    def device_loader(self, loader) -> DeviceLoader:
        return DeviceLoader(loader, self.mesh, self._batch_size, self.device, axis=MESH_AXIS)

    def begin_step(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)  # XLA's generator (dropout); torch.manual_seed does not reach it

    def backward_step(self, loss: torch.Tensor) -> None:
        (loss / self.accum).backward()  # a mean over the accumulation window, as DeepSpeed scales it
        self._micro += 1
        if self._micro % self.accum:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self._clip > 0:
            self._norm = torch.nn.utils.clip_grad_norm_(params, self._clip)
        else:
            self._norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        self._step_lr = float(self.optimizer.param_groups[0]["lr"])  # before the schedule moves on
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)

    def end_step(self) -> None:
        import torch_xla

        torch_xla.sync()  # cut the step's graph and launch it (asynchronously)

    def grad_norm(self) -> torch.Tensor | float:
        return self._norm if self._norm is not None else float("nan")  # read by the loop on log steps only

    def lr(self) -> float:
        return self._step_lr

    def skipped_steps(self) -> int:
        return 0  # no step is ever dropped (train.nonfinite=skip needs DeepSpeed)

    def metrics(self) -> dict[str, float]:
        count, seconds = compilations()
        return {"xla/compilations": count, "xla/compile_s": seconds, "xla/devices": int(self.mesh.size())}

    # -- state ------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.to_host(self.module.state_dict())

    def local_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.module.state_dict())  # sharded arrays, each a whole tensor to the program

    def local_part(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors

    def weights_changed(self) -> None:
        pass

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole fp32 CPU copies of (sharded) device tensors, assembled from their shards without
        compiling anything. Collective: with several hosts, rank 0 gathers the others' shards and
        gets the whole tensors; the other ranks get an empty dict."""
        from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

        _materialise()
        local = _sharded_cpu_state_dict(dict(tensors))
        pieces = {key: _pieces(value) for key, value in local.items()}
        group = self._gather_group
        if group is not None and dist.get_world_size(group) > 1:
            gathered = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
            dist.gather_object(pieces, gathered, dst=0, group=group)
            if gathered is None:
                return {}
            pieces = {key: [p for host in gathered for p in host[key]] for key in pieces}
        return {key: _assemble(parts) for key, parts in pieces.items()}

    def _state(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
        }

    def save(self, folder: str) -> PendingSave:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner
        from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

        from vitray import storage

        _materialise()
        snapshot = _sharded_cpu_state_dict(self._state())  # host copies: training may go on at once
        target = storage.join(folder, CHECKPOINT_SUBDIR)

        def write() -> list:
            _quiet_warnings()
            # Straight into the checkpoint folder: DCP's writers fsync each file locally
            # (sync_files) and PUT each object on an object store.
            writer = (
                FsspecWriter(target, sync_files=False)
                if storage.is_remote(target)
                else dcp.FileSystemWriter(target, sync_files=True)
            )
            written = WrittenFiles(writer)  # each file's size and CRC-32C, as it is written
            dcp.save(snapshot, storage_writer=writer, planner=SPMDSavePlanner(), process_group=self._group)
            return _written_entries(written.files())

        return PendingSave([self._writer.submit(write)])

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        import torch_xla
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        written_by = state.get("backend", "deepspeed")
        if written_by != self.name:
            raise ValueError(
                f"checkpoint {folder} was written by the {written_by} backend and cannot be resumed with "
                f"train.backend={self.name}: resume it with train.backend={written_by}, or start a new run from its "
                f"weights with init.checkpoint={folder}"
            )
        source = folder / CHECKPOINT_SUBDIR
        if not (source / ".metadata").is_file():
            raise FileNotFoundError(f"checkpoint {folder} has no {CHECKPOINT_SUBDIR}/.metadata (DCP shards)")
        # DCP reads each tensor's shards to plan the load: every tensor must be finished (the
        # optimizer state just created may still be computing; reading it then fails in torch_xla).
        _materialise()
        target = self._state()  # DCP loads in place, re-sharding onto this mesh
        dcp.load(
            target,
            storage_reader=dcp.FileSystemReader(str(source)),
            planner=SPMDLoadPlanner(),
            process_group=self._group,
        )
        self.optimizer.load_state_dict(target["optimizer"])
        self.schedule.load_state_dict(target["schedule"])
        torch_xla.sync()


def _recompute_block(block: nn.Module, x: torch.Tensor, first_token_only: bool) -> torch.Tensor:
    """A ViT block that keeps nothing for the backward pass but its input: torch-xla's checkpoint,
    whose recomputation an optimization barrier keeps XLA from merging back into the forward's
    (torch's own checkpoint cannot run on XLA tensors). It restores the step's RNG state, so
    dropout draws the same masks again."""
    from torch_xla.utils.checkpoint import checkpoint

    return checkpoint(functools.partial(block, first_token_only=first_token_only), x)


def _written_entries(files: dict[str, tuple[int, int]]) -> list:
    """A rank's DCP files (its `__<rank>_*.distcp`, and rank 0 the `.metadata`; DCP writes them all
    directly in its folder) as `Written` entries for its completion record."""
    from vitray.trainers.engines.seam import Written

    return [
        Written(f"{CHECKPOINT_SUBDIR}/{path.rsplit('/', 1)[-1]}", size, crc)
        for path, (size, crc) in sorted(files.items())
    ]


def _materialise() -> None:
    """Run pending work and wait for it: shards can only be copied out of finished tensors."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def _pieces(value: Any) -> list[tuple[Any, torch.Tensor, torch.Size]]:
    """(index into the whole tensor, data, whole shape) of each local shard of one tensor."""
    if isinstance(value, torch.Tensor):  # not sharded: the whole tensor
        return [(Ellipsis, value, value.shape)]
    parts = []
    for shard in value.shards:
        if shard.indices is Ellipsis:
            parts.append((Ellipsis, shard.data, value.global_shape))
        else:
            unpadded = tuple(slice(0, s.stop - s.start) for s in shard.indices)
            parts.append((tuple(shard.indices), shard.data[unpadded], value.global_shape))
    return parts


def _assemble(parts: list[tuple[Any, torch.Tensor, torch.Size]]) -> torch.Tensor:
    index, data, shape = parts[0]
    whole = (
        torch.empty(shape, dtype=torch.float32) if data.is_floating_point() else torch.empty(shape, dtype=data.dtype)
    )
    for index, data, _ in parts:
        whole[index] = data
    return whole
