"""What each `model.remat_policy` costs and saves: a training step's time (and on a GPU its peak memory)
with activation checkpointing's two policies, against whole-block recompute (`nothing_saveable`, the
reference, as timm's and big_vision's default) and against no checkpointing, in alternating rounds in
one process.

    python benchmarks/remat.py                                        # Ti/16 at 224 px, batch 32, CPU fp32
    python benchmarks/remat.py --model H/14 --batch 64 --compile      # on a GPU: bf16 autocast, compiled

A step is forward, cross-entropy and backward (no optimizer: it is the same for every policy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from vitray.models import create_model

SETTINGS = {  # name -> (grad_checkpointing, remat_policy)
    "nothing_saveable": (True, "nothing_saveable"),
    "dots_saveable": (True, "dots_saveable"),
    "no checkpointing": (False, "nothing_saveable"),
}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Ti/16")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (a GPU's setting)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=1000, img_size=args.img_size).to(device).train()
    runnable = torch.compile(model) if args.compile else model
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device)
    labels = torch.randint(0, 1000, (args.batch,), device=device)

    def step() -> None:
        with autocast:
            loss = F.cross_entropy(runnable(images).float(), labels)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    peaks: dict[str, int] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up (and compiles) each setting
        for name, (enabled, policy) in SETTINGS.items():
            model.set_grad_checkpointing(enabled, remat_policy=policy)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            if round_:
                times[name].append((time.perf_counter() - start) / args.steps)
                if device.type == "cuda":
                    peaks[name] = torch.cuda.max_memory_allocated()
    reference = statistics.median(times["nothing_saveable"])
    print(
        f"{args.model} at {args.img_size} px, batch {args.batch}, {device.type}, forward + backward, "
        f"{'compiled, ' if args.compile else ''}median of {args.rounds} rounds of {args.steps} steps"
    )
    result = {}
    for name in SETTINGS:
        seconds = statistics.median(times[name])
        result[name] = seconds
        memory = f", peak {peaks[name] / 2**30:.2f} GiB" if name in peaks else ""
        print(f"{name}: {seconds * 1e3:.1f} ms a step{memory}, {reference / seconds:.3f}x nothing_saveable's speed")
    return result


if __name__ == "__main__":
    main()
