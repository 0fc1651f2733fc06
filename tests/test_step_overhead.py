"""Host overhead of a training step that does not log (issue 24), counted on the CPU.

On a GPU every device synchronisation, every read of a device value and every per-parameter hook
is time the GPU waits for the host. The CPU runs the same DeepSpeed code, so the counts taken here
(DeepSpeed's accelerator `synchronize`, the hooks DeepSpeed hangs on each parameter's gradient
accumulation, `.item()`-like reads) are those a GPU step pays.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections import Counter
from contextlib import ExitStack, contextmanager

import pytest
import torch
from pretrain_helpers import in_process_loop
from test_feed import HostReads

STEPS = 6  # log.every=STEPS: steps 1-5 do not log (DeepSpeed's throughput timer synchronises from step 3 on)


class StepCounts:
    """Per `loop.step`, what the host did: accelerator synchronisations, per-parameter gradient
    hooks run, and host reads of device values (with who made them)."""

    def __init__(self, loop):
        self.loop = loop
        self.syncs: Counter = Counter()
        self.hooks: Counter = Counter()
        self.reads = HostReads(lambda: loop.step)

    def non_log(self, kind: str) -> dict[int, int]:
        """`kind`'s count per non-log step (loop.step s while step s+1 trains; step STEPS logs)."""
        if kind == "reads":
            counts = Counter(step for step, origin, _ in self.reads.reads if not origin.startswith("loader"))
        else:
            counts = getattr(self, kind)
        return {s: counts[s] for s in range(STEPS - 1)}

    def read_origins(self) -> Counter:
        # The loader's reads are of its own host tensors (data.num_workers=0 runs it in this process).
        return Counter(
            (origin, name)
            for step, origin, name in self.reads.reads
            if step < STEPS - 1 and not origin.startswith("loader")
        )

    @contextmanager
    def counting(self):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        synchronize = accelerator.synchronize

        def counted_synchronize(*args, **kwargs):
            if not collecting:
                self.syncs[self.loop.step] += 1
            return synchronize(*args, **kwargs)

        # An engine left unreachable by an earlier test synchronises when the garbage collector
        # destroys it (DeepSpeedEngine.__del__ -> optimizer.destroy()): not the step's doing. Collect
        # those now, and leave out what a collection during the run does.
        gc.collect()
        collecting = False

        def note_collection(phase, info):
            nonlocal collecting
            collecting = phase == "start"

        with ExitStack() as stack:
            gc.callbacks.append(note_collection)
            stack.callback(gc.callbacks.remove, note_collection)
            accelerator.synchronize = counted_synchronize  # DeepSpeed calls it through get_accelerator()
            stack.callback(delattr, accelerator, "synchronize")
            for param in self.loop.backend.module.parameters():
                stack.enter_context(self._counted_hooks(param))
            stack.enter_context(self.reads)
            yield self

    @contextmanager
    def _counted_hooks(self, param: torch.Tensor):
        """Every hook on `param`'s gradient (after accumulation, DeepSpeed's ZeRO 1-2 way, or on the
        gradient itself), wrapped to count its calls."""
        tables = [t for t in (param._post_accumulate_grad_hooks, param._backward_hooks) if t]
        saved = [dict(t) for t in tables]
        for table in tables:
            for key, hook in table.items():
                table[key] = self._counted(hook)
        try:
            yield
        finally:
            for table, original in zip(tables, saved):
                table.update(original)

    def _counted(self, hook):
        def counted(*args, **kwargs):
            self.hooks[self.loop.step] += 1
            return hook(*args, **kwargs)

        return counted


def measure(dataset, tmp_path, *overrides: str) -> StepCounts:
    loop = in_process_loop(
        dataset, tmp_path, f"train.steps={STEPS}", f"log.every={STEPS}", f"checkpoint.every={10 * STEPS}", *overrides
    )
    counts = StepCounts(loop)
    with counts.counting():
        loop.run()
    return counts


