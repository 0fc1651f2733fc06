"""The consolidated fp32 weights of a checkpoint that was written without them
(`checkpoint.model_weights`), derived on demand from its DeepSpeed ZeRO 0-3 shards: the
optimizer's fp32 master copy (at ZeRO 1-3 partitioned flat across the ranks) is the model.

Read without DeepSpeed (only `trainers` imports it) and without running a checkpoint's code: the
files are opened with `torch.load(weights_only=True)`, with DeepSpeed's few plain-data classes
(loss scaler, ZeRO stage, fragment address) stood in for by name. The layouts are DeepSpeed's own
(`deepspeed/utils/zero_to_fp32.py`):

- ZeRO 1-2 (`_zero2_merge_trainable_params`): each parameter group's partitions joined in rank
  order hold the group's parameters one after the other, in the order the module states'
  `param_shapes` list them, each followed by its alignment padding.
- ZeRO-3 (`_zero3_merge_trainable_params`): every parameter is cut into one equal part a rank
  (the last padded); a rank's flat groups, joined, hold its part of each parameter in turn, and a
  parameter is its parts joined in rank order, the padding cut off.
- ZeRO-0, every rank holding everything, in the module states file alone: in fp32 the module's
  own weights; in bf16/fp16 the unfused wrapper's master copies (`optimizer.fp32_groups`, a tensor
  a parameter), named group by group in `param_shapes` (which vitray's checkpoint engine fills).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Where the DeepSpeed engine writes a checkpoint's shards (`save_checkpoint(<checkpoint>/deepspeed,
# tag="state")`): named here, below the engine, which reads it from here too.
DEEPSPEED_SUBDIR, DEEPSPEED_TAG = "deepspeed", "state"
SHARDS = f"{DEEPSPEED_SUBDIR}/{DEEPSPEED_TAG}"
MODULE_STATES = f"{SHARDS}/mp_rank_00_model_states.pt"
# ZeRO-3: each rank writes module states of its own (the parameters in them empty); rank 0's
# lists the shapes.
ZERO3_MODULE_STATES = f"{SHARDS}/zero_pp_rank_0_mp_rank_00_model_states.pt"

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


def _load(data: bytes) -> dict[str, Any]:
    import torch  # (here: `vitray runs`, which imports this module, needs no torch)

    buffer = io.BytesIO(data)
    with torch.serialization.safe_globals(_stand_ins()):
        return torch.load(buffer, map_location="cpu", weights_only=True)


def derivable(state: dict[str, Any], names: set[str]) -> bool:
    """Whether `derive` can make the weights of a checkpoint with this trainer state and files."""
    config = state.get("config") or {}
    stage = (config.get("train") or {}).get("zero_stage")
    # DeepSpeed's layout: its module states file (ZeRO-3: rank 0's), which names the parameters.
    return (stage in (0, 1, 2) and MODULE_STATES in names) or (stage == 3 and ZERO3_MODULE_STATES in names)


def derive(folder: str, fs, state: dict[str, Any], read: Callable[[str], bytes]) -> dict[str, torch.Tensor]:
    """The module's fp32 weights (and buffers) of the ZeRO 0-3 checkpoint `folder` on `fs`, whose
    files `read` gives whole (by their names in the folder; checked against their records)."""
    import torch

    world = int(state["world_size"])
    stage = state["config"]["train"]["zero_stage"]
    module_states = _load(read(ZERO3_MODULE_STATES if stage == 3 else MODULE_STATES))
    if stage == 0:
        return _zero0_weights(folder, module_states)
    shards = fs.ls(f"{folder}/{SHARDS}", detail=False)
    optim = []
    for rank in range(world):  # zero_pp_rank_R_... (bf16: bf16_zero_pp_rank_R_...)
        [path] = [p for p in shards if re.search(rf"(^|[_/])zero_pp_rank_{rank}_mp_rank_00_optim_states\.pt$", p)]
        optim.append(_load(read(f"{SHARDS}/{path.rsplit('/', 1)[-1]}"))["optimizer_state_dict"])
    # What the optimizer does not hold: buffers and, at ZeRO 1-2, frozen parameters (the module
    # states keep them; a ZeRO-3 checkpoint with frozen parameters carries model.safetensors).
    trained = {name for shapes in module_states["param_shapes"] for name in shapes}
    out = {name: t.float() for name, t in module_states["module"].items() if name not in trained}
    if stage == 3:
        return {**out, **_zero3_parameters(folder, module_states["param_shapes"], optim)}
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


def _zero3_parameters(folder: str, param_shapes: list[dict], optim: list[dict]) -> dict[str, torch.Tensor]:
    """Each parameter of a ZeRO-3 checkpoint: its part from every rank's flat groups, joined."""
    import torch

    ranks = [torch.cat(list(o["fp32_flat_groups"])) for o in optim]
    world, out, offset = len(ranks), {}, 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = -(-numel // world)  # every rank's part, the last one padded
            whole = torch.cat([flat.narrow(0, offset, part) for flat in ranks])
            out[name] = whole[:numel].view(tuple(shape)).clone()
            offset += part
    if offset != ranks[0].numel():
        raise ValueError(f"checkpoint {folder}: its ZeRO-3 shards hold {ranks[0].numel()} values a rank, not {offset}")
    return out


def _zero0_weights(folder: str, module_states: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A ZeRO-0 checkpoint's weights: the module's (fp32), with the master copies in place of the
    trained weights where the optimizer keeps them (bf16/fp16)."""
    out = {name: t.float() for name, t in module_states["module"].items()}
    masters = (module_states.get("optimizer") or {}).get("fp32_groups")
    if masters:
        names = [name for shapes in module_states.get("param_shapes") or () for name in shapes]
        if len(names) != sum(len(group) for group in masters):
            raise ValueError(f"checkpoint {folder}: its module states do not name its {len(masters)} master groups")
        out.update(zip(names, (t.float().clone() for group in masters for t in group)))
    return out
