"""The training loop run by every worker: build, restore, loop over `train_step`, save.

Randomness is derived from (seed, step, rank) at every step -- dropout, mixup -- and data
augmentation from (seed, epoch, slot, position) in the loader, so a resumed run reproduces an
uninterrupted one exactly without carrying generator states around.

The engine (DeepSpeed or torch-xla) sits behind `vitray.trainers.backend.TrainBackend`.
Checkpoints are written in the background: at a save step every rank snapshots its state and goes
on training; the folder is handed to the run (and its asynchronous upload) at the first step at
which every rank has finished writing, so the checkpoint costs training little more than the
snapshot.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vitray.data import ShardLoader, read_dataset_info, storage
from vitray.models import ModelConfig, create_model_from_config
from vitray.trainers import checkpoint as ckpt
from vitray.trainers.backend import PendingSave, TrainBackend, create_backend
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext
from vitray.trainers.ema import Ema
from vitray.trainers.evals import EvalEnv, build_evaluators
from vitray.trainers.keys import SampleKeyRecorder
from vitray.trainers.metrics import MetricsWriter, accelerator_peak_tflops, train_flops_per_image
from vitray.trainers.objectives import build_objective
from vitray.trainers.run_files import RunFiles, resolve_checkpoint


def step_seed(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


class TrainingLoop:
    def __init__(self, cfg: TrainingConfig, ctx: WorkerContext):
        self.cfg, self.ctx = cfg, ctx
        self.rank, self.world = ctx.rank, ctx.world_size
        self.accum = cfg.train.batch_size // (cfg.train.micro_batch_size * self.world)
        self.info = read_dataset_info(cfg.data.train, cfg.data.storage_options)
        self.objective = build_objective(cfg.train, self.info.label_kind, self.info.num_classes)
        self.evaluators = build_evaluators(cfg)
        self.run_files = RunFiles(ctx.run_dir)

        restore_state = ckpt.verify_complete(ctx.restore_dir) if ctx.restore_dir is not None else None
        restore = (ctx.restore_dir, restore_state) if restore_state is not None else None

        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = self._initial_model()
        self.backend: TrainBackend = create_backend(cfg, model, self.world, restore)
        self.ema = Ema(self.backend.module, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
        # The backend may wrap the loader (XLA: batches put on the device, sharded, by a prefetching loader).
        self.loader = self.backend.device_loader(ShardLoader(
            cfg.data.train,
            cfg.data.train_split,
            rank=self.rank,
            world_size=self.world,
            batch_size=cfg.train.micro_batch_size,
            img_size=cfg.model.img_size,
            train=True,
            seed=cfg.seed,
            num_slots=cfg.data.num_slots,
            num_workers=cfg.data.num_workers,
            shuffle_buffer=cfg.data.shuffle_buffer,
            storage_options=cfg.data.storage_options,
            min_crop_area=cfg.data.min_crop_area,
            flip=cfg.data.flip,
        ))
        self.step = 0
        self.pending_metrics: dict[str, float] = {}
        self.in_flight: _CheckpointInFlight | None = None
        if restore is not None:
            self._restore(*restore)
        self.keys = None
        if cfg.debug.record_sample_keys:
            attempt = _broadcast_int(time.time_ns(), device=self.backend.device)  # one id for this attempt's ranks
            self.keys = SampleKeyRecorder(
                cfg.debug.record_sample_keys, rank=self.rank, start_step=self.step, attempt=attempt
            )
        self.flops_per_image = train_flops_per_image(
            lambda: create_model_from_config(ModelConfig(**self._architecture()), self.info.num_classes),
            cfg.model.img_size,
        )
        self.peak_tflops = accelerator_peak_tflops(cfg.log.peak_tflops)
        self.metrics = None
        if self.rank == 0:
            local_metrics = Path(tempfile.mkdtemp(prefix="vitray-metrics-"))
            self.run_files.seed_local_metrics(local_metrics, self.step)
            self.metrics = MetricsWriter(local_metrics, self.run_files)

    # -- the recipe -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        train = self.cfg.train
        batches = iter(self.loader)
        window = _Window()
        last: dict[str, Any] = {}
        while self.step < train.steps:
            loss, grad_norm, data_wait, skipped = self.train_step(batches)
            self.step += 1
            window.add(loss, data_wait, skipped)
            metrics: dict[str, Any] = {}
            if self.step % self.cfg.log.every == 0 or self.step == train.steps:
                metrics = self._step_metrics(window, grad_norm)
                window = _Window()
            if metrics and self.pending_metrics:
                metrics.update(self.pending_metrics)
                self.pending_metrics = {}
            for evaluator in self.evaluators:
                if evaluator.due(self.step, train.steps):
                    metrics.update(evaluator(self.backend.module, self._eval_env()))
            save = self.step % self.cfg.checkpoint.every == 0 or self.step == train.steps
            self._finish_checkpoint(wait=save)
            if metrics and self.metrics is not None:
                self.metrics.write(self.step, metrics)
            if save:
                self._start_checkpoint(metrics)
            elif metrics:
                self.ctx.report({"step": self.step, **metrics}, None)
            last = metrics or last
            self._maybe_inject_failure()
        self._finish_checkpoint(wait=True)
        if self.metrics is not None:
            self.metrics.close()
        if self.keys is not None:
            self.keys.close()
        return last

    def train_step(self, batches) -> tuple[float, float, float, int]:
        # Under SPMD (XLA) all hosts run one program, so they must draw the same randomness.
        rng_rank = 0 if self.backend.spmd else self.rank
        seed = step_seed(self.cfg.seed, self.step, rng_rank)
        torch.manual_seed(seed)
        self.backend.begin_step(seed)
        rng = np.random.default_rng([self.cfg.seed, self.step, rng_rank])
        losses, data_wait, skipped = [], 0.0, 0
        for _ in range(self.accum):
            t0 = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - t0
            skipped += batch.num_skipped
            if self.keys is not None:
                self.keys.record(self.step, batch.keys)
            loss = self.objective.loss(self.backend, batch, rng)
            self.backend.backward_step(loss)
            losses.append(loss.detach())
        self.backend.end_step()
        if self.ema is not None:
            self.ema.update(self.backend.module)
        loss = float(torch.stack(losses).float().mean())
        return loss, self.backend.grad_norm(), data_wait, skipped

    # -- pieces -----------------------------------------------------------------------------------
    def _initial_model(self) -> torch.nn.Module:
        """Scratch, or `init.checkpoint`'s weights at this run's resolution with a fresh head
        (when resuming, the run's own checkpoint then replaces these weights)."""
        init = self.cfg.init
        if init.checkpoint is None:
            return create_model_from_config(self.cfg.model, self.info.num_classes)
        fs, path = storage.filesystem(resolve_checkpoint(init.checkpoint))
        model, _ = ckpt.load_model(path, fs)
        if init.reset_head or model.num_classes != self.info.num_classes:
            model.reset_head(self.info.num_classes)
        model.set_img_size(self.cfg.model.img_size)
        return model

    def _step_metrics(self, window: "_Window", grad_norm: float) -> dict[str, Any]:
        loss, skipped = _all_reduce(
            [window.loss_sum / window.steps, float(window.skipped)], average=[True, False], device=self.backend.device
        )
        elapsed = time.perf_counter() - window.started
        images_per_s = window.steps * self.cfg.train.batch_size / elapsed
        tflops = self.flops_per_image * images_per_s / self.world / 1e12
        metrics = {
            "loss": loss,
            "lr": self.backend.lr(),
            "grad_norm": grad_norm,
            "images_per_s": images_per_s,
            "tflops_per_worker": tflops,
            "data_wait_fraction": window.data_wait / elapsed,
            "skipped_samples": int(skipped),
            "epoch": self.loader.state_dict()["epoch"],
            **self.backend.metrics(),
        }
        if self.peak_tflops:
            metrics["mfu"] = tflops / self.peak_tflops
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {self.step}: stopping instead of training on NaNs")
        return metrics

    def _eval_env(self) -> EvalEnv:
        device = self.backend.device
        return EvalEnv(self.rank, self.world, device, self.backend.dtype,
                       lambda values: _all_reduce(values, average=[False] * len(values), device=device))  # fmt: skip

    # -- checkpoints --------------------------------------------------------------------------
    def _start_checkpoint(self, metrics: dict[str, Any]) -> None:
        """Snapshot this rank's share of the checkpoint and write it in the background."""
        folder = Path(tempfile.mkdtemp(prefix=f"vitray-ckpt-{self.step:08d}-r{self.rank}-"))
        t0 = time.perf_counter()
        shards = self.backend.save(folder)
        weights = self.backend.full_state_dict()  # collective: every rank takes part
        ema = self.backend.to_host(self.ema.state_dict()) if self.ema is not None else None  # collective
        state = {
            "step": self.step,
            "world_size": self.world,
            "backend": self.backend.name,
            "data": self.loader.state_dict(),
            "num_classes": self.info.num_classes,
            "label_kind": self.info.label_kind,
            "model": self._architecture(),
            "config": self._recorded_config(),
        }
        writer = _CheckpointWriter(folder, self.rank, shards, weights if self.rank == 0 else None,
                                   ema if self.rank == 0 else None, state if self.rank == 0 else None)  # fmt: skip
        self.in_flight = _CheckpointInFlight(folder, self.step, metrics, writer, snapshot_s=time.perf_counter() - t0)

    def _finish_checkpoint(self, wait: bool) -> None:
        """Hand the checkpoint in flight to the run once every rank has written its share.

        Whether that is now is decided jointly (one small all-reduce per step while a write is in
        flight), so all ranks report it at the same step, as Ray Train requires.
        """
        flight = self.in_flight
        if flight is None:
            return
        if not wait:
            done = _all_reduce([float(flight.writer.done())], average=[False], device=self.backend.device)[0]
            if done < self.world:
                return
        t0 = time.perf_counter()
        flight.writer.wait()
        waited = time.perf_counter() - t0
        self.in_flight = None
        written = flight.writer.seconds
        self.ctx.report({**flight.metrics, "step": flight.step, "checkpoint_write_s": written}, flight.folder)
        handed_over = time.perf_counter() - t0 - waited
        # The next logged step carries what the save cost, so the driver and benchmarks see it:
        # the background write's duration and how long training actually stood still for it
        # (the snapshot, any wait for the writer, and handing the folder to the uploader).
        self.pending_metrics = {
            "checkpoint_write_s": written,
            "checkpoint_blocked_s": flight.snapshot_s + waited + handed_over,
            "checkpoint_snapshot_s": flight.snapshot_s,
            "checkpoint_wait_s": waited,
            "checkpoint_report_s": handed_over,
        }

    def _recorded_config(self) -> dict[str, Any]:
        if self.ctx.recorded_config is not None:
            return self.ctx.recorded_config
        return self.cfg.model_dump(mode="json", exclude={"data": {"storage_options"}})

    def _architecture(self) -> dict[str, Any]:
        """The model as built (fine-tuning changes the head and resolution of `init.checkpoint`'s)."""
        module = self.backend.module
        return {
            **self.cfg.model.model_dump(mode="json"),
            "name": module.name,
            "img_size": module.img_size,
            "head": module.head_type,
            "representation_size": module.representation_size,
        }

    def _restore(self, folder: Path, state: dict[str, Any]) -> None:
        self.backend.load(folder, state)
        if self.ema is not None and (folder / ckpt.EMA_FILE).is_file():
            from safetensors.torch import load_file

            self.ema.load_state_dict(load_file(str(folder / ckpt.EMA_FILE)))
        self.loader.load_state_dict(state["data"])
        self.step = int(state["step"])

    def _maybe_inject_failure(self) -> None:
        at = self.cfg.debug.kill_worker_at_step
        if at != self.step or self.rank != self.world - 1:
            return
        if self.run_files.claim_once(f"killed-at-step-{at}"):
            os.kill(os.getpid(), signal.SIGKILL)


class _CheckpointWriter:
    """Writes one rank's checkpoint files on a background thread: waits for the backend's
    shards, writes rank 0's weights and trainer state, and the completion record last."""

    def __init__(self, folder: Path, rank: int, shards: PendingSave, weights, ema, state):
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._args = (folder, rank, shards, weights, ema, state)
        self._thread = threading.Thread(target=self._run, name=f"vitray-ckpt-r{rank}", daemon=True)
        self._started = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        folder, rank, shards, weights, ema, state = self._args
        try:
            from safetensors.torch import save_file

            shards.wait()
            if weights is not None:
                save_file(weights, str(folder / ckpt.MODEL_FILE))
            if ema is not None:
                save_file(ema, str(folder / ckpt.EMA_FILE))
            if state is not None:
                ckpt.write_state(folder, state)
            ckpt.mark_complete(folder, rank, ckpt.files_under(folder))
        except BaseException as error:  # surfaced by wait() on the training thread
            self._error = error
        finally:
            self.seconds = time.perf_counter() - self._started
            self._args = None

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing the checkpoint failed: {self._error}") from self._error


@dataclass
class _CheckpointInFlight:
    folder: Path
    step: int
    metrics: dict[str, Any]
    writer: _CheckpointWriter
    snapshot_s: float  # how long the snapshot held training up


class _Window:
    """Sums over the steps since the last log."""

    def __init__(self):
        self.started = time.perf_counter()
        self.steps = 0
        self.loss_sum = 0.0
        self.data_wait = 0.0
        self.skipped = 0

    def add(self, loss: float, data_wait: float, skipped: int) -> None:
        self.steps += 1
        self.loss_sum += loss
        self.data_wait += data_wait
        self.skipped += skipped


def _all_reduce(values: list[float], average: list[bool], device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device(device))
    dist.all_reduce(tensor)
    world = dist.get_world_size()
    return [v / world if avg else v for v, avg in zip(tensor.tolist(), average)]


def _broadcast_int(value: int, device) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device(device))
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def _collective_device(device):
    """NCCL reduces GPU tensors; gloo reduces CPU ones (also in an XLA worker, whose process group is gloo)."""
    return device if dist.get_backend() == "nccl" else "cpu"
