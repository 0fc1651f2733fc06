"""Polyak / exponential moving average of the weights, kept in fp32 on the side.

The average is kept of the weights as this rank holds them (`backend.local_weights()`): whole
tensors, or under ZeRO-3 the rank's slice of each parameter, so the EMA is partitioned as the
weights are and its update needs no communication. Whole tensors are assembled only to write a
checkpoint (`state_dict`, collective); scoring the EMA weights swaps them in place
(`swapped_in`), slice by slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# Elements of bf16/fp16 weights cast to fp32 at once during an update: 256 MB of scratch at most.
CAST_CHUNK_ELEMENTS = 1 << 26


class Ema:
    def __init__(self, backend: Any, decay: float):
        self.backend, self.decay = backend, decay
        self.shadow = {k: v.detach().float().clone() for k, v in backend.local_weights().items()}

    @torch.no_grad()
    def update(self) -> None:
        """shadow <- lerp(shadow, weight, 1 - decay) for every float weight, in a few multi-tensor
        kernels (`torch._foreach_*`, as timm's ModelEmaV3) instead of two launches per tensor."""
        same_dtype, cast, other = [], [], []
        for key, value in self.backend.local_weights().items():
            pair = (self.shadow[key], value.detach())
            if not value.is_floating_point():
                other.append(pair)
            elif value.dtype == torch.float32:
                same_dtype.append(pair)
            else:
                cast.append(pair)
        weight = 1.0 - self.decay
        if same_dtype:
            torch._foreach_lerp_(*_unzip(same_dtype), weight)
        # lerp needs one dtype: bf16/fp16 weights go through fp32 buffers, a bounded chunk at a time
        # so that a large model never holds a second fp32 copy of all its weights.
        for chunk in _chunks(cast, CAST_CHUNK_ELEMENTS):
            shadows, values = _unzip(chunk)
            scratch = [torch.empty_like(shadow) for shadow in shadows]
            torch._foreach_copy_(scratch, values)
            torch._foreach_lerp_(shadows, scratch, weight)
        if other:
            torch._foreach_copy_(*_unzip(other))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole EMA weights on rank 0 (fp32, CPU). Collective: every rank calls it."""
        return self.backend.to_host(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """From the whole EMA weights (as `state_dict` gives them), on every rank."""
        mismatched = set(self.shadow) ^ set(state)
        if mismatched:
            raise KeyError(f"EMA state does not match the model: {sorted(mismatched)[:5]}")
        for key, value in self.backend.local_part(state).items():
            self.shadow[key].copy_(value)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module holds the EMA weights inside, its own ones again (bit for bit) on exit.
        Collective under ZeRO-3 (small parameters are kept whole and are gathered again)."""
        weights = self.backend.local_weights()
        saved = {key: value.detach().clone() for key, value in weights.items()}
        with torch.no_grad():
            for key, value in weights.items():
                value.copy_(self.shadow[key])
        self.backend.weights_changed()
        try:
            yield
        finally:
            with torch.no_grad():
                for key, value in weights.items():
                    value.copy_(saved[key])
            self.backend.weights_changed()


def _unzip(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [a for a, _ in pairs], [b for _, b in pairs]


def _chunks(pairs: list[tuple[torch.Tensor, torch.Tensor]], elements: int) -> Iterator[list]:
    """`pairs` cut into runs of at most `elements` elements (a larger tensor is a run of its own)."""
    chunk, size = [], 0
    for pair in pairs:
        if chunk and size + pair[0].numel() > elements:
            yield chunk
            chunk, size = [], 0
        chunk.append(pair)
        size += pair[0].numel()
    if chunk:
        yield chunk


class WholeWeights:
    """The weights side of a backend for a module held whole in one process (no ZeRO-3, no
    other ranks): an `Ema` of a bare module, outside a training loop, is `Ema(WholeWeights(m), d)`."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def local_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.module.state_dict(keep_vars=True))

    def local_part(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors

    def weights_changed(self) -> None:
        pass

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().cpu().clone() for k, v in tensors.items()}
