"""The training loop run by every worker: build, restore, loop over `train_step`, save.

Randomness is derived from (seed, step, rank) at every step -- dropout, mixup -- and data
augmentation from (seed, epoch, slot, position) in the loader, so a resumed run reproduces an
uninterrupted one exactly without carrying generator states around.

The loop is made of components that own their state: the engine (DeepSpeed or torch-xla) behind
`vitray.trainers.engines.seam.TrainBackend`, the data loader, the EMA, and the
`vitray.trainers.checkpoint.checkpointer.Checkpointer` that saves and restores them all, writing in the
background so that a checkpoint costs training little more than a snapshot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitray import storage
from vitray.common.leftovers import remove_stale
from vitray.common.redact import redacted_config
from vitray.data import ShardLoader, read_dataset_info, transforms
from vitray.data.batch import UnreadableData
from vitray.data.eval_loader import start_worker_server
from vitray.evaluation.evaluators import Forward
from vitray.models import TRAINING_SETTINGS, ModelConfig, create_model_from_config
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.runfolder.files import RunFiles
from vitray.runfolder.lease import holder_check
from vitray.trainers.checkpoint.checkpointer import Checkpointer
from vitray.trainers.checkpoint.restore import restore_copy
from vitray.trainers.collectives import all_reduce as _all_reduce
from vitray.trainers.collectives import broadcast_int as _broadcast_int
from vitray.trainers.collectives import union_of_names
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext
from vitray.trainers.engines.registry import create_backend
from vitray.trainers.engines.seam import TrainBackend
from vitray.trainers.eval_schedule import build_evaluators
from vitray.trainers.keys import SampleKeyRecorder
from vitray.trainers.metrics import MetricsWriter, accelerator_peak_tflops, train_flops_per_image
from vitray.trainers.preemption import PreemptionWatch
from vitray.trainers.step.attention import attention_context, attention_kernel, model_attention_shape
from vitray.trainers.step.ema import Ema
from vitray.trainers.step.feed import decodes_on_device
from vitray.trainers.step.objectives import build_objective
from vitray.trainers.trackers import Trackers

# Rank 0's local copy of the metrics files, which a background thread mirrors to the run folder.
LOCAL_METRICS_PREFIX = "vitray-metrics-"


def step_seed(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


class TrainingLoop:
    def __init__(self, cfg: TrainingConfig, ctx: WorkerContext):
        self.cfg, self.ctx = cfg, ctx
        self.rank, self.world = ctx.rank, ctx.world_size
        storage.set_outage_budget(cfg.run.storage_outage_s)  # for the checkpoint uploads' ride-out
        self.accum = cfg.grad_accumulation
        self.info = read_dataset_info(cfg.data.train, cfg.data.storage_options)
        self.objective = build_objective(cfg.train, self.info.label_kind, self.info.num_classes)
        self.evaluators = build_evaluators(cfg, self.rank, self.world)
        if any(e.evaluator.uses_worker_processes() for e in self.evaluators):
            start_worker_server()  # evaluation workers' server imports while the model is built
        self.run_files = RunFiles(ctx.run_dir)
        self._skipped_shards: set[str] = set()  # this rank's, since the last log step

        with restore_copy(cfg, ctx) as restore:  # the checkpoint this run resumes from, until loaded
            self._build(restore)
        self.preemption = PreemptionWatch(
            ctx.run_dir,
            rank=self.rank,
            every=cfg.checkpoint.preemption_check_every,
            device=self.backend.device,
            drain_notice=ctx.drain_notice,
            outage_s=cfg.run.storage_outage_s,
        )
        self.keys = None
        if cfg.debug.record_sample_keys:
            attempt = _broadcast_int(time.time_ns(), device=self.backend.device)  # one id for this attempt's ranks
            self.keys = SampleKeyRecorder(
                cfg.debug.record_sample_keys, rank=self.rank, start_step=self.step, attempt=attempt
            )
        self.flops_per_image = train_flops_per_image(  # model FLOPs: counted without activation checkpointing
            lambda: create_model_from_config(
                ModelConfig(**{**self._architecture(), "grad_checkpointing": False}), self.info.num_classes
            ),
            cfg.model.img_size,
        )
        self.peak_tflops = accelerator_peak_tflops(cfg.log.peak_tflops, cfg.precision.dtype)
        self.metrics = None
        if self.rank == 0:
            remove_stale(LOCAL_METRICS_PREFIX)  # earlier attempts' copies a kill left behind
            local_metrics = Path(tempfile.mkdtemp(prefix=LOCAL_METRICS_PREFIX))
            self.run_files.seed_local_metrics(local_metrics, self.step)
            self.metrics = MetricsWriter(
                local_metrics,
                self.run_files,
                upload_every_s=cfg.log.upload_every_s,
                outage_s=cfg.run.storage_outage_s,
                resumed_at=self.step,
            )
            self.checkpointer.before_complete = self.metrics.flush
            self.checkpointer.before_record = holder_check(self.run_files.lease_path)
        self.trackers = None
        if self.rank == 0 and (cfg.log.mlflow or cfg.log.wandb):
            self.trackers = Trackers(
                cfg.log.mlflow, cfg.log.wandb, run_name=cfg.run.name, run_dir=ctx.run_dir, config=redacted_config(cfg)
            )

    def _build(self, restore: tuple[Path, dict[str, Any]] | None) -> None:
        """The model on its engine, the EMA, the loader and the checkpointer, with every component's
        state loaded from `restore` (a local copy of a checkpoint and its trainer state), if any."""
        torch.manual_seed(self.cfg.seed)  # identical initial weights on every rank
        model = self._initial_model(resuming=restore is not None)
        self.backend: TrainBackend = create_backend(self.cfg, model, self.world, restore)
        self.ema = Ema(self.backend, self.cfg.optim.ema_decay) if self.cfg.optim.ema_decay else None
        self.attention, self.attention_kernel = self._attention()
        # The backend puts batches on the device one step ahead (DeepSpeed: `trainers/step/feed.py`;
        # XLA: sharded, by torch-xla's prefetching loader).
        self.loader = self.backend.device_loader(
            ShardLoader(
                self.cfg.data.train,
                self.cfg.data.train_split,
                rank=self.rank,
                world_size=self.world,
                batch_size=self.cfg.train.micro_batch_size,
                micro_batches=self.accum,  # an epoch ends between steps, whatever their split
                img_size=self.cfg.model.img_size,
                train=True,
                seed=self.cfg.seed,
                num_slots=self._num_slots(restore[1] if restore is not None else None),
                num_workers=self.cfg.data.num_workers,
                shuffle_buffer=self.cfg.data.shuffle_buffer,
                storage_options=self.cfg.data.storage_options,
                outage_s=self.cfg.run.storage_outage_s,  # the data's store too: an outage is waited for
                crop=self.cfg.data.crop,
                min_crop_area=self.cfg.data.min_crop_area,
                resize_ratio=self.cfg.data.resize_ratio,
                flip=self.cfg.data.flip,
                float_images=False,  # uint8 crosses to the device; the objective converts it there
                device_decode=self._decodes_on_device(),
            )
        )
        # The run's count of steps with a non-finite loss or gradient, kept in the checkpoint for fp16,
        # whose own it is (DeepSpeed's checkpointed count of dropped steps is the loss scaler's there).
        self.nonfinite = RunCount()
        self.checkpointer = Checkpointer(
            self.backend,
            rank=self.rank,
            world_size=self.world,
            every=self.cfg.checkpoint.every,
            last_step=self.cfg.train.steps,
            report=self.ctx.report,
            run_dir=self.ctx.run_dir,
            model_weights=self.cfg.checkpoint.model_weights,
            record_delay_s=self.cfg.debug.checkpoint_record_delay_s,
            states={"data": self.loader, "nonfinite_steps": self.nonfinite},
            weights={ckpt.EMA_FILE: self.ema} if self.ema is not None else {},
            record={
                "num_classes": self.info.num_classes,
                "label_kind": self.info.label_kind,
                "model": self._architecture(),
                "attention_kernel": self.attention_kernel,
                "config": redacted_config(self.cfg),  # credentials masked
                **ckpt.writer_record(),  # the checkpoint layout and the vitray that wrote it
            },
        )
        self.step = self.checkpointer.restore(*restore) if restore is not None else 0

    def _num_slots(self, restore_state: dict[str, Any] | None) -> int:
        """``data.num_slots``; when unset, the number the run started with (which its checkpoints
        record, whatever the world size now) or, for a new run, the config's default for it."""
        recorded = (restore_state or {}).get("data", {}).get("num_slots")
        if self.cfg.data.num_slots is None and recorded is not None:
            return int(recorded)
        return self.cfg.new_run_num_slots()

    # -- the recipe -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            last = self._run()
        except BaseException:
            # The lines that show what happened, best effort; the local copy is kept only where
            # they could not reach the run folder (each failed attempt's copy stayed in /tmp).
            if self.metrics is not None and self.metrics.close(raise_errors=False):
                shutil.rmtree(self.metrics.local_dir, ignore_errors=True)
            if self.trackers is not None:
                self.trackers.close(failed=True)
            raise
        if self.trackers is not None:
            self.trackers.close()
        if self.metrics is not None:
            self.metrics.close()  # uploads the last lines and waits for them: all of it is in the run folder
            shutil.rmtree(self.metrics.local_dir, ignore_errors=True)
        return last

    def _run(self) -> dict[str, Any]:
        batches = iter(self.loader)
        try:
            return self._train(batches)
        finally:
            # The device feed's thread (on CUDA) and the loader's workers stop now, not whenever the
            # garbage collector reaches the iterator (a raised error's traceback holds on to it).
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _train(self, batches) -> dict[str, Any]:
        train = self.cfg.train
        window = _Window(lazy=self.cfg.engine.lazy_tensors)
        self._skipped_seen = self.backend.skipped_steps()
        if self.cfg.precision.dtype != "fp16":
            # DeepSpeed's count of dropped steps, restored with its state to the very step (a count
            # kept at the last log would miss a dropped step since)
            self.nonfinite.value = self._skipped_seen
        elif self.nonfinite.value is None:  # a new run, or a checkpoint written before the count was kept
            self.nonfinite.value = 0
        last: dict[str, Any] = {}
        while self.step < train.steps:
            if self.cfg.debug.step_delay_s:  # tests: a run to act on while it runs
                time.sleep(self.cfg.debug.step_delay_s)
            with self.attention():  # forward and backward on the kernel of `train.attention`
                loss, grad_norm, data_wait, skipped = self.train_step(batches)
            self.step += 1
            window.add(loss, data_wait, skipped)
            metrics: dict[str, Any] = {}
            logged = self._log_due()
            if logged:
                metrics = {**self._step_metrics(window, grad_norm), **self.checkpointer.take_costs()}
                new_nonfinite = metrics["nonfinite_steps"] - self.nonfinite.value, window.steps
                self.nonfinite.value, self._skipped_seen = metrics["nonfinite_steps"], self.backend.skipped_steps()
                window = _Window(lazy=self.cfg.engine.lazy_tensors)
            for evaluator in self.evaluators:
                if evaluator.due(self.step, train.steps):
                    metrics.update(evaluator(self.backend.module, self._forward(), rank=self.rank, ema=self.ema))
            save = self.checkpointer.due(self.step)
            if metrics and self.metrics is not None:
                self.metrics.write(self.step, metrics)
            if metrics and self.trackers is not None:
                self.trackers.log(self.step, metrics)
            if logged:
                self._apply_nonfinite_policy(*new_nonfinite)  # after the metrics that show it are written
            if save:  # never a checkpoint of non-finite weights, whatever the policy
                self._check_finite(None if logged else window)
            self.checkpointer.finish(wait=save)
            if save:
                self.checkpointer.save(self.step, metrics)
            last = metrics or last
            self._maybe_inject_failure()
            if (stop := self.preemption.check(self.step)) is not None:
                if stop.save and not save:
                    self._check_finite(None if logged else window)
                self.preemption.stop(stop, self.checkpointer, metrics)
                break
        self.checkpointer.finish(wait=True)
        if self.keys is not None:
            self.keys.close()
        return last

    def _log_due(self) -> bool:
        return self.step % self.cfg.log.every == 0 or self.step == self.cfg.train.steps

    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor | float, float, int]:
        """One optimizer step. The loss and grad norm stay on the device (tensors): reading them
        would make the host wait for the step, so the loop reads them on log steps only."""
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
            self._skipped_shards.update(batch.skipped_shards)
            if not batch.keys and batch.num_skipped:
                self._no_readable_sample(batch)
            if self.keys is not None:
                self.keys.record(self.step, batch.keys)
            if self.cfg.debug.loader_only:
                continue
            loss = self.objective.loss(self.backend, batch, rng)
            if self.step + 1 in self.cfg.debug.nonfinite_loss_at_steps and self.rank == self.world - 1:
                loss = loss * float("nan")  # fault injection: a real NaN through backward and the optimizer
            self.backend.backward_step(loss)
            losses.append(loss.detach())
        if self.cfg.debug.loader_only:  # read, not trained on (benchmarks/loader_in_run.py)
            return torch.zeros((), device=self.backend.device), 0.0, data_wait, skipped
        loss = torch.stack(losses).float().mean()  # before end_step: within the step's XLA graph
        self.backend.end_step()
        if self.ema is not None:
            self.ema.update()
        return loss, self.backend.grad_norm(), data_wait, skipped

    # -- pieces -----------------------------------------------------------------------------------
    def _no_readable_sample(self, batch) -> None:
        """A batch of nothing but skipped samples: stop, naming them, instead of stepping on an
        empty batch (a NaN loss many steps later, blamed on the learning rate)."""
        shards = list(batch.skipped_shards)
        named = ", ".join(shards[:5]) + (f" and {len(shards) - 5} more" if len(shards) > 5 else "")
        raise UnreadableData(
            f"no sample of step {self.step + 1}'s batch could be read on rank {self.rank}: all {batch.num_skipped} "
            f"were skipped as corrupt, from {len(shards)} shard(s): {named or 'unknown'}. data.train="
            f"{self.cfg.data.train} is damaged, cut short or not written by `vitray data prepare`: prepare it again"
        )

    def _attention(self):
        """The context of the training step's attention (`train.attention`) and the kernel it runs,
        checked once here with the model's shapes (see `trainers/step/attention.py`)."""
        shape = model_attention_shape(self.backend.module)
        if self.cfg.engine.own_attention or shape is None:  # the engine compiles its own attention
            return contextlib.nullcontext, self.cfg.engine.name if shape is not None else "none"
        tokens, heads, head_dim, dropout = shape
        device = self.backend.device
        kernel = attention_kernel(
            self.cfg.train.attention,
            tokens=tokens,
            heads=heads,
            head_dim=head_dim,
            dtype=self.backend.dtype,
            device=device,
            dropout_p=dropout,
        )
        if self.rank == 0:
            print(
                f"vitray: attention kernel {kernel} (train.attention={self.cfg.train.attention}; {tokens} tokens x "
                f"{heads} heads x {head_dim}, {str(self.backend.dtype).removeprefix('torch.')} on {device.type})",
                flush=True,
            )
        return attention_context(self.cfg.train.attention, device), kernel

    def _decodes_on_device(self) -> bool:
        """`data.decode` resolved on this worker's device; rank 0 says when the loader decodes whole
        JPEGs because this install lacks the region decoder (built only where libjpeg's headers were)."""
        on_device = decodes_on_device(self.cfg.data.decode, self.backend.device)
        if self.rank == 0 and not on_device and not transforms.REGION_DECODE:
            print(f"vitray: {transforms.WHOLE_DECODE_NOTE}", flush=True)
        return on_device

    def _initial_model(self, *, resuming: bool) -> torch.nn.Module:
        """Scratch, or `init.checkpoint`'s weights at this run's resolution with a fresh head,
        trained with this run's dropout and activation checkpointing. When `resuming`, the run's
        own checkpoint replaces every weight: `init.checkpoint`'s architecture is built, its
        weights not read (a download per rank on object storage, at every resume)."""
        init = self.cfg.init
        if init.checkpoint is None:
            return create_model_from_config(self.cfg.model, self.info.num_classes)
        settings = self.cfg.model.model_dump(include=set(TRAINING_SETTINGS))
        model, _ = ckpt.load_checkpoint(init.checkpoint, settings=settings, weights=not resuming)
        outputs = self.cfg.model.masked_patch_outputs
        if outputs is not None:  # masked patch prediction from these weights: no classifier to adapt
            model.start_masked_patch(outputs, self.info.num_classes, keep_predictor=not init.reset_head)
        elif init.reset_head or model.num_classes != self.info.num_classes:
            model.reset_head(self.info.num_classes)
        model.set_img_size(self.cfg.model.img_size)
        return model

    def _step_metrics(self, window: _Window, grad_norm: torch.Tensor | float) -> dict[str, Any]:
        values = [float(window.skipped), *window.read()]
        skipped, loss_sum, finite, *flags = _all_reduce(
            values, average=[False] * len(values), device=self.backend.device
        )
        loss = loss_sum / finite if finite else float("nan")  # over the finite losses of all ranks
        elapsed = time.perf_counter() - window.started
        images_per_s = window.steps * self.cfg.train.batch_size / elapsed
        tflops = self.flops_per_image * images_per_s / self.world / 1e12
        metrics = {
            "loss": loss,
            "lr": self.backend.lr(),
            "grad_norm": float(grad_norm),
            "images_per_s": images_per_s,
            "tflops_per_worker": tflops,
            "data_wait_fraction": window.data_wait / elapsed,
            "skipped_samples": int(skipped),
            # Steps with a non-finite loss or gradient so far in the run (DeepSpeed's dropped-step count
            # is checkpointed, so the count goes on across resumes).
            "nonfinite_steps": self.nonfinite.value + self._count_nonfinite(_nonfinite_steps(flags)),
            "epoch": self.loader.state_dict()["epoch"],
            **self.backend.metrics(),
        }
        if skipped:  # every rank takes this branch: `skipped` is the sum over the ranks
            # Which shards the skipped samples came from, over every rank: what `vitray runs` names.
            metrics["skipped_shards"] = union_of_names(list(self._skipped_shards))
            self._skipped_shards.clear()
        if self.peak_tflops:
            metrics["mfu"] = tflops / self.peak_tflops
        return metrics

    # -- non-finite losses and gradients (train.nonfinite) -----------------------------------------
    def _count_nonfinite(self, nonfinite_losses: int) -> int:
        """This window's steps with a non-finite loss or gradient: those DeepSpeed dropped, or those
        whose loss was not finite on some rank where nothing was dropped (bf16 without the check).
        fp16 counts its losses only: its dynamic loss scale is found by dropping the steps whose scaled
        gradients overflow (several in a run's first steps, and whenever the scale grows), which is
        no fault of the run; a real NaN or inf loss still counts, and a scale that can fall no further
        stops the run (the backend's FloatingPointError)."""
        if self.cfg.precision.dtype == "fp16":
            return int(nonfinite_losses)
        return max(self.backend.skipped_steps() - self._skipped_seen, int(nonfinite_losses))

    def _apply_nonfinite_policy(self, new: int, window_steps: int) -> None:
        if new and self.cfg.train.nonfinite == "stop":
            first = self.step - window_steps + 1
            causes = "optim.lr too high, a bad sample" + (
                ", fp16's range" if self.cfg.precision.dtype == "fp16" else ""
            )
            # (only an engine that drops a step is offered `skip`: the xla backend refuses it)
            skip = (
                " or set train.nonfinite=skip to drop such steps and go on" if self.cfg.engine.skips_nonfinite else ""
            )
            raise FloatingPointError(
                f"train.nonfinite=stop: {new} step(s) between {first} and {self.step} had a non-finite loss or "
                "gradient; stopping before any checkpoint of them is written (the latest complete checkpoint is "
                f"finite). Look for the cause ({causes}){skip}"
            )

    def _check_finite(self, window: _Window | None) -> None:
        """Before a checkpoint: under `stop`, the steps not yet checked (a checkpoint step that is
        not a log step); under any policy, the weights themselves (a collective; DeepSpeed only)."""
        if window is not None and self.cfg.train.nonfinite == "stop":
            flags = window.read()[2:]
            flags = _all_reduce(flags, average=[False] * len(flags), device=self.backend.device)
            self._apply_nonfinite_policy(self._count_nonfinite(_nonfinite_steps(flags)), window.steps)
        if self.cfg.engine.lazy_tensors:
            return  # the scan would be one more graph to compile; the losses' check stands for it
        module = self.backend.module
        local = [getattr(p, "ds_tensor", p) for p in module.parameters()]  # ZeRO-3: this rank's partition
        bad = float(torch.stack([t.isfinite().all().logical_not() for t in local if t.numel()]).any()) if local else 0.0
        (bad,) = _all_reduce([bad], average=[False], device=self.backend.device)
        if bad:
            raise FloatingPointError(
                f"the weights are not finite at step {self.step}: not writing a checkpoint of them (every "
                "checkpoint the run wrote is finite); see train.nonfinite"
            )

    def _forward(self) -> Forward:
        """How evaluators run the model: on the engine's device and dtype, summing over the ranks."""
        device = self.backend.device
        return Forward(
            device,
            self.backend.dtype,
            lambda values: _all_reduce(values, average=[False] * len(values), device=device),
            collective_forward=self.backend.collective_forward,
        )

    def _architecture(self) -> dict[str, Any]:
        """The model as built (fine-tuning changes the head and resolution of `init.checkpoint`'s)."""
        module = self.backend.module
        return {
            **self.cfg.model.model_dump(mode="json"),
            "name": module.name,
            # (None: the variant's own, as a config that does not set it says)
            "depth": module.depth if module.depth != module.variant.size.depth else None,
            "img_size": module.img_size,
            "head": module.head_type,
            "representation_size": module.representation_size,
        }

    def _maybe_inject_failure(self) -> None:
        at = self.cfg.debug.kill_worker_at_step
        if at != self.step or self.rank != self.world - 1:
            return
        if self.run_files.claim_once(f"killed-at-step-{at}"):
            os.kill(os.getpid(), signal.SIGKILL)


