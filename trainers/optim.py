"""AdamW with the authors' weight-decay rule: decay matrices/kernels only, not biases, norms,
position embeddings or the class token."""

from __future__ import annotations

import torch
from torch import nn

_NO_DECAY_NAMES = ("pos_embed", "cls_token")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.rsplit(".", 1)[-1] in _NO_DECAY_NAMES:
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(model: nn.Module, *, lr: float, weight_decay: float, b1: float, b2: float, eps: float):
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(b1, b2), eps=eps)
