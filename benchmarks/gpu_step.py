"""Training throughput of `vitray pretrain`'s step against a plain PyTorch AMP loop, on one device.

vitray: `TrainingLoop.train_step` -- the step `vitray pretrain` runs -- on the DeepSpeed backend
(ZeRO-1, bf16, `train.compile` as configured) fed by `trainers/step/feed.py`'s DeviceFeed with
synthetic uint8 batches (pinned and copied ahead on the feed's own thread on CUDA, converted on
the device). Reading and decoding shards is left out; `benchmarks/data_pipeline.py` measures it.

Reference: timm's ViT of the same shape in a plain loop -- bf16 autocast, fused AdamW on CUDA,
cross-entropy, a float batch already on the device (no input cost at all), torch.compile when
vitray compiles.

Both run in this process on the same batch size, one after the other, with the host reading the
loss only at the end of each timed window (as vitray's loop does on log steps). Prints images/s
of both, the ratio vitray/reference, and MFU (model FLOPs without recompute / the device's bf16
peak, see `trainers/metrics.py`; none on the CPU or an unknown GPU unless --peak-tflops).

    python benchmarks/gpu_step.py                          # B/16, 224 px, batch 64 (a GPU)
    python benchmarks/gpu_step.py --model L/16 --grad-checkpointing --batch 64
    python benchmarks/gpu_step.py --model Ti/16 --img-size 32 --batch 8 --steps 3 --warmup 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from dataclasses import dataclass, field

import timm
import torch
import torch.nn.functional as F

from vitray.common.config import load_config
from vitray.data.batch import Batch
from vitray.models import create_model_from_config
from vitray.trainers.config import TrainingConfig
from vitray.trainers.engines.deepspeed.backend import compile_enabled
from vitray.trainers.engines.registry import create_backend
from vitray.trainers.loop import TrainingLoop
from vitray.trainers.metrics import accelerator_peak_tflops, train_flops_per_image
from vitray.trainers.step.feed import DeviceFeed
from vitray.trainers.step.objectives import build_objective

TIMM_NAMES = {
    "Ti/16": "vit_tiny_patch16_224",
    "S/16": "vit_small_patch16_224",
    "B/16": "vit_base_patch16_224",
    "L/16": "vit_large_patch16_224",
    "H/14": "vit_huge_patch14_224",
}
NUM_CLASSES = 1000


class EndlessLoader:
    """What an endless synthetic loader shares with a ShardLoader (float_images=False): its position
    as state, and batches of uint8 images with a key per sample."""

    step = 0

    def state_dict(self):
        return {"epoch": 0, "step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]

    def batch(self, images: torch.Tensor, labels: torch.Tensor) -> Batch:
        keys = [f"{self.step}-{i}" for i in range(len(labels))]
        return Batch(images=images, labels=labels, keys=keys, num_skipped=0, epoch=0, step=self.step)


@dataclass
class SyntheticLoader(EndlessLoader):
    """Endless uint8 batches of random pixels and labels."""

    batch_size: int
    img_size: int
    step: int = 0
    _images: torch.Tensor = field(init=False)

    def __post_init__(self):
        generator = torch.Generator().manual_seed(0)
        shape = (self.batch_size, 3, self.img_size, self.img_size)
        self._images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)

    def __iter__(self):
        while True:
            self.step += 1
            labels = torch.randint(0, NUM_CLASSES, (self.batch_size,))
            # A fresh host tensor per batch, as the loader hands out (the copy is part of the cost).
            yield self.batch(self._images.clone(), labels)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(step, count: int, name: str = "vitray") -> None:
    """Prints what ``count`` steps of ``name``'s loop cost: the ops and CUDA runtime calls by self CPU
    time, how often the host waits for the device (a non-log step should not), and on a GPU the
    device time per step and the kernels that take it (to set the two loops' kernels side by side)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    stacks = torch._C._profiler._ExperimentalConfig(verbose=True)  # without it events carry no Python stack
    with torch.profiler.profile(activities=activities, with_stack=True, experimental_config=stacks) as prof:
        for _ in range(count):
            step()
    events = prof.key_averages()
    print(f"profile of {count} {name} steps (no log step), top 20 by self CPU time:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    if torch.cuda.is_available():
        device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
        print(f"{name}: {device_us / count / 1e3:.1f} ms of device time per step; kernels by device time:")
        print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=90))
    waits = {
        e.key: e.count for e in events if "Synchronize" in e.key or e.key in ("cudaMemcpy", "aten::_local_scalar_dense")
    }
    print(f"{name}: host waits per step: { {k: round(v / count, 2) for k, v in waits.items()} }")
    callers: dict[tuple[str, tuple[str, ...]], int] = {}
    for event in prof.events():  # each wait, with the Python frames of the nearest op that has them
        if "Synchronize" in event.name or event.name == "aten::_local_scalar_dense":
            parent = event
            while parent is not None and not parent.stack:
                parent = parent.cpu_parent
            frames = tuple(f for f in (parent.stack if parent else []) if "torch/" not in f and "<built-in" not in f)[
                :6
            ]
            callers[(event.name, frames)] = callers.get((event.name, frames), 0) + 1
    for (name, frames), n in sorted(callers.items(), key=lambda item: -item[1]):
        print(f"{name} x{n / count:.2f} per step (thread of the caller below):")
        print("    " + "\n    ".join(frames or ("(no Python caller found)",)))


