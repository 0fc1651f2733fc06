"""DeepSpeed's checkpoint engine as vitray runs it: every state dict DeepSpeed saves is snapshotted
into host buffers kept from one checkpoint to the next (pinned on a GPU) and written on a background
thread, once, straight into the checkpoint folder in the run folder (local or s3://); every file a
resume loads is read straight into the tensors the run keeps, checked as it is read."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import vitray.trainers.engines.deepspeed.light_import  # noqa: F401  (first: DeepSpeed without its mlflow import)

# isort: split
import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from vitray.trainers.checkpoint import torch_file
from vitray.trainers.checkpoint.checked_copy import file_check
from vitray.trainers.checkpoint.host_buffers import HostBuffers
from vitray.trainers.checkpoint.rank_files import write_file
from vitray.trainers.engines.seam import PendingSave

# The folder DeepSpeed is told to save under: it only names the files (their paths under it are
# their paths in the checkpoint folder); nothing is made there (BackgroundCheckpointEngine).
DEEPSPEED_SAVE_ROOT = Path("/vitray-deepspeed-save")


class BackgroundCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine with the writes moved to a background thread and into the
    checkpoint folder itself.

    DeepSpeed names its files under `DEEPSPEED_SAVE_ROOT`, a folder that is never made (`makedirs`
    does nothing); `begin(folder)` says where the files go instead: `save` snapshots each state dict
    into host buffers and queues the write of `folder/<its path under the root>` (a local path or a
    URL; the writer makes the folders it needs), and `pending()` queues the writes of everything
    snapshotted since `begin` and gives their futures. (The writes start once the whole snapshot is
    taken: a writer thread serialising beside the snapshot holds the GIL for milliseconds at a time,
    which the training thread, between its copies and DeepSpeed's collectives, would wait for.)
    Module states leave out the weights named in `drop_module_weights` (they follow from the fp32
    master copy). Loading reads with `weights_only=True`, so a checkpoint cannot run code when it
    is opened.
    """

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.name = "VitrayBackgroundCheckpointEngine"
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitray-ckpt")
        self._snapshots: list[tuple[str, Any]] = []  # (file name, its state in host buffers)
        self._buffers = HostBuffers()
        self._target: str | None = None
        self.drop_module_weights: set[str] = set()
        # ZeRO-0's master copies (bf16/fp16) are kept in groups with no names; the module states
        # name them in DeepSpeed's own key for that (`param_shapes`, which ZeRO 1-3 fill), so that
        # the weights can be derived from the checkpoint (runfolder's derived_weights).
        self.master_shapes: list[dict[str, torch.Size]] | None = None
        # Where a restore reads the fp32 master weights of an optimizer shard straight into
        # (`masters_into`): DeepSpeed's own partitions, which its load would otherwise copy them into.
        self.master_partitions: list[torch.Tensor] = []

    def masters_into(self, state: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Pairs of an optimizer shard's master weights (ZeRO 1-2) and the partition DeepSpeed loads
        them into (`torch_file.load`'s `into`)."""
        optimizer = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        saved = optimizer.get("single_partition_of_fp32_groups") if isinstance(optimizer, dict) else None
        if not saved or len(saved) != len(self.master_partitions):
            return []
        return list(zip(saved, self.master_partitions))

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot already copies every tensor compactly

    def begin(self, folder: str) -> None:
        self._snapshots, self._target = [], folder

    def makedirs(self, path, exist_ok=False) -> None:
        """Nothing: DeepSpeed's folders are only names (the files go to the checkpoint folder)."""

    def save(self, state_dict, path: str) -> None:
        name = Path(path).relative_to(DEEPSPEED_SAVE_ROOT).as_posix()
        module = state_dict.get("module") if isinstance(state_dict, dict) else None
        if self.drop_module_weights and isinstance(module, dict):
            kept = type(module)((k, v) for k, v in module.items() if k not in self.drop_module_weights)
            state_dict = {**state_dict, "module": kept}
            if self.master_shapes is not None and state_dict.get("param_shapes") is None:
                state_dict["param_shapes"] = self.master_shapes
        snapshot = self._buffers.snapshot(state_dict, (name,))
        self._snapshots.append((name, snapshot))

    def load(self, path: str, map_location=None):
        # Read once, straight into the tensors the optimizer keeps. A file of a local checkpoint
        # (whose check the restore left to its reader) is checked as it is read, past the page
        # cache; a copy downloaded from S3 was checked as it came down, and its bytes are in the
        # page cache: read from there.
        check = file_check(path)
        with torch.serialization.safe_globals(_deepspeed_checkpoint_classes()):
            return torch_file.load(
                path, check=check, direct=check is not None, into=self.masters_into, map_location=map_location
            )

    def reserve_buffers(self, like: list[torch.Tensor]) -> None:
        """Have host buffers for tensors like `like` ready for the first snapshot (HostBuffers.reserve)."""
        self._buffers.reserve(like)

    def pending(self) -> PendingSave:
        self._buffers.settle()  # (the copies from a GPU, all in flight until now)
        self._buffers.release_reserve()  # (what the first checkpoint did not take)
        folder, snapshots = self._target, self._snapshots
        self._target, self._snapshots = None, []
        return PendingSave(
            [
                self._writer.submit(write_file, folder, name, partial(_save_without_zip_crc, state))
                for name, state in snapshots
            ]
        )


def _save_without_zip_crc(state: Any, f) -> None:
    """`torch.save` without the CRC-32 of each of its zip records: every checkpoint file's CRC-32C is
    in its rank's completion record and checked on every read (`write_file` computes it as the bytes
    go out), and torch's own took most of the save's time (measured: a 1 GB state fsynced at ~0.5
    GB/s with it, ~1.3 GB/s without). `torch.load` reads such files as any other; only a zip tool
    would complain of their CRCs. Each tensor's bytes start on a page of the file (torch's
    `storage_alignment`; at most a page of padding a tensor), so that a restore reads them with
    O_DIRECT straight into its tensors (`torch_file.load`). (torch's options are process-wide: set
    for this save alone, on the checkpoint engine's one writer thread.)"""
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False, "save.storage_alignment": torch_file.STORAGE_ALIGNMENT}):
        torch.save(state, f)


def _deepspeed_checkpoint_classes() -> list[type]:
    """The plain-data classes DeepSpeed pickles into its optimizer states (found with
    `torch.serialization.get_unsafe_globals_in_checkpoint` for ZeRO 0-3, fp32/bf16/fp16): safe to
    rebuild, unlike arbitrary globals, which `weights_only=True` keeps refusing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
