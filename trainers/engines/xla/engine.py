"""The torch-xla engine as the config, the driver and the loop see it (torch_xla not imported)."""

from __future__ import annotations

from typing import Any

from vitray.trainers.engines.seam import Engine


def _check_config(cfg: Any) -> None:
    if cfg.precision.dtype in ("fp16", "fp8"):
        raise ValueError(
            f"precision.dtype={cfg.precision.dtype} is for GPUs; train.backend=xla trains in bf16 (TPUs) or fp32"
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
