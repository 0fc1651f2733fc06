"""Which fused attention kernel the training step runs (`train.attention`), and a check of it.

`models/vit.py` calls PyTorch's `scaled_dot_product_attention`, which picks a kernel per call
among flash attention, cuDNN attention, memory-efficient attention and the unfused "math" path,
by dtype, head size, dropout and device. A silent fall-back to the math path materialises every
(N x N) attention matrix: on an H100 a ViT-B/16 step is then markedly slower and uses more memory,
and nothing says so. So the loop runs its steps under an explicit choice, and before training
runs one attention call with the model's own shapes, dtype, device and dropout under a
dispatch-mode recorder to name the kernel that really ran (printed at start and stored in the
checkpoints' `trainer_state.json` as `attention_kernel`).

- ``auto``: on CUDA, flash attention first, then cuDNN, memory-efficient, math (in that
  priority); elsewhere PyTorch's own choice (the CPU has a flash kernel of its own).
- ``flash`` / ``cudnn`` / ``efficient`` / ``math``: that kernel only; a setting the device
  cannot run is refused at start, naming what it can.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

ATTENTION_SETTINGS = ("auto", "flash", "cudnn", "efficient", "math")

_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
_CUDA_PRIORITY = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]

# The aten op each fused kernel dispatches to; the math path has none (it decomposes into
# matmuls and a softmax before reaching a dispatch mode).
_KERNEL_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_fused_attention_overrideable": "fused (device plug-in)",
}


def attention_context(setting: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context the training step runs in for `train.attention` = `setting`."""
    if setting not in ATTENTION_SETTINGS:
        raise ValueError(f"train.attention={setting!r}: expected one of {', '.join(ATTENTION_SETTINGS)}")
    if setting == "auto":
        if device.type != "cuda":
            return contextlib.nullcontext
        return lambda: sdpa_kernel(_CUDA_PRIORITY, set_priority=True)
    return lambda: sdpa_kernel([_BACKENDS[setting]])


class _KernelRecorder(TorchDispatchMode):
    """Records the fused attention kernels dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _KERNEL_OPS:
            self.kernels.append(_KERNEL_OPS[name])
        return func(*args, **(kwargs or {}))


def attention_kernel(
    setting: str,
    *,
    tokens: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    dropout_p: float = 0.0,
) -> str:
    """The kernel one training attention call of these shapes runs under `setting`: 'flash',
    'cudnn', 'efficient' or 'math'. Raises ValueError when `setting` names a kernel that cannot
    run these shapes here, listing the settings that can."""
    context = attention_context(setting, device)
    query = torch.randn(1, heads, tokens, head_dim, dtype=dtype, device=device, requires_grad=True)
    recorder = _KernelRecorder()
    try:
        with context(), recorder:
            F.scaled_dot_product_attention(query, query, query, dropout_p=dropout_p)
    except RuntimeError as err:
        usable = [name for name in _BACKENDS if name != setting and _runs(name, query.detach(), dropout_p)]
        raise ValueError(
            f"train.attention={setting!r}: no {setting} attention kernel for {tokens} tokens x {heads} heads x "
            f"{head_dim} in {str(dtype).removeprefix('torch.')} on {device.type} (dropout {dropout_p}); this device "
            f"runs: auto, {', '.join(usable)} ({str(err).splitlines()[0]})"
        ) from None
    return recorder.kernels[0] if recorder.kernels else "math"


def _runs(setting: str, query: torch.Tensor, dropout_p: float) -> bool:
    try:
        with attention_context(setting, query.device)():
            F.scaled_dot_product_attention(query, query, query, dropout_p=dropout_p)
    except RuntimeError:
        return False
    return True


def model_attention_shape(module: torch.nn.Module) -> tuple[int, int, int, float] | None:
    """(tokens, heads, head_dim, attention dropout) of the model's self-attention layers, or None
    for a model without any (the ResNet baseline)."""
    from vitray.models.vit import SelfAttention

    layer = next((m for m in module.modules() if isinstance(m, SelfAttention)), None)
    if layer is None:
        return None
    tokens = module.num_prefix_tokens + module.grid_size**2  # not pos_embed's shape: empty under ZeRO-3
    return tokens, layer.num_heads, layer.head_dim, layer.attn_dropout