@contextmanager
def deepspeed_as_before():
    """vitray's DeepSpeed settings before issue 24, the reference: DeepSpeed's throughput timer on,
    ZeRO-1 reducing through per-parameter hooks, DeepSpeed's own ZeRO step (clipping, grad norm),
    torch's unfused AdamW on the CPU."""
    from vitray.trainers.engines.deepspeed import backend as ds

    config, streamline, build_optimizer = ds.deepspeed_config, ds.zero_step.streamline, ds.build_optimizer

    def reference_config(cfg, *, world_size, load_universal=False):
        settings = config(cfg, world_size=max(world_size, 2), load_universal=load_universal)  # ZeRO-1 with hooks
        settings.pop("timers")
        return settings

    ds.deepspeed_config, ds.zero_step.streamline = reference_config, lambda optimizer: None
    ds.build_optimizer = lambda model, optim, fused: build_optimizer(model, optim, fused=torch.cuda.is_available())
    try:
        yield
    finally:
        ds.deepspeed_config, ds.zero_step.streamline, ds.build_optimizer = config, streamline, build_optimizer


def summary(counts: StepCounts) -> dict[str, int]:
    """The most of each kind in one non-log step (the throughput timer starts at the third)."""
    return {kind: max(counts.non_log(kind).values()) for kind in ("syncs", "hooks", "reads")}


def test_the_counters_see_a_sync_a_hook_and_a_read(process_group, digits_dataset, tmp_path):
    """The counters count, on the step that did it: a synchronisation, a hook and a host read
    made inside the run, and DeepSpeed's own under its former settings."""
    from deepspeed.accelerator import get_accelerator

    loop = in_process_loop(digits_dataset, tmp_path / "known", f"train.steps={STEPS}", f"log.every={STEPS}")
    next(loop.backend.module.parameters()).register_post_accumulate_grad_hook(lambda p: None)
    train_step = loop.train_step

    def train_step_with_a_sync_and_a_read(batches):
        get_accelerator().synchronize()
        out = train_step(batches)
        out[0].item()
        return out

    loop.train_step = train_step_with_a_sync_and_a_read
    counts = StepCounts(loop)
    with counts.counting():
        loop.run()
    assert counts.non_log("syncs") == counts.non_log("hooks") == dict.fromkeys(range(STEPS - 1), 1)
    assert counts.read_origins()["other:test_step_overhead.py:train_step_with_a_sync_and_a_read", "item"] == STEPS - 1

    with deepspeed_as_before():
        before = measure(digits_dataset, tmp_path / "before")
    params = sum(1 for p in before.loop.backend.module.parameters() if p.requires_grad)
    # DeepSpeed's throughput timer: one synchronisation in forward and one in step, from step 3 on.
    assert before.non_log("syncs") == {0: 0, 1: 0, **dict.fromkeys(range(2, STEPS - 1), 2)}
    # ... and reads: the grad norm checked for inf/NaN (overflow, clipping), AdamW's step count (unfused).
    assert summary(before) == {"syncs": 2, "hooks": params, "reads": 4}, before.read_origins()


# (ZeRO stage, dtype) -> per non-log step: synchronisations, per-parameter hook calls ("params": one
# for each parameter), host reads. Where not 0, DeepSpeed leaves no setting to turn it off:
#   ZeRO-2 and 3 partition gradients through a hook on every parameter (stage_1_and_2.py / stage3.py);
#   fp32 ZeRO 1-3 check the grad norm for inf/NaN on the host in every step (`self.dtype !=
#   torch.bfloat16 or self.check_grad_overflow`), which bf16 skips with bf16.check_grad_overflow=false.
EXPECTED = {
    (0, "fp32"): (0, 0, 0),  # the engine all-reduces flat buckets after the backward pass
    (1, "bf16"): (0, 0, 0),
    (1, "fp32"): (0, 0, 1),
    (2, "bf16"): (0, "params", 0),
    (2, "fp32"): (0, "params", 1),
}


@pytest.mark.parametrize(("zero_stage", "dtype"), list(EXPECTED))
def test_a_step_that_does_not_log_waits_for_nothing(process_group, digits_dataset, tmp_path, zero_stage, dtype):
    counts = measure(digits_dataset, tmp_path, f"train.zero_stage={zero_stage}", f"precision.dtype={dtype}")
    params = sum(1 for p in counts.loop.backend.module.parameters() if p.requires_grad)
    syncs, hooks, reads = EXPECTED[zero_stage, dtype]
    expected = {"syncs": syncs, "hooks": params if hooks == "params" else hooks, "reads": reads}
    got = summary(counts)
    sys.stderr.write(f"ZeRO-{zero_stage} {dtype}, per non-log step: {got}; reads by {dict(counts.read_origins())}\n")
    assert got == expected, (got, counts.read_origins())
    assert all(origin == "deepspeed:utils.py:is_invalid_grad_norm" for origin, _ in counts.read_origins())


