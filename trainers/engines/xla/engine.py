"""The torch-xla engine as the config, the driver and the loop see it (torch_xla not imported)."""

from __future__ import annotations

from typing import Any

from vitray.trainers.driver_checks.tpu_slices import tpu_slice
from vitray.trainers.engines.seam import Engine


def _check_config(cfg: Any) -> None:
    """What the xla backend cannot do, refused with the config (before Ray) instead of ignored or met
    by the workers."""
    if cfg.precision.dtype in ("fp16", "fp8"):
        raise ValueError(
            f"precision.dtype={cfg.precision.dtype} is for GPUs; train.backend=xla trains in bf16 (TPUs) or fp32"
        )
    if cfg.model.grad_checkpointing and cfg.model.remat_policy != "nothing_saveable":
        raise ValueError(
            f"model.remat_policy={cfg.model.remat_policy} needs torch's selective checkpointing, which fails on XLA "
            "tensors: train.backend=xla recomputes whole blocks (remat_policy=nothing_saveable)"
        )
    if cfg.train.compile:
        raise ValueError(
            "train.compile is torch.compile for DeepSpeed; XLA compiles the whole step itself: leave it unset"
        )
    if cfg.train.attention != "auto":
        raise ValueError(
            f"train.attention={cfg.train.attention} names a CUDA attention kernel; XLA compiles its own: leave it at auto"
        )
    if cfg.cluster.num_workers > 1 and cfg.cluster.tpu is None:
        # Each worker would train a copy of its own: the mesh is the slice's devices, which only
        # cluster.tpu reserves together (on the CPU, each process's emulated devices are a mesh apart).
        raise ValueError(
            f"cluster.num_workers={cfg.cluster.num_workers} with train.backend=xla: several workers are the hosts "
            "of one TPU slice, which cluster.tpu names (e.g. v6e-16: 4 workers); without it, one worker (the default)"
        )
    if cfg.cluster.tpu is not None:
        chips = tpu_slice(cfg.cluster.tpu, cfg.cluster.tpu_topology).chips_per_host
        if cfg.train.micro_batch_size % chips:
            raise ValueError(
                f"train.micro_batch_size={cfg.train.micro_batch_size} does not split over the {chips} chips of a "
                f"{cfg.cluster.tpu} host: give a multiple of {chips} (each host's batch is split evenly over its chips)"
            )


def _process_group(use_gpu: bool) -> str:
    # The devices talk through XLA itself; the gloo group only coordinates the hosts (checkpoint
    # writes, metric reductions) on the CPU. (Ray's TorchXLAConfig is for AWS Neuron, not TPUs.)
    return "gloo"


ENGINE = Engine(
    name="xla",
    description="TPU slices through torch-xla",
    backend="vitray.trainers.engines.xla.backend:XlaBackend",
    hardware="TPUs",
    tpu=True,
    own_attention=True,  # XLA compiles its own attention
    lazy_tensors=True,
    check_config=_check_config,
    process_group=_process_group,
    # restore_files left out: each host reads the whole checkpoint (torch.distributed.checkpoint
    # re-shards it on load).
)
