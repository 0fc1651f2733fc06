"""The device feed (`trainers/step/feed.py`) and the training step's host reads, on the CPU.

On the CPU the copy to the device is a no-op, but the code is the one a GPU runs: uint8 batches
handed over one step ahead with the loader position of the batch handed over, conversion to the
model range and targets after the copy, and no read of a device value on steps that do not log.
"""

from __future__ import annotations

import gc
import math
import shutil
import sys
import threading
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from pretrain_helpers import in_process_loop
from torch.overrides import TorchFunctionMode

from vitray.data import ShardLoader, to_model_range
from vitray.data.batch import Batch, is_channels_last
from vitray.trainers.step.feed import DeviceFeed

# Tensor methods that make the host wait for the device (on CUDA) to read a value back.
HOST_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy"}
REPO = Path(__file__).resolve().parent.parent  # vitray's packages (trainers/, models/ ...) live at its top


class HostReads(TorchFunctionMode):
    """Records each host read with who made it: the innermost frame outside torch, in vitray's
    code ("vitray"), the data loader's ("loader": host tensors only, data/ never touches the
    device), DeepSpeed's ("deepspeed") or elsewhere ("other"), and `where()`'s value."""

    def __init__(self, where):
        super().__init__()
        self.where, self.reads = where, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append((self.where(), _origin(), name))
        return func(*args, **(kwargs or {}))


def _origin() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = str(Path(frame.filename).resolve())
        if "/torch/" in path:
            continue
        if "/deepspeed/" in path:
            return f"deepspeed:{Path(path).name}:{frame.name}"
        if path.startswith(str(REPO / "data")):  # the loader's own host tensors (data.num_workers=0: in-process)
            return f"loader:{Path(path).name}:{frame.name}"
        if path.startswith(str(REPO)) and "/.venv/" not in path and "/tests/" not in path:
            return f"vitray:{Path(path).name}:{frame.name}"
        return f"other:{Path(path).name}:{frame.name}"
    return "other"


def test_host_read_counter_sees_every_kind_of_read():
    t = torch.ones(3)
    with HostReads(lambda: 0) as mode:
        float(t.sum()), t.sum().item(), bool(t.sum() > 0), t.tolist(), int(t.sum())
    assert [name for _, _, name in mode.reads] == ["__float__", "item", "__bool__", "tolist", "__int__"]
    assert all(origin.startswith("other:test_feed.py") for _, origin, _ in mode.reads)


# Where a CUDA device exists (the device machine; see docs/testing.md), the tests marked with DEVICES run
# there as well: the pinned copies on the side stream and the feed's own thread.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _loader(dataset, **kw):
    args = {
        "rank": 0,
        "world_size": 1,
        "batch_size": 16,
        "img_size": 16,
        "train": True,
        "seed": 3,
        "num_slots": 8,
        "num_workers": 0,
    }
    return ShardLoader(str(dataset), "train", **{**args, **kw})


def test_feed_hands_uint8_batches_with_the_position_of_the_batch_handed_over(digits_dataset):
    plain = iter(_loader(digits_dataset, float_images=False))
    feed = DeviceFeed(_loader(digits_dataset, float_images=False), "cpu")
    fed = iter(feed)
    states = []
    for _ in range(3):
        expected, batch = next(plain), next(fed)
        assert batch.images.dtype == torch.uint8 and batch.images.device == feed.device
        # The loader's crops are channels-last in memory; on the CPU the feed hands them over as they
        # are (no host transpose in the training process; on CUDA it makes them planar after the copy).
        assert is_channels_last(expected.images) and is_channels_last(batch.images)
        assert torch.equal(batch.images, expected.images) and torch.equal(batch.labels, expected.labels)
        assert batch.keys == expected.keys
        # The feed has read one batch further, but reports the position after the one it handed over.
        assert feed._loader.state_dict()["consumed_per_slot"] == feed.state_dict()["consumed_per_slot"] + 2
        states.append(feed.state_dict())
    assert [s["consumed_per_slot"] for s in states] == [2, 4, 6]

    resumed = DeviceFeed(_loader(digits_dataset, float_images=False), "cpu")
    resumed.load_state_dict(states[1])
    assert torch.equal(next(iter(resumed)).images, batch.images)  # the third batch again
    assert resumed.epoch == 0 and resumed.steps_per_epoch == feed.steps_per_epoch  # the loader's own attributes


