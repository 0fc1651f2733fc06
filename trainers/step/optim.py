"""Optimizers with the authors' weight-decay rule: decay matrices/kernels only, not biases, norms,
position embeddings or the class token."""

from __future__ import annotations

import torch
from torch import nn

_NO_DECAY_NAMES = ("pos_embed", "cls_token", "mask_token")  # mask_token: masked patch prediction


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


def build_optimizer(model: nn.Module, optim, *, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW for pre-training, SGD with momentum for fine-tuning (both from `OptimConfig`);
    `fused`: torch's single-kernel implementation (CUDA)."""
    groups = param_groups(model, optim.weight_decay)
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, fused=fused or None)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.b1, optim.b2), eps=optim.eps, fused=fused or None)