def build_step_loop(cfg: TrainingConfig, loader, compile_mode: str = "default") -> TrainingLoop:
    """A TrainingLoop with `vitray pretrain`'s model, backend and objective, fed by `loader` (uint8
    batches, as a ShardLoader's) on its device feed: the loop's step without a dataset on storage."""
    torch.manual_seed(cfg.seed)
    model = create_model_from_config(cfg.model, NUM_CLASSES)
    if compile_mode != "default" and compile_enabled(cfg.train.compile):
        # What build_engine does (in place, before DeepSpeed wraps the model), in another mode;
        # train.compile is then off so that the engine does not compile it again.
        model.compile(mode=compile_mode)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})})
    loop = TrainingLoop.__new__(TrainingLoop)
    loop.cfg, loop.rank, loop.world, loop.accum, loop.step = cfg, 0, 1, cfg.grad_accumulation, 0
    loop.keys, loop.ema, loop._skipped_shards = None, None, set()
    loop.backend = create_backend(cfg, model, 1, None)
    loop.objective = build_objective(cfg.train, "single", NUM_CLASSES)
    loop.loader = DeviceFeed(loader, loop.backend.device)
    return loop


def vitray_steps(
    cfg: TrainingConfig, warmup: int, steps: int, profile: int = 0, compile_mode: str = "default"
) -> tuple[float, float, float]:
    """(images/s, train FLOPs per image, last loss) of TrainingLoop.train_step on the DeepSpeed backend."""
    loop = build_step_loop(cfg, SyntheticLoader(cfg.train.micro_batch_size, cfg.model.img_size), compile_mode)
    batches = iter(loop.loader)
    device = loop.backend.device

    last_loss = float("nan")

    def run(count: int) -> float:
        nonlocal last_loss
        start = time.perf_counter()
        for _ in range(count):
            loss, grad_norm, _, _ = loop.train_step(batches)
            loop.step += 1
        last_loss, _ = float(loss), float(grad_norm)  # the log step's reads: wait for the device
        _sync(device)
        return time.perf_counter() - start

    run(warmup)
    seconds = run(steps)
    if profile:
        profile_steps(lambda: loop.train_step(batches), profile, f"vitray {cfg.precision.dtype}")
        _sync(device)
    batches.close()  # the feed's thread (on CUDA) stops before the reference loop runs
    flops = train_flops_per_image(
        lambda: create_model_from_config(cfg.model.model_copy(update={"grad_checkpointing": False}), NUM_CLASSES),
        cfg.model.img_size,
    )
    return steps * cfg.train.batch_size / seconds, flops, last_loss


