"""Learning-rate schedule: linear warm-up, then linear or cosine decay (the paper's recipe)."""

from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, decay: str, min_ratio: float = 0.0) -> float:
    """Factor applied to the base learning rate at optimizer step `step` (0-based).

    Warm-up ramps linearly from 1/warmup at the first step to 1 at step `warmup_steps - 1`: one
    step ahead of the authors' (vit_jax and big_vision multiply by `step / warmup_steps` on optax's
    0-based update count, so their first update has a rate of 0). A first rate of exactly 0 would
    cost the XLA backend a compilation of the whole step of its own (torch-xla makes the scalars 0
    and 1 constants of the graph, any other value an input), for a step that changes nothing.
    Decay goes from 1 to `min_ratio` at `total_steps`. Warm-up longer than the run is clipped to
    the run.
    """
    warmup_steps = min(warmup_steps, total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"decay={decay!r}: expected 'linear' or 'cosine'")
    return min_ratio + (1.0 - min_ratio) * shape


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule (`cfg`: the training config) on `optimizer`, stepped once per optimizer step."""
    schedule = cfg.schedule
    # A plain function (not a callable object), so the schedule's state_dict holds no lambda state.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step,
            total_steps=cfg.train.steps,
            warmup_steps=schedule.warmup_steps,
            decay=schedule.decay,
            min_ratio=schedule.min_lr / cfg.optim.lr,
        ),
    )
