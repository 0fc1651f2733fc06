"""Training-step throughput of vitray's ViT-S/16 against timm's ``vit_small_patch16_224``.

One step is forward, cross-entropy, backward and an AdamW update, on the same random batch,
with the same thread count and the same weights, in the same process. After warm-up the two
models take turns step by step (the order flips every pair), so each vitray step has a timm step
next to it in time and a busy neighbour on a shared machine slows both alike. images/s is the
batch over each model's median step time; the last line is the median of the per-pair speed
ratios vitray/timm (time of the timm step over time of the vitray step).

    python benchmarks/model_step.py --batch 32 --steps 12 [--threads N] [--clock wall|cpu] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import timm
import torch
import torch.nn.functional as F
from torch import nn

from vitray.models import create_model, load_timm_state_dict

NUM_CLASSES = 1000
IMG_SIZE = 224


def make_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    """A closure running one optimisation step of ``model`` on the fixed batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    return step


# "wall" is the honest measure on a quiet machine; "cpu" (this process's CPU time) is far less
# disturbed by other processes on a shared one, and equals wall time for --threads 1 when idle.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def time_steps(step: Callable[[], None], steps: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds taken by each of ``steps`` calls of ``step``, as measured by ``clock``."""
    durations = []
    for _ in range(steps):
        start = clock()
        step()
        durations.append(clock() - start)
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="images per step (default 32)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per model, taken in turns (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first (default 2)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="wall time or process CPU time")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    args = parser.parse_args()
    for option in ("batch", "steps", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be >= 1")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models: dict[str, nn.Module] = {
        "vitray S/16": create_model("S/16", num_classes=NUM_CLASSES, img_size=IMG_SIZE),
        "timm vit_small_patch16_224": timm.create_model(
            "vit_small_patch16_224", pretrained=False, num_classes=NUM_CLASSES
        ),
    }
    vitray_model, timm_model = models.values()
    params = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
    images = torch.randn(args.batch, 3, IMG_SIZE, IMG_SIZE)
    labels = torch.randint(0, NUM_CLASSES, (args.batch,))
    # Fairness check: with timm's weights (a random non-zero head included) both models must
    # compute the same function, so they also train identically.
    with torch.no_grad():
        nn.init.normal_(timm_model.head.weight, std=0.02)
        load_timm_state_dict(vitray_model, timm_model.state_dict())
        vitray_model.eval(), timm_model.eval()
        difference = (vitray_model(images[:2]) - timm_model(images[:2])).abs().max().item()
    if difference > 1e-4:
        raise SystemExit(f"the two models compute different logits (max difference {difference:.2e})")
    steps = {}
    for name, model in models.items():
        model.train()
        runnable = torch.compile(model) if args.compile else model
        steps[name] = make_step(runnable, images, labels)
        time_steps(steps[name], args.warmup)

    print(
        f"training step (fwd+bwd+AdamW), batch {args.batch}, {IMG_SIZE}px, {args.threads} threads, "
        f"{'compiled' if args.compile else 'eager'}, {args.clock} clock, {params['vitray S/16']:,} params each, "
        f"same weights (max logit difference {difference:.1e})"
    )
    names = list(models)
    durations: dict[str, list[float]] = {name: [] for name in names}
    ratios = []
    for pair in range(args.steps):
        order = names if pair % 2 == 0 else names[::-1]
        for name in order:
            durations[name] += time_steps(steps[name], 1, CLOCKS[args.clock])
        ratios.append(durations[names[1]][-1] / durations[names[0]][-1])
        print(
            f"  pair {pair + 1:2d}: "
            + ", ".join(f"{n} {args.batch / durations[n][-1]:6.2f} img/s" for n in names)
            + f", ratio {ratios[-1]:.3f}"
        )
    for name in names:
        print(f"{name}: {args.batch / statistics.median(durations[name]):.2f} img/s (median of {args.steps} steps)")
    print(f"vitray/timm: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