def test_the_model_reads_channels_last_batches_as_their_planar_copies(digits_dataset):
    """What lets the feed hand the CPU's batches over channels-last: the model's outputs and gradients
    are those of the planar copy (the patch embedding's convolution reads either layout)."""
    from vitray.models import create_model

    images = next(iter(_loader(digits_dataset, float_images=False))).images
    assert is_channels_last(images)
    torch.manual_seed(0)
    model = create_model("Ti/4", num_classes=10, img_size=16)
    outputs, grads = [], []
    for batch in (images, images.contiguous()):
        model.zero_grad()
        logits = model(to_model_range(batch))
        logits.square().mean().backward()
        outputs.append(logits.detach())
        grads.append(model.patch_embed.weight.grad.clone())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_feed_refuses_float_batches(digits_dataset):
    with pytest.raises(TypeError, match="float_images=False"):
        next(iter(DeviceFeed(_loader(digits_dataset), "cpu")))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_no_host_read_in_vitray_outside_log_steps(process_group, digits_dataset, tmp_path, dtype):
    loop = in_process_loop(digits_dataset, tmp_path / dtype, f"precision.dtype={dtype}", "optim.ema_decay=0.9")
    with HostReads(lambda: loop.step) as mode:
        last = loop.run()
    assert math.isfinite(last["loss"])
    # loop.step is s while step s+1 trains and s+1 while step s+1 logs: before 4, no step logged.
    ours = Counter((step, origin) for step, origin, _ in mode.reads if origin.startswith("vitray"))
    assert not [(s, o) for s, o in ours if s < 4], f"vitray read device values on steps that do not log: {ours}"
    assert ours, "the log step reads the loss and grad norm: the counter must see them"
    theirs = Counter((step, origin, name) for step, origin, name in mode.reads if origin.startswith("deepspeed"))
    sys.stderr.write(f"DeepSpeed's host reads ({dtype}, ZeRO-1), by loop.step: {sorted(theirs.items())}\n")


def test_batches_cross_as_uint8_and_become_model_inputs_after_the_copy(process_group, digits_dataset, tmp_path):
    loop = in_process_loop(digits_dataset, tmp_path, "train.steps=2", "log.every=2")
    handed, inputs = [], []
    hand_over = loop.loader._hand_over
    loop.loader._hand_over = lambda batch, ready: handed.append(hand_over(batch, ready)) or handed[-1]
    hook = loop.backend.module.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    loop.run()
    hook.remove()
    assert len(handed) == len(inputs) == 2
    for batch, given in zip(handed, inputs):
        assert batch.images.dtype == torch.uint8 and batch.images.device == loop.backend.device
        assert given.dtype == torch.bfloat16
        assert torch.equal(given, to_model_range(batch.images).to(torch.bfloat16))