def test_bf16_with_nonfinite_skip_keeps_the_overflow_check(process_group, digits_dataset, tmp_path):
    """train.nonfinite=skip needs the overflow check (it drops the step): one host read a step."""
    counts = measure(digits_dataset, tmp_path, "train.nonfinite=skip")
    assert summary(counts)["reads"] >= 1 and summary(counts)["syncs"] == 0


def test_zero1_without_hooks_trains_as_with_them(process_group, digits_dataset, tmp_path):
    """ZeRO-1 on one worker reduces after the backward pass, without hooks: the same weights, bit for
    bit, as its overlapped reduction through per-parameter hooks (used with several workers), over
    accumulated micro-batches."""
    from vitray.trainers.engines.deepspeed import backend as ds

    config, weights, hooks = ds.deepspeed_config, {}, {}
    for world in (1, 2):
        ds.deepspeed_config = lambda cfg, *, world_size, load_universal=False: config(
            cfg, world_size=world, load_universal=load_universal
        )
        try:
            loop = in_process_loop(digits_dataset, tmp_path / str(world), "train.micro_batch_size=4")
            loop.run()
        finally:
            ds.deepspeed_config = config
        hooks[world] = sum(len(p._post_accumulate_grad_hooks or {}) for p in loop.backend.module.parameters())
        weights[world] = loop.backend.full_state_dict()
    assert hooks[1] == 0 and hooks[2] > 0
    assert [k for k in weights[1] if not torch.equal(weights[1][k], weights[2][k])] == []


def _operator_reads(fn, *args) -> int:
    """Reads of tensor values by the host (``aten::_local_scalar_dense``) while ``fn`` runs, those
    inside C++ operators too (which the Python-level counters above do not see): the profiler's."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn(*args)
    return sum(1 for event in profile.events() if event.name == "aten::_local_scalar_dense")


def test_zero_grad_norm_masking_reads_nothing(process_group, digits_dataset, tmp_path):
    """DeepSpeed's inf/NaN masking of the ZeRO grad norm read the value back inside `masked_fill_`
    (two device synchronisations a step on an H100/H200, seen with `benchmarks/gpu_step.py
    --profile`); the ZeRO optimizers use vitray's instead, which marks the same norms, reading
    nothing."""
    from deepspeed.runtime import utils as deepspeed_utils
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    from vitray.trainers.engines.deepspeed.zero_step import mask_nonfinite_on_device

    in_process_loop(digits_dataset, tmp_path, "train.steps=1")  # builds the engine, which swaps it in
    assert stage_1_and_2.mask_nan_or_inf_with_val_inplace is stage3.mask_nan_or_inf_with_val_inplace
    assert stage_1_and_2.mask_nan_or_inf_with_val_inplace is mask_nonfinite_on_device
    for value in (2.5, float("inf"), float("-inf"), float("nan")):
        ours, theirs = torch.tensor(value), torch.tensor(value)
        assert _operator_reads(mask_nonfinite_on_device, ours) == 0
        assert _operator_reads(deepspeed_utils.mask_nan_or_inf_with_val_inplace, theirs) >= 1  # the counter counts
        assert ours.item() == theirs.item() == (value if value == 2.5 else -1.0)


@contextmanager
def deepspeeds_own_zero_step():
    """DeepSpeed's ZeRO step as it comes (vitray's `zero_step.streamline` not applied)."""
    from vitray.trainers.engines.deepspeed import zero_step

    streamline = zero_step.streamline
    zero_step.streamline = lambda optimizer: None
    try:
        yield
    finally:
        zero_step.streamline = streamline


def _zero_step_operators(dataset, tmp_path, monkeypatch, depth: int) -> tuple[int, int]:
    """(parameter tensors, the most operators the host issued in one step's gradient reduction and
    optimizer step: the engine's `allreduce_gradients` and `step`, the backward pass left out) for a
    ViT of `depth` layers of width 16 (the same operators per parameter as a B/16's, at no cost)."""
    from vitray.models import variants

    tiny = variants.TransformerSize(width=16, depth=depth, mlp_dim=32, num_heads=2)
    monkeypatch.setitem(variants.VARIANTS, "Ti/4", variants.Variant("Ti/4", tiny, 4))
    loop = in_process_loop(dataset, tmp_path / f"depth{depth}", "train.micro_batch_size=4", f"model.depth={depth}")
    engine = loop.backend.engine
    for name in ("allreduce_gradients", "step"):
        method = getattr(engine, name)

        def labelled(*args, _method=method, **kwargs):
            with torch.profiler.record_function(f"zero step {loop.step}"):
                return _method(*args, **kwargs)

        setattr(engine, name, labelled)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loop.run()
    per_step: Counter = Counter()
    for event in profile.events():
        parent = event.cpu_parent
        if not event.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue  # operators the host called, not those they call in turn
        while parent is not None and not parent.name.startswith("zero step"):
            parent = parent.cpu_parent
        if parent is not None:
            per_step[parent.name] += 1
    params = sum(1 for p in loop.backend.module.parameters() if p.requires_grad)
    return params, max(count for label, count in per_step.items() if label != "zero step 0")  # 0: first-step setup


def test_the_zero_step_issues_no_operator_per_parameter(process_group, digits_dataset, tmp_path, monkeypatch):
    """A ViT has ~150 parameter tensors, small or huge; DeepSpeed's ZeRO-1 step issued several device
    operators for each in every step (its grad norm, its reduction on one rank, re-pointing the
    parameters), which for S/16 on an H100 took the host longer than the GPU took for the step.
    vitray's (`trainers/engines/deepspeed/zero_step.py`) issues the same number whatever the number of parameters."""
    shallow, deep = (_zero_step_operators(digits_dataset, tmp_path, monkeypatch, depth) for depth in (1, 4))
    assert deep[0] - shallow[0] >= 30, (shallow, deep)  # the deeper model has many more parameter tensors
    assert deep[1] == shallow[1] <= 80, (shallow, deep)
    with deepspeeds_own_zero_step():
        shallow_own, deep_own = (
            _zero_step_operators(digits_dataset, tmp_path / "own", monkeypatch, depth) for depth in (1, 4)
        )
    # The counter sees DeepSpeed's own: at least two more operators for each added parameter.
    assert deep_own[1] - shallow_own[1] >= 2 * (deep[0] - shallow[0]), (shallow_own, deep_own)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])  # DeepSpeed refuses fp16 on the CPU