def reference_steps(
    cfg: TrainingConfig, warmup: int, steps: int, compiled: bool, profile: int = 0, compile_mode: str = "default"
) -> tuple[float, float]:
    """(images/s, last loss) of a plain AMP loop over timm's ViT of the same shape."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    model = timm.create_model(
        TIMM_NAMES[cfg.model.name], pretrained=False, num_classes=NUM_CLASSES, img_size=cfg.model.img_size
    ).to(device)
    model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda" or None)
    runnable = torch.compile(model, mode=compile_mode) if compiled else model
    batch = cfg.train.micro_batch_size
    images = torch.rand(batch, 3, cfg.model.img_size, cfg.model.img_size, device=device) * 2 - 1
    labels = torch.randint(0, NUM_CLASSES, (batch,), device=device)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(runnable(images).float(), labels)
        loss.backward()
        optimizer.step()
        return loss

    last_loss = float("nan")

    def run(count: int) -> float:
        nonlocal last_loss
        start = time.perf_counter()
        for _ in range(count):
            loss = step()
        last_loss = float(loss.detach())
        _sync(device)
        return time.perf_counter() - start

    run(warmup)
    rate = steps * batch / run(steps)
    if profile:
        profile_steps(step, profile, "plain loop")
        _sync(device)
    return rate, last_loss


def step_config(model: str, img_size: int, batch: int, *settings: str) -> TrainingConfig:
    """The config of one worker's steps on synthetic batches of `batch` images (no accumulation,
    ZeRO-1), with `settings` ("key=value") on top."""
    common = [
        "data.train=synthetic",
        "data.num_slots=1",
        f"model.name={model}",
        f"model.img_size={img_size}",
        f"train.batch_size={batch}",
        f"train.micro_batch_size={batch}",
        "train.zero_stage=1",
        "cluster.num_workers=1",
    ]
    return load_config(TrainingConfig, None, [*common, *settings])


def _process_group() -> None:
    """One rank, as Ray Train would set it up for DeepSpeed to join."""
    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> dict[str, float | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(TIMM_NAMES), default="B/16")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64, help="images per step (one device, no accumulation)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per loop (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first, compilation included (default 5)")
    parser.add_argument("--grad-checkpointing", action="store_true", help="activation checkpointing in both models")
    parser.add_argument(
        "--remat-policy",
        choices=["nothing_saveable", "dots_saveable"],
        default="nothing_saveable",
        help="vitray's model.remat_policy with --grad-checkpointing (the plain loop recomputes whole blocks, "
        "as nothing_saveable does)",
    )
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="auto: on for CUDA")
    parser.add_argument(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
        default="default",
        help="torch.compile's mode for both loops when compiled (reduce-overhead: CUDA graphs; an experiment: "
        "vitray's train.compile uses the default mode)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="then profile this many steps of each loop (torch.profiler)"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 peak, if not in the table")
    parser.add_argument(
        "--dtypes",
        default="bf16",
        help="vitray's precision.dtype, one loop each, comma-separated: bf16, fp8 (the plain loop is always bf16 "
        "AMP); default bf16",
    )
    parser.add_argument(
        "--fp8-layers",
        choices=["auto", "all"],
        default="auto",
        help="precision.fp8_layers of the fp8 loop (auto: the layers where float8 is the faster on an H100)",
    )
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if not dtypes or any(d not in ("bf16", "fp8") for d in dtypes):
        parser.error(f"--dtypes {args.dtypes!r}: a comma-separated list of bf16 and fp8")
    for option in ("batch", "steps", "img_size"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1")
    compile_setting = {"auto": "null", "on": "true", "off": "false"}[args.compile]
    cfg = step_config(
        args.model,
        args.img_size,
        args.batch,
        f"model.grad_checkpointing={str(args.grad_checkpointing).lower()}",
        f"model.remat_policy={args.remat_policy}",
        "precision.dtype=bf16",
        f"train.compile={compile_setting}",
        "schedule.warmup_steps=1",
        f"train.steps={args.warmup + args.steps + 1}",
    )
    compiled = compile_enabled(cfg.train.compile)
    _process_group()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    peak = accelerator_peak_tflops(args.peak_tflops, "bf16")
    vitray = {}  # dtype -> (images/s, last loss)
    for dtype in dtypes:
        precision = cfg.precision.model_copy(update={"dtype": dtype, "fp8_layers": args.fp8_layers})
        run_cfg = cfg.model_copy(update={"precision": precision})
        rate, flops, loss = vitray_steps(run_cfg, args.warmup, args.steps, args.profile, args.compile_mode)
        vitray[dtype] = (rate, loss)
        print(f"(vitray {dtype}: {rate:.1f} img/s, last loss {loss:.4f})", flush=True)  # before a later loop's limit
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    ours, our_loss = vitray[dtypes[0]]
    theirs, their_loss = reference_steps(cfg, args.warmup, args.steps, compiled, args.profile, args.compile_mode)
    mfu = {name: (rate * flops / 1e12 / peak if peak else None) for name, (rate, _) in vitray.items()}
    mfu["reference"] = theirs * flops / 1e12 / peak if peak else None
    print(
        f"{args.model} at {args.img_size} px, batch {args.batch}, plain loop bf16, vitray {'+'.join(dtypes)}, {device}, "
        f"{f'compiled ({args.compile_mode})' if compiled else 'eager'}{', activation checkpointing' if args.grad_checkpointing else ''}"
        f"{f' (vitray: {args.remat_policy})' if args.grad_checkpointing else ''}, "
        f"{args.steps} timed steps after {args.warmup}; {flops / 1e9:.2f} GFLOPs per training image"
    )
    rows = [(f"vitray pretrain step {dtype} (DeepSpeed ZeRO-1, DeviceFeed)", dtype, *vitray[dtype]) for dtype in dtypes]
    rows.append((f"plain AMP loop bf16 (timm {TIMM_NAMES[args.model]})", "reference", theirs, their_loss))
    for name, key, rate, loss in rows:
        # MFU against the bf16 peak for every row (fp8 included), so that the rows compare.
        shown = f", MFU {mfu[key]:.1%}" if mfu[key] is not None else ", MFU n/a (no known peak)"
        # The last loss: a mode that trained wrongly (CUDA graph buffers overwritten) shows here
        # against the same loop in the default mode.
        print(f"{name}: {rate:.1f} img/s{shown}, last loss {loss:.4f}")
    for dtype in dtypes:
        print(f"vitray {dtype}/reference: {vitray[dtype][0] / theirs:.3f}")
    if len(dtypes) > 1:
        print(f"vitray {dtypes[1]}/vitray {dtypes[0]}: {vitray[dtypes[1]][0] / ours:.3f}")
    return {
        **{f"vitray_{dtype}_images_per_s": rate for dtype, (rate, _) in vitray.items()},
        "vitray_images_per_s": ours,
        "reference_images_per_s": theirs,
        "ratio": ours / theirs,
        "mfu": mfu[dtypes[0]],
        "flops_per_image": flops,
        "vitray_last_loss": our_loss,
        "reference_last_loss": their_loss,
    }


if __name__ == "__main__":
    main()