class RunCount:
    """A run-long count kept in the checkpoint's trainer state (None until set or restored; a
    checkpoint written before it was kept has none, and restores nothing)."""

    optional = True  # (Checkpointer.restore: absent from older checkpoints)

    def __init__(self) -> None:
        self.value: int | None = None

    def state_dict(self) -> int | None:
        return self.value

    def load_state_dict(self, value: int | None) -> None:
        self.value = value


class _Window:
    """Sums over the steps since the last log (`lazy`: the losses are lazy graphs, `Engine.lazy_tensors`)."""

    def __init__(self, lazy: bool):
        self.lazy = lazy
        self.started = time.perf_counter()
        self.steps = 0
        self.losses: list[torch.Tensor] = []  # on the device until the log step reads them
        self.data_wait = 0.0
        self.skipped = 0

    def add(self, loss: torch.Tensor, data_wait: float, skipped: int) -> None:
        self.steps += 1
        self.losses.append(loss)
        self.data_wait += data_wait
        self.skipped += skipped

    def read(self) -> list[float]:
        """[sum of the finite losses, how many, then per step 1.0 where the loss was not finite], in
        one read: the host waits for the device here, once per log. Each loss was computed within
        its own step (XLA: in the step's graph), so reading them adds no device work of its own."""
        if not self.losses:
            return [0.0, 0.0]
        if self.lazy:  # each one already computed: no new graph to compile
            losses = torch.tensor([float(loss) for loss in self.losses], dtype=torch.float64)
        else:  # one copy to the host
            losses = torch.stack(self.losses).double().cpu()
        finite = losses.isfinite()
        return [float(losses.where(finite, 0.0).sum()), float(finite.sum()), *(~finite).double().tolist()]


def _nonfinite_steps(flags: list[float]) -> int:
    """Steps whose loss was not finite on some rank, from per-step flags summed over the ranks."""
    return sum(1 for flag in flags if flag > 0)
