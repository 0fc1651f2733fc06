"""The consolidated fp32 weights of a checkpoint that was written without them
(`checkpoint.model_weights`), derived on demand from its DeepSpeed ZeRO 1-2 shards: the
optimizer's fp32 master copy, partitioned flat across the ranks, is the model.

Read without DeepSpeed (only `trainers` imports it) and without running a checkpoint's code: the
files are opened with `torch.load(weights_only=True)`, with DeepSpeed's few plain-data classes
(loss scaler, ZeRO stage, fragment address) stood in for by name. The layout is DeepSpeed's own
(`deepspeed/utils/zero_to_fp32.py`, `_zero2_merge_trainable_params`): each parameter group's
partitions joined in rank order hold the group's parameters one after the other, in the order
the module states' `param_shapes` list them, each followed by its alignment padding.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

SHARDS = "deepspeed/state"
MODULE_STATES = f"{SHARDS}/mp_rank_00_model_states.pt"

# DeepSpeed's classes pickled into its optimizer states: plain data, stood in for by name.
_DEEPSPEED_DATA_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class _StandIn:
    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


def _stand_ins() -> list[tuple[type, str]]:
    return [(type(name.rsplit(".", 1)[-1], (_StandIn,), {}), name) for name in _DEEPSPEED_DATA_CLASSES]


def _load(fs, path: str) -> dict[str, Any]:
    with fs.open(path, "rb") as f, torch.serialization.safe_globals(_stand_ins()):
        return torch.load(f, map_location="cpu", weights_only=True)


def derivable(state: dict[str, Any], names: set[str]) -> bool:
    """Whether `derive` can make the weights of a checkpoint with this trainer state and files."""
    config = state.get("config") or {}
    stage = (config.get("train") or {}).get("zero_stage")
    # DeepSpeed's layout (its module states file), at a stage whose optimizer shards hold the whole
    # fp32 master copy in flat partitions.
    return stage in (1, 2) and MODULE_STATES in names


def derive(folder: str, fs, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The module's fp32 weights (and buffers) of the ZeRO 1-2 checkpoint `folder` on `fs`."""
    world = int(state["world_size"])
    module_states = _load(fs, f"{folder}/{MODULE_STATES}")
    shards = fs.ls(f"{folder}/{SHARDS}", detail=False)
    optim = []
    for rank in range(world):  # zero_pp_rank_R_... (bf16: bf16_zero_pp_rank_R_...)
        [path] = [p for p in shards if re.search(rf"(^|[_/])zero_pp_rank_{rank}_mp_rank_00_optim_states\.pt$", p)]
        optim.append(_load(fs, path)["optimizer_state_dict"])
    buffers = set(module_states.get("buffer_names") or [])
    out = {name: t.float() for name, t in module_states["module"].items() if name in buffers}
    paddings = optim[0].get("param_alignment_paddings")
    for group, shapes in enumerate(module_states["param_shapes"]):
        flat = torch.cat([o["single_partition_of_fp32_groups"][group] for o in optim])
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            out[name] = flat.narrow(0, offset, numel).view(tuple(shape)).clone()
            offset += numel + (paddings[group][index] if paddings is not None else 0)
        if offset > flat.numel():
            raise ValueError(
                f"checkpoint {folder}: its shards hold {flat.numel()} values of group {group}, not {offset}"
            )
    return out
