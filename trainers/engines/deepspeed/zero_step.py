"""ZeRO 1-2's optimizer step (DeepSpeed's `DeepSpeedZeroOptimizer`) without host work per parameter.

On a GPU, every operator the host issues costs it a few microseconds of Python and a kernel launch
whether the kernel does much or nothing; a ViT has ~150 parameter tensors (S/16 to H/14 alike), and
DeepSpeed's ZeRO step issues several operators for each of them in every step. For a small model the
host then takes longer than the GPU's kernels (S/16 on an H100: ~41 ms a step against ~30 ms of
kernels, ~33 ms for the plain loop; see BENCHMARKS.md), and the GPU waits. :func:`streamline` swaps
four of the optimizer's methods, on the instance, for ones that do the same work in a few operators
whatever the number of parameters, with no read of a device value on the host:

- the grad norm: one multi-tensor norm (`torch._foreach_norm`) instead of a cast and a norm for each
  gradient, then a stack, a power and a sum;
- the gradient reduction of ZeRO-1 on one rank: nothing (an all-reduce over one rank and a division
  by one leave the gradients as they are) instead of filing each gradient into a bucket, flattening
  the bucket, "reducing" it and copying each gradient back;
- re-pointing each parameter at its slot in the flat bf16 buffer after the step: only when one no
  longer views it (the step writes the buffer in place, so none has moved unless something else
  re-pointed it), instead of four view operators for each parameter in every step;
- clipping: the scale computed on the device instead of a host check of the norm (an invalid norm
  clips as an infinite one would, as DeepSpeed's own does).

Each keeps DeepSpeed's own method for what it does not cover (model or pipeline parallelism, other
norms, a second rank). DeepSpeed's inf/NaN masking of the norm is swapped module-wide
(:func:`mask_nonfinite_norms_on_device`): it is a module function, not a method.
"""

from __future__ import annotations

import torch


def streamline(optimizer) -> None:
    """Swaps the methods above into a ZeRO 1-2 optimizer; anything else is left as it is."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    _clip_on_device(optimizer)
    _grad_norm_in_one_pass(optimizer)
    _no_reduction_on_one_rank(optimizer)
    _repoint_only_moved_parameters(optimizer)


def mask_nonfinite_on_device(input: torch.Tensor, device=None, val: float = -1.0) -> None:
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace`` without its two host round trips: it makes
    the fill value a new device tensor (a blocking host-to-device copy) and fills with that tensor
    (read back to the host), two device synchronisations per parameter group in every ZeRO step."""
    input.masked_fill_(~torch.isfinite(input), val)


def mask_nonfinite_norms_on_device() -> None:
    """Swaps :func:`mask_nonfinite_on_device` in where the ZeRO optimizers call DeepSpeed's."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    for module in (stage_1_and_2, stage3):
        module.mask_nan_or_inf_with_val_inplace = mask_nonfinite_on_device


def _clip_on_device(optimizer) -> None:
    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        if optimizer.clip_grad == 0.0 and optimizer.loss_scale == 1.0:
            return
        combined_scale = optimizer.loss_scale
        if optimizer.clip_grad > 0.0:
            # DeepSpeed's group-norm helpers report an inf/NaN norm as -1.
            invalid = total_norm.isnan() | total_norm.isinf() | (total_norm < 0)
            clip_norm = total_norm.masked_fill(invalid, float("inf"))
            clip = ((clip_norm / optimizer.loss_scale) + 1e-6) / optimizer.clip_grad  # the norm is norm * scale
            combined_scale = torch.clamp(clip, min=1.0) * optimizer.loss_scale
        for grad in grad_groups_flat:
            for g in grad if isinstance(grad, list) else [grad]:
                g.data.mul_(1.0 / combined_scale)

    optimizer.unscale_and_clip_grads = unscale_and_clip_grads


def _grad_norm_in_one_pass(optimizer) -> None:
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import stage_1_and_2
    from deepspeed.runtime.zero.utils import get_norm_dtype

    deepspeeds = optimizer.get_grad_norm_direct
    # Model parallelism and pipeline-replicated parameters (both fixed when the engine is built)
    # change which gradients count: DeepSpeed's own method then.
    if getattr(optimizer, "model_parallel_group", None) is not None or any(
        getattr(p, "ds_pipe_replicated", False) for group in optimizer.bit16_groups for p in group
    ):
        return

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return deepspeeds(gradients, params, norm_type)
        # As DeepSpeed's: padding left out, one gradient per parameter (zip), norms in its norm dtype
        # (float64 where the device has it), the total squared in float32.
        grads = [g for g, _ in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)]
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype())
            total = torch.stack(norms).square().sum().float()
        else:
            total = torch.zeros((), dtype=torch.float32, device=optimizer.device)
        if dist.get_world_size(group=optimizer.dp_process_group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        total = total.sqrt()
        stage_1_and_2.mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)
        return total

    optimizer.get_grad_norm_direct = get_grad_norm_direct


def _no_reduction_on_one_rank(optimizer) -> None:
    """ZeRO-1 on one rank, reducing after the backward pass (vitray's setting there, see
    `deepspeed_config`): DeepSpeed's `reduce_gradients` files every gradient into a bucket, flattens
    the bucket, all-reduces it over the one rank, divides it by one and copies each gradient back,
    then builds the partition's gradient list (its epilogue). Only the epilogue changes anything."""
    import deepspeed.comm as dist

    compact = getattr(optimizer, "_use_compact_grad_partition_buffer", lambda group_index: False)
    if (
        dist.get_world_size(group=optimizer.dp_process_group) != 1
        or getattr(optimizer, "sequence_parallel_size", 1) != 1
        or optimizer.partition_gradients  # ZeRO-2
        or optimizer.overlap_comm
        or optimizer.contiguous_gradients
        or optimizer.cpu_offload
        or getattr(optimizer, "zenflow", False)
        or any(compact(index) for index in range(len(optimizer.bit16_groups)))
    ):
        return

    def reduce_gradients(pipeline_parallel=False):
        optimizer.overlapping_partition_gradients_reduce_epilogue()

    optimizer.reduce_gradients = reduce_gradients


def _repoint_only_moved_parameters(optimizer) -> None:
    deepspeeds = optimizer._update_model_bit16_weights
    layouts: dict[tuple[int, int], list[tuple[torch.Tensor, int, torch.Size]]] = {}

    def slots(group_index: int) -> list[tuple[torch.Tensor, int, torch.Size]]:
        """(parameter, the address of its slot in the flat buffer, its shape), as DeepSpeed lays them
        out; kept per buffer address (a checkpoint load may replace the flat buffer itself)."""
        flat = optimizer.bit16_groups_flat[group_index]
        key = (group_index, flat.data_ptr())
        if key not in layouts:
            layouts[key] = [
                (param, flat.data_ptr() + offset * flat.element_size(), meta.shape)
                for param, meta, offset in zip(
                    optimizer.round_robin_bit16_groups[group_index],
                    optimizer.round_robin_bit16_meta[group_index],
                    optimizer.round_robin_bit16_offsets[group_index],
                )
            ]
        return layouts[key]

    def update_model_bit16_weights(group_index):
        # DeepSpeed's second loop re-points each parameter at its own round-robin entry: the same
        # tensor objects, reordered, so checking the first loop's work covers both.
        if all(param.data_ptr() == address and param.shape == shape for param, address, shape in slots(group_index)):
            return
        deepspeeds(group_index)

    optimizer._update_model_bit16_weights = update_model_bit16_weights