def test_gpu_step_benchmark_runs_tiny_on_the_cpu(process_group, capsys):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_step.py"
    spec = importlib.util.spec_from_file_location("gpu_step", path)
    gpu_step = importlib.util.module_from_spec(spec)
    sys.modules["gpu_step"] = gpu_step  # dataclasses look their module up there
    spec.loader.exec_module(gpu_step)
    tiny = "--model Ti/16 --img-size 32 --batch 4 --steps 2 --warmup 1 --dtypes bf16,fp8 --fp8-layers all"
    result = gpu_step.main(tiny.split())
    printed = capsys.readouterr().out
    assert result["vitray_images_per_s"] > 0 and result["reference_images_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["vitray_images_per_s"] / result["reference_images_per_s"])
    assert result["mfu"] is None  # no peak for a CPU
    assert "vitray bf16/reference:" in printed and "vitray fp8/vitray bf16:" in printed and "img/s" in printed
    assert result["vitray_fp8_images_per_s"] > 0  # float8 emulated on the CPU
    assert 0 < result["vitray_last_loss"] < 20 and 0 < result["reference_last_loss"] < 20  # ln(1000) ~ 6.9


def test_compiled_steps_train_as_the_eager_ones(process_group, digits_dataset, tmp_path):
    """`train.compile=true` (on by default on CUDA) compiles the model in place through DeepSpeed:
    the same parameter names (so checkpoints do not change) and the same training, up to the
    float reassociation of fused kernels. On the CPU inductor builds C++ kernels (about 45 s)."""
    import torch._dynamo

    weights = {}
    for compiled in ("false", "true"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        loop = in_process_loop(digits_dataset, tmp_path / compiled, f"train.compile={compiled}", "precision.dtype=fp32")
        last = loop.run()
        assert math.isfinite(last["loss"])
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) == (compiled == "true"), f"compile={compiled}: {graphs} graphs compiled"
        weights[compiled] = {k: v.detach().float().clone() for k, v in loop.backend.module.state_dict().items()}
    assert list(weights["true"]) == list(weights["false"])  # no `_orig_mod.` prefix in checkpoints
    for name, eager in weights["false"].items():
        torch.testing.assert_close(weights["true"][name], eager, rtol=1e-4, atol=1e-4, msg=name)


def test_loader_only_steps_read_batches_and_train_on_none(process_group, digits_dataset, tmp_path):
    """debug.loader_only (benchmarks/loader_in_run.py): the loop reads its batches through the feed,
    counts them as trained on, and leaves the weights as they were."""
    loop = in_process_loop(digits_dataset, tmp_path, "debug.loader_only=true")
    before = {k: v.clone() for k, v in loop.backend.module.state_dict().items()}
    last = loop.run()
    assert loop.step == 4 and last["images_per_s"] > 0 and last["loss"] == 0.0
    assert loop.loader.state_dict()["consumed_per_slot"] > 0
    after = loop.backend.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _feed_threads(before: frozenset = frozenset()) -> list:
    """The feed threads alive now that were not in ``before`` (another test's)."""
    return [t for t in threading.enumerate() if t.name == "vitray-feed" and t.is_alive() and t not in before]


@pytest.mark.parametrize("device", DEVICES)
def test_the_feeds_thread_hands_the_batches_and_positions_of_the_inline_feed(digits_dataset, device):
    """On CUDA the feed reads and copies on a thread of its own, batches ahead of the step: the
    same batches in the same order, with the position of the batch handed over, as in the caller's
    thread, whatever the thread has read since."""
    others = frozenset(_feed_threads())
    assert DeviceFeed(_loader(digits_dataset, float_images=False), device)._background is (device == "cuda")
    inline = iter(DeviceFeed(_loader(digits_dataset, float_images=False), device, background=False))
    feed = DeviceFeed(_loader(digits_dataset, float_images=False), device, background=True, ahead=2)
    fed = iter(feed)
    states, keys = [], []
    for _ in range(5):
        expected, batch = next(inline), next(fed)
        assert batch.images.device.type == batch.labels.device.type == device
        assert torch.equal(batch.images, expected.images) and torch.equal(batch.labels, expected.labels)
        assert batch.keys == expected.keys
        states.append(feed.state_dict())
        keys.append(batch.keys)
    assert len(_feed_threads(others)) == 1
    assert [s["consumed_per_slot"] for s in states] == [2, 4, 6, 8, 10]
    # Read ahead: at most the queue's 2 batches and the one being copied beyond those handed over.
    assert 10 <= feed._loader.state_dict()["consumed_per_slot"] <= 10 + 2 * 3

    resumed = DeviceFeed(_loader(digits_dataset, float_images=False), device, background=True)
    resumed.load_state_dict(states[2])
    assert next(iter(resumed)).keys == keys[3]  # the fourth batch, after the third's position
    resumed.close()
    feed.load_state_dict(states[0])  # stops the running thread first: the loader's position is its own again
    assert feed.state_dict()["consumed_per_slot"] == 2
    assert not _feed_threads(others)


@pytest.mark.parametrize("background", [False, True])
def test_a_new_iterator_goes_on_after_the_last_batch_handed_over(digits_dataset, background):
    """What the last iterator read ahead and never handed over is not lost: a new iterator hands it."""
    others = frozenset(_feed_threads())
    expected = iter(_loader(digits_dataset, float_images=False))
    feed = DeviceFeed(_loader(digits_dataset, float_images=False), "cpu", background=background)
    first = iter(feed)
    assert next(first).keys == next(expected).keys
    assert next(first).keys == next(expected).keys
    second = iter(feed)  # ends the first iterator (and its thread)
    assert next(second).keys == next(expected).keys
    assert len(_feed_threads(others)) == (1 if background else 0)
    feed.close()


def test_a_dropped_iterator_stops_the_feeds_thread(digits_dataset):
    others = frozenset(_feed_threads())
    feed = DeviceFeed(_loader(digits_dataset, float_images=False), "cpu", background=True)
    second = iter(feed)
    next(second)
    assert len(_feed_threads(others)) == 1
    del feed, second  # the last references gone: the generator's close stops the thread
    gc.collect()
    assert not _feed_threads(others)


class _CollectingLoader:
    """Tiny uint8 batches; before its third, it waits for ``dropped`` and runs the garbage collector
    (on the feed's thread, the one that reads it)."""

    def __init__(self, dropped: threading.Event):
        self.dropped, self.step = dropped, 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]

    def __iter__(self):
        while True:
            if self.step == 2:
                self.dropped.wait(timeout=30)
                gc.collect()
            self.step += 1
            images = torch.zeros((2, 3, 4, 4), dtype=torch.uint8)
            yield Batch(images=images, labels=torch.zeros(2, dtype=torch.long), keys=["a", "b"], step=self.step)