def test_the_streamlined_zero_step_trains_as_deepspeeds_own(process_group, digits_dataset, tmp_path, dtype):
    """The same weights, bit for bit, and the same grad norms as DeepSpeed's own ZeRO-1 step, with
    clipping at work and accumulated micro-batches."""
    results = {}
    for own in (False, True):
        with deepspeeds_own_zero_step() if own else contextlib.nullcontext():
            loop = in_process_loop(
                digits_dataset,
                tmp_path / str(own),
                "train.micro_batch_size=4",
                "optim.grad_clip=0.05",
                f"precision.dtype={dtype}",
            )
            batches, norms = iter(loop.loader), []
            for _ in range(3):
                _, grad_norm, _, _ = loop.train_step(batches)
                loop.step += 1
                norms.append(float(grad_norm))
        results[own] = norms, loop.backend.full_state_dict()
        zero = loop.backend.engine.optimizer  # `_repoint_only_moved_parameters` relies on this layout:
        for params, reordered in zip(zero.bit16_groups, zero.round_robin_bit16_groups):
            assert sorted(map(id, params)) == sorted(map(id, reordered))  # the same tensors, reordered
    (norms, weights), (own_norms, own_weights) = results[False], results[True]
    assert norms == own_norms and min(norms) > 0.05, (norms, own_norms)  # clipped in every step
    assert [k for k in weights if not torch.equal(weights[k], own_weights[k])] == []


def test_a_parameter_moved_off_the_flat_buffer_is_pointed_back(process_group, digits_dataset, tmp_path):
    """The step re-points parameters at DeepSpeed's flat bf16 buffer only when one no longer views it
    (something re-pointed it): then it does, as DeepSpeed's own always does."""
    zero = in_process_loop(digits_dataset, tmp_path).backend.engine.optimizer
    flat = zero.bit16_groups_flat[0]
    param = zero.round_robin_bit16_groups[0][3]
    slot = flat.data_ptr() + zero.round_robin_bit16_offsets[0][3] * flat.element_size()
    assert param.data_ptr() == slot
    param.data = param.data.clone()  # moved off the buffer, as a load that replaces tensors would
    assert param.data_ptr() != slot
    zero._update_model_bit16_weights(0)
    assert param.data_ptr() == slot
