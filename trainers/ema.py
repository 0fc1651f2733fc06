"""Polyak / exponential moving average of the weights, kept in fp32 on the side."""

from __future__ import annotations

import torch
from torch import nn


class Ema:
    def __init__(self, module: nn.Module, decay: float):
        self.decay = decay
        self.shadow = {k: v.detach().float().clone() for k, v in module.state_dict().items()}

    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        for key, value in module.state_dict().items():
            shadow = self.shadow[key]
            if value.is_floating_point():
                shadow.lerp_(value.detach().float(), 1.0 - self.decay)
            else:
                shadow.copy_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.contiguous() for k, v in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) ^ set(state)
        if missing:
            raise KeyError(f"EMA state does not match the model: {sorted(missing)[:5]}")
        for key, value in state.items():
            self.shadow[key].copy_(value)