def test_a_dropped_iterator_collected_on_the_feeds_own_thread_stops_it_quietly(monkeypatch):
    """The garbage collector may finalise a dropped iterator on any thread, the feed's own included:
    the thread then stops at its next batch, with no error (it cannot join itself)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    others = frozenset(_feed_threads())
    dropped = threading.Event()
    feed = DeviceFeed(_CollectingLoader(dropped), "cpu", background=True, ahead=1)
    batches = iter(feed)
    next(batches)
    (thread,) = _feed_threads(others)
    del feed, batches
    dropped.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert not unraisable, [str(u.exc_value) for u in unraisable]


def test_the_loaders_error_reaches_the_caller_from_the_feeds_thread(digits_dataset, tmp_path):
    """An error while reading (here: the shards gone after the loader was made) is raised in the
    caller's thread, as the inline feed would raise it, and the thread ends."""
    others = frozenset(_feed_threads())
    copy = tmp_path / "digits"
    shutil.copytree(digits_dataset, copy)
    inline = DeviceFeed(_loader(copy, float_images=False), "cpu")
    feed = DeviceFeed(_loader(copy, float_images=False), "cpu", background=True)
    for shard in copy.rglob("*.tar"):
        shard.unlink()
    with pytest.raises(Exception) as expected:
        next(iter(inline))
    with pytest.raises(type(expected.value)) as raised:
        next(iter(feed))
    assert str(raised.value) == str(expected.value)
    feed.close()
    assert not _feed_threads(others)


def test_training_with_the_feeds_thread_is_training_without_it(process_group, digits_dataset, tmp_path, monkeypatch):
    """The loop through the feed's thread (CUDA's default, forced here on the CPU) trains the same
    weights as through the inline feed, and the thread is gone when the run ends. With a loader
    worker process, as on a GPU: the feed's thread is the one that forks it."""
    from vitray.trainers.step import feed as feed_module

    others = frozenset(_feed_threads())
    weights = {}
    for background in (False, True):
        monkeypatch.setattr(
            feed_module.DeviceFeed, "__init__", _with_background(feed_module.DeviceFeed.__init__, background)
        )
        loop = in_process_loop(
            digits_dataset, tmp_path / str(background), "train.steps=3", "log.every=3", "data.num_workers=1"
        )
        loop.run()
        assert loop.loader._background is background
        weights[background] = {k: v.detach().clone() for k, v in loop.backend.module.state_dict().items()}
        monkeypatch.undo()
    assert not _feed_threads(others)
    for name, inline in weights[False].items():
        assert torch.equal(weights[True][name], inline), name


def _with_background(init, background: bool):
    def patched(self, loader, device, **kwargs):
        init(self, loader, device, **{**kwargs, "background": background})

    return patched
