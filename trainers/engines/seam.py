"""The seam between the training loop and the engine that runs it (DeepSpeed, torch-xla, ...).

The loop (`trainers/loop.py`) owns the recipe: data, objectives, schedules, metrics, when to
evaluate and checkpoint. An engine owns what differs per accelerator stack, in two parts:

- `Engine`, its description, light to import (the driver and the config read it): the config
  rules it adds, the process group its workers join, which checkpoint files a rank reads to resume,
  what the driver prepares before a resume, and what it can do (its capabilities);
- `TrainBackend`, built on each worker (importing the engine's heavy libraries then): where the
  model lives and how it is sharded, the optimizer step (with gradient accumulation and clipping),
  and how its share of a checkpoint is written and read back.

Each engine is a folder of its own under `trainers/engines/`, registered by name in
`trainers/engines/registry.py`; nothing outside its folder asks which engine a run has.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class Written:
    """One file of a checkpoint as written: its name in the checkpoint folder (`/`-separated),
    size and CRC-32C (what the rank's completion record lists)."""

    name: str
    size: int
    crc32c: int


class PendingSave:
    """A checkpoint write that may still be running in the background: the futures of the
    background writes of this rank's share (a backend's `save` returns one); each future gives
    the `Written` files it wrote (one, or a list)."""

    def __init__(self, futures: list[Future]):
        self._futures = futures

    def done(self) -> bool:
        """True when every file of this rank's share is written and closed."""
        return all(f.done() for f in self._futures)

    def wait(self) -> list[Written]:
        """Block until `done()` and return the files written; re-raises the writer's error, if any."""
        written: list[Written] = []
        for future in self._futures:
            result = future.result()
            written += result if isinstance(result, list) else [result] if isinstance(result, Written) else []
        return written


class TrainBackend(Protocol):
    name: str  # the engine's registered name; recorded in trainer_state.json
    module: nn.Module  # the bare model, for evaluation, EMA and evaluators
    device: torch.device  # where inputs go
    dtype: torch.dtype  # the dtype of inputs (bf16 / fp16 / fp32)
    spmd: bool  # one program over all hosts (XLA): per-step randomness must be the same on every rank
    # The forward pass is a collective (ZeRO-3 gathers weights in it; XLA over several hosts runs
    # one program): every rank must make the same forward calls, evaluations and probes included.
    collective_forward: bool
    # Its checkpoint shards give the consolidated fp32 weights (`vitray.runfolder.derived_weights`
    # derives them on demand): a checkpoint may then leave out model.safetensors
    # (`checkpoint.model_weights`).
    weights_in_shards: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The training forward pass (through the engine's wrapper)."""

    def device_loader(self, loader: Any) -> Any:
        """The training loader the loop iterates, made from a uint8 `ShardLoader`: a wrapper that
        puts batches on the device ahead of the step (DeepSpeed: `trainers/step/feed.py`; XLA: sharded
        along the batch), whose `state_dict()` still counts only the batches handed to the loop."""

    def begin_step(self, seed: int) -> None:
        """Called before every optimizer step with its seed (XLA seeds its own generator here)."""

    def backward_step(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss; at the end of each accumulation window also clip,
        step the optimizer and the lr schedule, and zero the gradients."""

    def end_step(self) -> None:
        """Called once after every optimizer step (XLA cuts and runs its graph here)."""

    def grad_norm(self) -> torch.Tensor | float:
        """The global gradient norm of the last optimizer step (before clipping), left on the
        device: the loop reads it on log steps only, so other steps never wait for the device."""

    def lr(self) -> float:
        """The learning rate the last optimizer step trained at (not the next step's)."""

    def skipped_steps(self) -> int:
        """Optimizer steps dropped so far for non-finite gradients (`train.nonfinite=skip`), a host
        count (no device read), restored with the checkpoint."""

    def metrics(self) -> dict[str, float]:
        """Backend-specific figures for the logged metrics (XLA: `xla/compilations`)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated fp32 module weights on the CPU. Collective: every rank calls it; complete on
        rank 0 (other ranks may get an empty dict)."""

    def local_weights(self) -> dict[str, torch.Tensor]:
        """The module's state by name as this rank holds it, writable in place: the whole tensors,
        or under ZeRO-3 each parameter's flat slice on this rank. The EMA keeps tensors shaped like
        these, so it is partitioned as the weights are."""

    def local_part(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part (shaped as `local_weights`) of whole module-shaped tensors."""

    def weights_changed(self) -> None:
        """Called on every rank after `local_weights` were written in place (evaluating the EMA
        weights), so that copies the backend keeps whole are updated too."""

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole fp32 CPU copies of tensors shaped as `local_weights` (e.g. the EMA weights), taken
        now. Collective, like `full_state_dict`: complete on rank 0."""

    def save(self, folder: str) -> PendingSave:
        """Start writing this rank's share of the model, optimizer and schedule state into the
        checkpoint folder `folder` (a local path or a URL in the run folder: written there once,
        with `vitray.trainers.checkpoint.rank_files.write_file`). Training may go on at once: the
        state is snapshotted before this returns."""

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        """Restore from a complete checkpoint folder (`state` is its trainer_state.json), also one
        written by another number of workers."""


# Picks, from a complete checkpoint's trainer state and its files, those one rank reads to resume;
# None: all of them.
FileSelector = Callable[[dict[str, Any], list[str]], "list[str] | None"]


def _no_rules(cfg: Any) -> None:
    pass


def _gloo(use_gpu: bool) -> str:
    return "gloo"


def _whole_checkpoint(cfg: Any, rank: int, world: int) -> FileSelector | None:
    return None


def _nothing_to_prepare(cfg: Any, chosen: Any) -> None:
    pass


@dataclass(frozen=True)
class Engine:
    """An engine as the config, the driver and the loop see it, without importing its libraries.

    `cfg` below is a `vitray.trainers.config.TrainingConfig` (not imported here: the config module
    reads the registry for its rules)."""

    name: str  # the value of `train.backend`
    description: str  # what it runs on, for `train.backend`'s reference
    backend: str  # "module:class" of its TrainBackend, imported when a worker builds it
    hardware: str  # where it trains, for messages ("TPUs")
    # Capabilities, read by the config's rules and the loop:
    tpu: bool = False  # trains on TPU slices (cluster.tpu)
    gpu_decode: bool = False  # its batches may be decoded on the GPU (data.decode=gpu)
    skips_nonfinite: bool = False  # may drop an optimizer step whose gradients are not finite
    own_attention: bool = False  # compiles its own attention: train.attention does not apply
    zero_stages: bool = False  # train.zero_stage applies (and a checkpoint keeps to its stage)
    # Its tensors are lazy graphs: every new operation on them compiles one more graph, so the loop
    # reads values one by one and scans no weights of its own accord.
    lazy_tensors: bool = False
    # The rules it adds to the config's (raise ValueError naming the key).
    check_config: Callable[[Any], None] = _no_rules
    # torch.distributed's backend for the workers' process group, given whether they have GPUs.
    process_group: Callable[[bool], str] = _gloo
    # What rank `rank` of `world` reads of a checkpoint to resume (cfg, rank, world); None: all of it.
    restore_files: Callable[[Any, int, int], FileSelector | None] = _whole_checkpoint
    # Run by the driver before the workers resume from `chosen` (a runfolder CheckpointInfo).
    prepare_resume: Callable[[Any, Any], None] = _nothing_to_prepare
