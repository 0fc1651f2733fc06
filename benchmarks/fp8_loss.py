"""Does precision.dtype=fp8 train as bf16 does? The same run twice -- same seed, same model init, the
same batches in the same order -- once in bf16 and once in fp8, then their losses side by side.

The run is `vitray pretrain`'s step (benchmarks/gpu_step.py's loop: DeepSpeed ZeRO-1, the device
feed, compiled on CUDA) on a learnable task made here, with no download: C classes, each a random
low-resolution prototype image; every sample is its class's prototype under fresh Gaussian noise
(strong enough that the task is not solved in a few hundred steps, so the loss at the end is far
from zero and a 1% difference means something), scaled up to the model's resolution. The data is
endless (no sample repeats), so the loss measures learning, not memorisation.

Prints the mean loss of a few windows of steps for both and the end's relative difference (the
mean over the last 50 steps): the issue's bar is 1%.

    python3 benchmarks/fp8_loss.py                                  # B/16, 224 px, 500 steps (a GPU)
    python3 benchmarks/fp8_loss.py --model Ti/16 --img-size 32 --batch 16 --steps 40 --fp8-layers all   # CPU (emulated)
"""

from __future__ import annotations

import argparse
import time

import torch
from gpu_step import NUM_CLASSES, TIMM_NAMES, EndlessLoader, _process_group, build_step_loop, step_config

from vitray.trainers.config import TrainingConfig


class NoisyPrototypes(EndlessLoader):
    """Endless uint8 batches: label y's image is prototype y (a fixed random `base` x `base` image)
        plus fresh noise of `noise` times its standard deviation (the best possible classifier still errs:
    classes ~3 noise deviations apart at the default), each pixel repeated to `img_size` (nearest). Seeded: the same batches each run."""

    def __init__(self, batch_size: int, img_size: int, classes: int, base: int = 16, noise: float = 6.0, seed: int = 0):
        if img_size % base:
            raise ValueError(f"--img-size {img_size} must be a multiple of the prototypes' {base} px")
        self.batch_size, self.scale, self.noise = batch_size, img_size // base, noise
        self.classes, self.step = classes, 0
        self.generator = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn(classes, 3, base, base, generator=self.generator)

    def __iter__(self):
        while True:
            self.step += 1
            labels = torch.randint(0, self.classes, (self.batch_size,), generator=self.generator)
            noise = torch.randn(self.batch_size, *self.prototypes.shape[1:], generator=self.generator)
            # Unit variance before scaling to pixels (clipped beyond 3.2 standard deviations).
            signal = (self.prototypes[labels] + self.noise * noise) / (1 + self.noise**2) ** 0.5
            small = (128 + 40 * signal).clamp(0, 255).to(torch.uint8)
            images = small.repeat_interleave(self.scale, dim=2).repeat_interleave(self.scale, dim=3)
            yield self.batch(images, labels)


def train(cfg: TrainingConfig, loader: NoisyPrototypes) -> tuple[list[float], float]:
    """(the loss of every step, seconds) of `cfg.train.steps` steps."""
    loop = build_step_loop(cfg, loader)
    batches = iter(loop.loader)
    losses = []
    start = time.perf_counter()
    for _ in range(cfg.train.steps):
        loss, _, _, _ = loop.train_step(batches)
        loop.step += 1
        losses.append(loss.detach())  # on the device: no wait for the step
    values = torch.stack(losses).float().cpu().tolist()
    seconds = time.perf_counter() - start
    batches.close()
    return values, seconds


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(TIMM_NAMES), default="B/16")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--classes", type=int, default=100, help="classes of the task (<= 1000)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--window", type=int, default=50, help="steps averaged for the end's loss (default 50)")
    parser.add_argument("--fp8-layers", choices=["auto", "all"], default="auto", help="precision.fp8_layers")
    args = parser.parse_args(argv)
    if not 1 < args.classes <= NUM_CLASSES or args.steps < args.window:
        parser.error(f"--classes in 2..{NUM_CLASSES} and --steps >= --window")
    _process_group()
    results = {}
    for dtype in ("bf16", "fp8"):
        cfg = step_config(
            args.model,
            args.img_size,
            args.batch,
            f"train.steps={args.steps}",
            f"precision.dtype={dtype}",
            f"precision.fp8_layers={args.fp8_layers}",
            f"optim.lr={args.lr}",
            f"schedule.warmup_steps={max(1, args.steps // 10)}",
            "schedule.decay=cosine",
        )
        loader = NoisyPrototypes(args.batch, args.img_size, args.classes, seed=cfg.seed)
        results[dtype] = train(cfg, loader)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (fp8 emulated)"
    print(
        f"{args.model} at {args.img_size} px, batch {args.batch}, {args.steps} steps, lr {args.lr} (warm-up "
        f"{max(1, args.steps // 10)}, cosine), {args.classes} noisy-prototype classes, {device}"
    )
    marks = sorted({args.window, args.steps // 4, args.steps // 2, args.steps})
    for dtype, (_, seconds) in results.items():
        print(f"{dtype}: {seconds:.1f} s for {args.steps} steps (the first steps compile)")
    print("steps    " + "  ".join(f"{'mean loss ' + dtype:>15}" for dtype in results))
    for mark in marks:
        window = slice(max(0, mark - args.window), mark)
        means = [sum(losses[window]) / len(losses[window]) for losses, _ in results.values()]
        print(f"{window.start:>4}-{mark:<4}" + "  ".join(f"{m:15.4f}" for m in means))
    end = {dtype: sum(losses[-args.window :]) / args.window for dtype, (losses, _) in results.items()}
    difference = (end["fp8"] - end["bf16"]) / end["bf16"]
    print(
        f"first loss {results['bf16'][0][0]:.4f}; end (last {args.window} steps): bf16 {end['bf16']:.4f}, "
        f"fp8 {end['fp8']:.4f}, fp8/bf16 - 1 = {difference:+.2%}"
    )
    return {
        "bf16_end_loss": end["bf16"],
        "fp8_end_loss": end["fp8"],
        "relative_difference": difference,
        "first_loss": results["bf16"][0][0],
    }


if __name__ == "__main__":
    main()
