"""Training-step throughput of vitray's ViT-S/16 against timm's ``vit_small_patch16_224``.

One step is forward, cross-entropy, backward and an AdamW update, on the same random batch,
with the same thread count and the same weights, in the same process. Both models warm up, then
run in alternating rounds (the order flips every round) so that drifts of the machine hit both
alike. Throughput is the batch over the *median* step time, which a busy neighbour on a shared
machine disturbs far less than the mean. Prints each round, the images/s of each model, and as
its last line the ratio vitray/timm.

    python benchmarks/model_step.py --batch 32 --steps 3 --rounds 6 [--threads N] [--compile]
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


def time_steps(step: Callable[[], None], steps: int) -> list[float]:
    """Seconds taken by each of ``steps`` calls of ``step``."""
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        durations.append(time.perf_counter() - start)
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="images per step (default 32)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model per round (default 3)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first (default 2)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    args = parser.parse_args()
    for option in ("batch", "steps", "rounds", "threads"):
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
        f"{'compiled' if args.compile else 'eager'}, {params['vitray S/16']:,} params each, "
        f"same weights (max logit difference {difference:.1e})"
    )
    durations: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            round_durations = time_steps(steps[name], args.steps)
            durations[name] += round_durations
            print(f"  round {round_index + 1}: {name:28s} {args.batch * args.steps / sum(round_durations):8.2f} img/s")
    throughput = {name: args.batch / statistics.median(durations[name]) for name in names}
    for name in names:
        print(f"{name}: {throughput[name]:.2f} img/s (median of {len(durations[name])} steps)")
    print(f"vitray/timm: {throughput[names[0]] / throughput[names[1]]:.3f}")


if __name__ == "__main__":
    main()
