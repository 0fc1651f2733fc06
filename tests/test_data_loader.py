"""The epoch plan and the readers: exact resume, world-size changes, corrupt data, evaluation."""

from __future__ import annotations

import gc
import io
import itertools
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from PIL import Image

import vitray.data.batch as batch_module
import vitray.data.loader as loader_module
import vitray.data.shared_memory as shared_memory
from vitray import storage
from vitray.data import (
    DataConfig,
    EvalLoader,
    ShardLoader,
    epoch_plan,
    load_split,
    prepare_dataset,
    rank_slots,
    read_dataset_info,
    read_manifest,
    top1_hits,
)
from vitray.data.batch import SkipReporter, is_channels_last
from vitray.data.model_range import to_model_range
from vitray.data.plan import ShardRange
from vitray.data.reader import SampleStream
from vitray.data.transforms import (
    TrainCrop,
    apply_seeded,
    decode_image,
    eval_resize,
    eval_transform,
    train_augment,
    train_transform,
)

NUM_SLOTS = 8
GLOBAL_BATCH = 32  # 4 positions of each of the 8 slots per step; digits train: 179 per slot, 44 steps


def loader(path, *, rank=0, world_size=1, batch_size=GLOBAL_BATCH, workers=0, seed=3, **kwargs) -> ShardLoader:
    return ShardLoader(
        str(path),
        "train",
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        img_size=8,
        train=True,
        seed=seed,
        num_slots=NUM_SLOTS,
        num_workers=workers,
        **kwargs,
    )


def take(data_loader: ShardLoader, steps: int) -> list:
    return list(itertools.islice(data_loader, steps))


def same_batches(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.keys == y.keys and torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels) for x, y in zip(a, b)
    )


# ---------------------------------------------------------------- the plan


def test_epoch_plan_is_a_pure_function_with_equal_slots():
    sizes = [100, 100, 37, 100, 5]
    plan = epoch_plan(7, 2, sizes, 8)
    assert plan == epoch_plan(7, 2, sizes, 8)
    assert plan.slot_size == 342 // 8 and plan.dropped == 342 % 8
    assert all(sum(len(r) for r in slot) == plan.slot_size for slot in plan.slots)
    covered = [(r.shard, i) for slot in plan.slots for r in slot for i in range(r.start, r.stop)]
    assert len(covered) == len(set(covered)) == 342 - plan.dropped
    orders = [
        tuple(dict.fromkeys(r.shard for slot in epoch_plan(7, e, sizes, 8).slots for r in slot)) for e in range(6)
    ]
    assert all(a != b for a, b in itertools.pairwise(orders)), orders  # the shard order changes from epoch to epoch


def test_rank_slots_and_bad_divisions():
    assert rank_slots(1, 4, 8) == [1, 5]
    with pytest.raises(ValueError, match="num_slots=8 is not divisible by world_size=3"):
        rank_slots(0, 3, 8)
    with pytest.raises(ValueError, match="fewer than num_slots"):
        epoch_plan(0, 0, [3], 8)


def test_batch_size_must_split_over_the_rank_slots(digits_dataset):
    with pytest.raises(ValueError, match="batch_size=10 must be a positive multiple of the rank's 4 slots"):
        loader(digits_dataset, world_size=2, batch_size=10)
    with pytest.raises(KeyError, match="has no split 'validation'"):
        ShardLoader(
            str(digits_dataset), "validation", rank=0, world_size=1, batch_size=8, img_size=8, train=True, seed=0
        )


# ---------------------------------------------------------------- training reader


def test_resume_gives_the_uninterrupted_sequence_with_any_worker_count(digits_dataset):
    steps, cut = 50, 17  # crosses the epoch boundary at step 44
    uninterrupted = take(loader(digits_dataset, workers=0), steps)
    assert [b.epoch for b in uninterrupted].index(1) == 44
    first = loader(digits_dataset, workers=2)
    before = take(first, cut)
    state = first.state_dict()
    assert state["epoch"] == 0 and state["consumed_per_slot"] == cut * GLOBAL_BATCH // NUM_SLOTS
    resumed = loader(digits_dataset, workers=0)
    resumed.load_state_dict(state)
    after = take(resumed, steps - cut)
    assert same_batches(before + after, uninterrupted)  # keys, augmented pixels and labels


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on a 2-CPU machine
def test_any_worker_count_gives_the_same_batches(digits_dataset):
    # 8 ranks of 1 slot; 2 workers take turns on the rank's slot, batch by batch.
    reference = take(loader(digits_dataset, rank=5, world_size=8, batch_size=4, workers=0), 7)
    assert same_batches(take(loader(digits_dataset, rank=5, world_size=8, batch_size=4, workers=2), 7), reference)
    # 2 ranks of 4 slots; 3 workers own uneven blocks of slots (1, 1 and 2).
    reference = take(loader(digits_dataset, rank=1, world_size=2, batch_size=16, workers=0), 3)
    assert same_batches(take(loader(digits_dataset, rank=1, world_size=2, batch_size=16, workers=3), 3), reference)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_leaves_torchs_global_random_state_as_it_was(digits_dataset, workers):
    """The training loop seeds torch's global generator for each step's dropout and then fetches the
    step's batch: starting a loader's iterator drew a number from it (DataLoader's base seed), so the
    first step of every attempt had other dropout, and a resumed run did not end with the weights of
    the run that went straight through."""
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    batches = iter(loader(digits_dataset, workers=workers))
    next(batches)
    assert torch.equal(torch.get_rng_state(), state)
    batches.close()
    next(iter(EvalLoader(str(digits_dataset), "test", batch_size=64, img_size=8, num_workers=workers)))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(("before_ws", "after_ws"), [(2, 1), (1, 2)])
def test_resume_on_another_world_size_visits_every_sample_once(digits_dataset, before_ws, after_ws):
    def run(world_size, steps, state=None):
        ranks = [
            loader(digits_dataset, rank=r, world_size=world_size, batch_size=GLOBAL_BATCH // world_size)
            for r in range(world_size)
        ]
        for rank_loader in ranks:
            if state:
                rank_loader.load_state_dict(state)
        per_rank = [take(rank_loader, steps) for rank_loader in ranks]
        states = [rank_loader.state_dict() for rank_loader in ranks]
        assert all(s == states[0] for s in states)  # the state is one number for every rank
        return [sorted(k for r in per_rank for k in r[step].keys) for step in range(steps)], states[0]

    steps_per_epoch = loader(digits_dataset).steps_per_epoch
    global_batches, state = run(before_ws, 20)
    rest, _ = run(after_ws, steps_per_epoch - 20, state)
    reference, _ = run(1, steps_per_epoch)
    assert global_batches + rest == reference  # the same global batches, step by step
    keys = [k for step in reference for k in step]
    assert len(keys) == len(set(keys)) == steps_per_epoch * GLOBAL_BATCH


def test_an_epoch_ends_between_steps_whatever_their_split(digits_dataset):
    """One global batch of 32, split as 1 rank x 32, 1 rank x 16 x 2 micro-batches, 2 ranks x 8 x 2
    and 4 ranks x 8: every step takes the same samples, across the epoch end (179 positions a slot,
    4 a step: 44 steps an epoch, 3 positions left over). Ending per batch, a step of 2 micro-batches
    straddled the end and every later step took other samples; and so did a run resumed on fewer
    workers that accumulate more (the README's way to keep the global batch)."""
    end = 179 // (GLOBAL_BATCH // NUM_SLOTS)
    steps = end + 3

    def run(world_size, micro_batch, count, state=None):
        accumulate = GLOBAL_BATCH // (world_size * micro_batch)
        ranks = [
            loader(digits_dataset, rank=r, world_size=world_size, batch_size=micro_batch, micro_batches=accumulate)
            for r in range(world_size)
        ]
        for rank_loader in ranks:
            if state:
                rank_loader.load_state_dict(state)
        per_rank = [take(rank_loader, count * accumulate) for rank_loader in ranks]
        keys = [
            sorted(
                k for batches in per_rank for b in batches[step * accumulate : (step + 1) * accumulate] for k in b.keys
            )
            for step in range(count)
        ]
        assert ranks[0].steps_per_epoch == end * accumulate
        return keys, ranks[0].state_dict(), [b.epoch for b in per_rank[0][::accumulate]]

    reference, _, epochs = run(1, GLOBAL_BATCH, steps)
    assert epochs == [0] * end + [1] * (steps - end)
    for world_size, micro_batch in [(1, 16), (2, 8), (4, 8)]:
        assert run(world_size, micro_batch, steps)[0] == reference, (world_size, micro_batch)
    # Stopped after the epoch end on 2 ranks without accumulation, resumed on 1 that accumulates 2
    before, state, _ = run(2, 16, end + 1)
    after, _, _ = run(1, 16, 2, state)
    assert before + after == reference


def _stream_keys(plan, slot: int) -> list[str]:
    """Keys of a slot's stream, in stream order (digits: 100 samples per shard, keys by index)."""
    return [f"train_{r.shard * 100 + i:08d}" for r in plan.slots[slot] for i in range(r.start, r.stop)]


def test_staggered_windows_partition_each_slot_and_switch_at_different_steps(digits_dataset):
    from concurrent.futures import ThreadPoolExecutor

    from vitray.data.plan import window_bounds, window_of, window_offset
    from vitray.data.slots import SlotReader

    rows = read_manifest(str(digits_dataset), "train")
    urls = [str(digits_dataset / r.name) for r in rows]
    plan, buffer = epoch_plan(3, 0, [r.num_samples for r in rows], NUM_SLOTS), 48
    offsets = [window_offset(slot, NUM_SLOTS, buffer) for slot in range(NUM_SLOTS)]
    assert offsets == [0, 6, 12, 18, 24, 30, 36, 42] and window_offset(5, NUM_SLOTS, buffer, staggered=False) == 0
    switches = {
        slot: {
            p
            for p in range(1, plan.slot_size)
            if window_of(p, offsets[slot], buffer) != window_of(p - 1, offsets[slot], buffer)
        }
        for slot in range(NUM_SLOTS)
    }
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(switches.values(), 2))
    with ThreadPoolExecutor(1) as background:
        for slot in (0, 5):
            windows = [window_bounds(w, offsets[slot], buffer, plan.slot_size) for w in range(5)]
            assert [p for first, last in windows for p in range(first, last)] == list(range(plan.slot_size))
            stream = _stream_keys(plan, slot)
            reads = {}
            for executor in (None, background):
                reader = SlotReader(
                    urls,
                    plan,
                    slot,
                    shuffle_buffer=buffer,
                    start=0,
                    stop=plan.slot_size,
                    window_offset=offsets[slot],
                    executor=executor,
                )
                reads[executor] = [reader.take(p).key for p in range(plan.slot_size)]
                reader.close()
            assert reads[None] == reads[background] and sorted(reads[None]) == sorted(stream)
            for first, last in windows:  # shuffled within each window, never across
                assert sorted(reads[None][first:last]) == sorted(stream[first:last])


def test_the_next_window_is_read_in_the_background(digits_dataset, monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from vitray.data.slots import SlotReader

    readers_threads = []
    real_read = SampleStream.read
    monkeypatch.setattr(
        SampleStream,
        "read",
        lambda self, want: readers_threads.append(threading.current_thread().name) or real_read(self, want),
    )
    rows = read_manifest(str(digits_dataset), "train")
    plan = epoch_plan(3, 0, [r.num_samples for r in rows], 2)
    with ThreadPoolExecutor(1, thread_name_prefix="background") as background:
        reader = SlotReader(
            [str(digits_dataset / r.name) for r in rows],
            plan,
            1,
            shuffle_buffer=100,
            start=0,
            stop=plan.slot_size,
            window_offset=50,
            executor=background,
        )
        for position in range(25):  # window 0 is [0, 50): read here, in this thread
            reader.take(position)
        assert reader._next is None  # not before the last quarter of the window
        reader.take(25)
        assert reader._next[0] == 1  # [50, 150), read in the background from now on
        for position in range(26, 150):
            reader.take(position)
        assert reader._next[0] == 2  # [150, 250), requested at position 125
        reader._next[1].result()
        main = threading.current_thread().name
        assert readers_threads.count(main) == 50
        assert len(readers_threads) == 250 and all(t.startswith("background") for t in readers_threads if t != main)
        reader.close()


def test_states_saved_before_staggering_resume_with_their_windows(digits_dataset):
    old_state = {**loader(digits_dataset).state_dict(), "version": 1}
    del old_state["staggered_windows"]
    unstaggered = loader(digits_dataset)
    unstaggered.load_state_dict(old_state)
    first = take(unstaggered, 3)
    assert unstaggered.state_dict()["staggered_windows"] is False
    # Version 1 order: windows of 512 (the whole 179-sample slot) from position 0, permuted by the plan.
    plan = epoch_plan(3, 0, [r.num_samples for r in read_manifest(str(digits_dataset), "train")], NUM_SLOTS)
    from vitray.data.plan import window_order

    per_slot = GLOBAL_BATCH // NUM_SLOTS
    expected = [
        _stream_keys(plan, slot)[int(window_order(3, 0, slot, 0, plan.slot_size)[p])]
        for slot in range(NUM_SLOTS)
        for p in range(per_slot)
    ]
    assert first[0].keys == expected
    resumed = loader(digits_dataset, workers=2)
    resumed.load_state_dict({**old_state, "consumed_per_slot": per_slot})
    assert same_batches(take(resumed, 2), first[1:])
    staggered = take(loader(digits_dataset), 1)[0]
    assert staggered.keys != first[0].keys  # slot 1+ windows start early now: another order


def test_every_rank_yields_the_same_number_of_batches_per_epoch(digits_dataset):
    ranks = [loader(digits_dataset, rank=r, world_size=4, batch_size=8) for r in range(4)]
    assert len({r.steps_per_epoch for r in ranks}) == 1
    boundaries = set()
    for rank_loader in ranks:
        epochs = [b.epoch for b in take(rank_loader, rank_loader.steps_per_epoch + 1)]
        boundaries.add(epochs.index(1))
    assert boundaries == {ranks[0].steps_per_epoch}


def test_batches_are_normalised_rgb_and_shuffled(digits_dataset):
    batch = take(loader(digits_dataset), 1)[0]
    assert batch.images.shape == (GLOBAL_BATCH, 3, 8, 8) and batch.images.dtype == torch.float32
    assert -1.0 <= batch.images.min() < 0 < batch.images.max() <= 1.0
    assert batch.labels.dtype == torch.int64 and len(set(batch.labels.tolist())) > 3
    other_seed = take(loader(digits_dataset, seed=4), 1)[0]
    assert other_seed.keys != batch.keys
    raw = take(loader(digits_dataset, float_images=False), 1)[0]
    assert raw.images.dtype == torch.uint8 and raw.keys == batch.keys
    assert torch.equal(to_model_range(raw.images), batch.images)


def test_resume_decodes_only_what_it_yields(digits_dataset, monkeypatch):
    decoded = []

    def counting_decode(self, data, seed):
        decoded.append(data)
        return real_decode(self, data, seed)

    real_decode = TrainCrop.from_bytes
    monkeypatch.setattr(TrainCrop, "from_bytes", counting_decode)
    resumed = loader(digits_dataset)
    resumed.load_state_dict({**resumed.state_dict(), "consumed_per_slot": 160})
    take(resumed, 1)
    assert len(decoded) == GLOBAL_BATCH


def test_stream_skips_whole_shards_without_opening_them(digits_dataset, tmp_path):
    copy = tmp_path / "digits"
    shutil.copytree(digits_dataset, copy)
    rows = read_manifest(str(copy), "train")
    urls = [str(copy / r.name) for r in rows]
    ranges = [ShardRange(i, 0, r.num_samples) for i, r in enumerate(rows)]
    (copy / rows[0].name).unlink()
    stream = SampleStream(urls, ranges, start=rows[0].num_samples + 5)
    assert stream.read(want=True).key == "train_00000105"
    stream.skip(200)
    assert stream.read(want=True).key == "train_00000306"
    with pytest.raises(FileNotFoundError, match="train-000000.tar is missing"):
        SampleStream(urls, ranges).read(want=True)


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_shard_cursor_reads_what_tarfile_reads(tmp_path, tar_format, monkeypatch):
    from vitray.data.reader import ShardCursor

    # Long keys (GNU long-name members, pax path records, a ustar prefix) and data of a 512-byte
    # multiple: the cursor's own header parser must see what tarfile sees.
    keys = ["k0", "sub/" + "d" * 120 + "/k1", "e" * 90 + "/k2", "k3"]
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tar_format) as tar:
        for i, key in enumerate(keys):
            for ext, data in (("jpg", bytes([i]) * (512 * i + 7 * (i % 2))), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    expected: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            key, ext = member.name.rsplit(".", 1)
            expected.setdefault(key, {})[ext] = tar.extractfile(member).read()
    opened = []
    real_open = storage.open_file
    monkeypatch.setattr(storage, "open_file", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    cursor = ShardCursor(str(path))
    assert {r.key: r.fields for r in (cursor.read(want=True) for _ in keys)} == expected
    assert list(expected) == keys
    # Going back seeks by the member index built while reading: no second open, no walk.
    cursor.skip_to(1)
    assert cursor.read(want=True).key == keys[1] and cursor.read(want=False) is None
    assert cursor.read(want=True).key == keys[3] and len(opened) == 1
    cursor.close()


def test_a_header_with_a_signed_checksum_is_read_as_tarfile_reads_it(tmp_path):
    """Old tar writers summed a header's bytes as signed chars: a name with a byte past 127 then has
    another checksum, which tarfile accepts; the cursor took the shard for damaged and skipped it."""
    import struct

    from vitray.data.reader import ShardCursor

    info = tarfile.TarInfo("train_0\xe9.cls")
    info.size = 1
    header = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT, encoding="latin-1"))
    signed = 256 + sum(struct.unpack_from("148b8x356b", bytes(header)))
    header[148:156] = b"%06o\0 " % signed
    path = tmp_path / "signed.tar"
    path.write_bytes(bytes(header) + b"3".ljust(512, b"\0") + bytes(1024))
    assert [m.name for m in tarfile.open(path)] == ["train_0\udce9.cls"]
    cursor = ShardCursor(str(path))
    sample = cursor.read(want=True)
    assert sample is not None and sample.fields == {"cls": b"3"} and not cursor.broken
    cursor.close()


def test_incompatible_state_is_refused(digits_dataset):
    state = loader(digits_dataset).state_dict()
    with pytest.raises(ValueError, match="saved seed=3 but this loader has seed=4"):
        loader(digits_dataset, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="state is of version 3, written by a newer vitray"):
        loader(digits_dataset).load_state_dict({**state, "version": 3})


def test_a_shard_cache_of_zero_gib_is_refused_not_taken_for_the_default(digits_dataset, tmp_path):
    with pytest.raises(ValueError, match="shard_cache_gb must be positive, got 0"):
        loader(digits_dataset, shard_cache=str(tmp_path / "cache"), shard_cache_gb=0)


# ---------------------------------------------------------------- corrupt data


def damaged_dataset(tmp_path: Path) -> Path:
    """An image folder prepared with one undecodable PNG, then its last shard cut mid-member."""
    rng = np.random.default_rng(0)
    for c in range(3):
        folder = tmp_path / "src" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(20):
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(buffer, format="PNG")
            (folder / f"{i}.png").write_bytes(buffer.getvalue())
    (tmp_path / "src" / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a PNG")
    dest = tmp_path / "out"
    # "keep": stored as it is (prepare refuses it by default), so that the readers meet it.
    prepare_dataset(f"imagefolder:{tmp_path / 'src'}", str(dest), samples_per_shard=16, bad_images="keep")
    last = dest / read_manifest(str(dest), "train")[-1].name
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2 + 100])  # cuts through a member's data
    return dest


def readable_keys(dest: Path) -> set[str]:
    """Independent oracle: samples whose members tarfile can read and whose PNG Pillow decodes."""
    good = set()
    for row in read_manifest(str(dest), "train"):
        with tarfile.open(dest / row.name) as tar:
            try:
                for member in tar:
                    if member.name.endswith(".png"):
                        png = tar.extractfile(member).read()
                        try:
                            Image.open(io.BytesIO(png)).convert("RGB")
                        except OSError:
                            continue
                        pending = member.name.split(".")[0]
                    elif member.name.endswith(".cls") and member.name.split(".")[0] == pending:
                        tar.extractfile(member).read()
                        good.add(pending)
            except tarfile.ReadError:
                pass
    return good


def test_corrupt_images_and_truncated_shards_are_skipped_and_counted(tmp_path, caplog):
    dest = damaged_dataset(tmp_path)
    rows = read_manifest(str(dest), "train")
    assert sum(r.num_samples for r in rows) == 61
    expected = readable_keys(dest)
    assert 40 < len(expected) < 60
    with caplog.at_level(logging.WARNING, logger="vitray.data"):
        batches = list(EvalLoader(str(dest), "train", batch_size=10, img_size=8, num_workers=0))
    assert {k for b in batches for k in b.keys} == expected
    assert sum(b.num_skipped for b in batches) == 61 - len(expected)
    assert all(b.images.shape[0] == len(b.keys) == b.labels.shape[0] for b in batches)
    skip_warnings = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skip_warnings) == 1  # rate-limited: the first at once, the rest summarised later

    # Training: the same positions are skipped with any number of workers, and nothing is fatal.
    train = [
        ShardLoader(
            str(dest),
            "train",
            rank=0,
            world_size=1,
            batch_size=8,
            img_size=8,
            train=True,
            seed=1,
            num_slots=4,
            num_workers=w,
            shuffle_buffer=5,
        )
        for w in (0, 2)
    ]
    runs = [take(t, 2 * t.steps_per_epoch) for t in train]
    assert same_batches(*runs)
    assert [b.num_skipped for b in runs[0]] == [b.num_skipped for b in runs[1]]
    per_epoch = [sum(b.num_skipped for b in runs[0] if b.epoch == e) for e in (0, 1)]
    assert all(0 < skipped <= 61 - len(expected) for skipped in per_epoch), per_epoch  # every epoch meets them again
    assert train[0].stats["skipped"] == sum(per_epoch)
    assert {k for b in runs[0] for k in b.keys} <= expected
    assert all(len(b) == 8 - b.num_skipped for b in runs[0])


def test_skip_reporter_limits_warnings(caplog):
    reporter = SkipReporter(interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="vitray.data"):
        for i in range(50):
            reporter.skipped(f"key{i}", "bad")
    assert reporter.total == 50 and len(caplog.records) == 1


# ---------------------------------------------------------------- evaluation reader


def test_eval_loader_reads_every_sample_once_across_ranks(digits_dataset):
    per_rank = []
    for rank in range(3):
        eval_loader = EvalLoader(
            str(digits_dataset), "test", rank=rank, world_size=3, batch_size=50, img_size=8, num_workers=2
        )
        batches = list(eval_loader)
        assert len(batches) == len(eval_loader) and [b.step for b in batches] == list(range(len(batches)))
        per_rank.append([k for b in batches for k in b.keys])
    keys = [k for r in per_rank for k in r]
    assert keys == sorted(keys) and len(set(keys)) == 360  # stored order, nothing dropped or repeated
    assert [len(r) for r in per_rank] == [120, 120, 120]
    single = [
        k for b in EvalLoader(str(digits_dataset), "test", batch_size=64, img_size=8, num_workers=0) for k in b.keys
    ]
    assert single == keys


@pytest.mark.parametrize("guarded", [True, False])
def test_eval_loader_workers_do_not_run_the_callers_script_again(digits_dataset, tmp_path, guarded):
    """The forkserver's workers ran the caller's main script again as `__mp_main__`, each worker of
    every pass (more than half their time: its imports), and a script without a `__main__` guard
    started workers of its own in them (a traceback, then a 10-minute wait)."""
    ran = tmp_path / "ran"
    body = f"""
with open({str(ran)!r}, "a") as f:
    f.write("x")
from vitray.data import EvalLoader
def count():
    loader = EvalLoader({str(digits_dataset)!r}, "test", batch_size=64, img_size=8, num_workers=2)
    return [sum(len(b) for b in loader) for _ in range(2)]
"""
    main = '\nif __name__ == "__main__":\n    print(count())\n' if guarded else "\nprint(count())\n"
    (tmp_path / "evaluate.py").write_text(body + main)
    done = subprocess.run([sys.executable, str(tmp_path / "evaluate.py")], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "[360, 360]", done.stderr[-2000:]
    assert ran.read_text() == "x"  # the script ran once: in no worker of either pass


def test_load_split_decodes_a_whole_split(digits_dataset):
    split = load_split(str(digits_dataset), "test", img_size=16)
    assert split.images.shape == (360, 3, 16, 16) and split.labels.shape == (360,)
    assert split.images.dtype == torch.float32 and split.images.min() == -1.0 and split.images.max() == 1.0
    assert Counter(split.labels.tolist()).keys() == set(range(10))
    assert torch.equal(split.images[:, 0], split.images[:, 1])  # grayscale digits become RGB


def test_multi_label_batches_are_multi_hot(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    records = []
    for i in range(40):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(buffer, format="PNG")
        records.append({"image": {"bytes": buffer.getvalue(), "path": None}, "label": [i % 5, 5 + i % 3]})
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "pq" / "train-0.parquet")
    prepare_dataset(f"parquet:{tmp_path / 'pq'}", str(tmp_path / "out"), samples_per_shard=10)
    assert read_dataset_info(str(tmp_path / "out")).num_classes == 8
    batch = take(
        ShardLoader(
            str(tmp_path / "out"),
            "train",
            rank=0,
            world_size=1,
            batch_size=8,
            img_size=6,
            train=True,
            seed=0,
            num_workers=0,
        ),
        1,
    )[0]
    assert batch.labels.shape == (8, 8) and batch.labels.dtype == torch.float32
    assert torch.all(batch.labels.sum(dim=1) == 2)
    by_key = {f"train_{i:08d}": {i % 5, 5 + i % 3} for i in range(40)}
    assert all(set(torch.nonzero(row).flatten().tolist()) == by_key[k] for k, row in zip(batch.keys, batch.labels))


def test_square_eval_resize_squashes_then_crops_as_the_authors_few_shot_protocol():
    # big_vision's few-shot "resize(256)|central_crop(224)": every image squashed to 256x256.
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 256, (20, 60, 3), dtype=np.uint8))
    squashed = wide.resize((37, 37), Image.Resampling.BILINEAR)  # round(32 / 0.875) = 37
    expected = np.asarray(squashed)[2:34, 2:34]  # the central 32 of 37
    got = eval_transform(32, "square")(wide).permute(1, 2, 0).numpy()
    assert got.shape == (32, 32, 3)
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 2  # antialias kernels differ by a level or two
    kept = eval_transform(32)(wide).permute(1, 2, 0).numpy()  # the aspect-keeping default differs
    assert np.abs(kept.astype(int) - expected.astype(int)).mean() > 10
    with pytest.raises(ValueError, match=r"resize must be one of \('aspect', 'square', 'whole'\), got 'squash'"):
        eval_transform(32, "squash")
    with pytest.raises(ValueError, match="resize ratio must be at least 1"):
        eval_transform(32, "aspect", 0.9)


@pytest.mark.parametrize(
    "resize, ratio", [("aspect", 256 / 224), ("aspect", 448 / 384), ("square", 256 / 224), ("whole", 1)]
)
def test_eval_transform_gives_torchvisions_pixels(resize, ratio):
    """The evaluation transform is done with PIL alone (no torchvision in a training worker), within
    a level of what torchvision's v2.Resize (bilinear, antialiased) and v2.CenterCrop give: every
    aspect and size class (smaller than, equal to and larger than img_size; odd margins that round).
    "aspect" is big_vision's resize_small(R)|central_crop(S) for every image, small ones enlarged
    (they were squashed whole: not the authors' evaluation, and a 500x375 photo at 384 px is small)."""
    from torchvision.transforms import v2

    img_size = 32
    enlarged = round(img_size * ratio)
    reference = {
        "aspect": v2.Compose([v2.Resize(enlarged, antialias=True), v2.CenterCrop(img_size)]),
        "square": v2.Compose([v2.Resize((enlarged, enlarged), antialias=True), v2.CenterCrop(img_size)]),
        "whole": v2.Resize((img_size, img_size), antialias=True),
    }[resize]
    rng = np.random.default_rng(0)
    ours = eval_transform(img_size, resize, ratio)
    sizes = [(8, 6), (32, 32), (31, 40), (33, 33), (37, 37), (60, 20), (20, 60), (41, 97), (100, 75), (333, 500)]
    for width, height in sizes:
        for mode in ("RGB", "L", "RGBA"):  # a gray or RGBA image comes out RGB, as the loaders read it
            pixels = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
            image = Image.fromarray(pixels.squeeze(-1) if mode == "L" else pixels, mode)
            expected = v2.PILToTensor()(reference(image.convert("RGB")))
            got = ours(image)
            assert got.shape == expected.shape == (3, img_size, img_size), (width, height, mode)
            # PIL resamples only the part the crop keeps: within a level of the whole resize, cropped
            assert (got.int() - expected.int()).abs().max() <= 1, (width, height, mode)
            assert (got.int() - expected.int()).abs().float().mean() < 0.5, (
                width,
                height,
                mode,
            )  # (noise: a shift is ~80)


def test_eval_transform_resizes_small_images_and_crops_large_ones():
    small, large = Image.new("RGB", (8, 6), (255, 0, 0)), Image.new("RGB", (300, 400), (0, 0, 0))
    out = to_model_range(eval_transform(16)(small)[None])[0]
    assert out.shape == (3, 16, 16) and out[0].min() == 1.0 and out[1].max() == -1.0
    assert eval_transform(224)(large).shape == (3, 224, 224)
    assert train_transform(32)(large).shape == (3, 32, 32)


# ---------------------------------------------------------------- transient storage errors


class FlakyFileSystem(LocalFileSystem):
    """Local files behind a ``flaky://`` URL whose reads fail once per file, half way through."""

    protocol = "flaky"
    failed: set = set()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("flaky://"))

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        failed, half = self.failed, os.path.getsize(path) // 2
        real_read = f.read

        def read(size=-1):
            if path not in failed and f.tell() + (size if size >= 0 else half) >= half:
                failed.add(path)
                raise ConnectionResetError(f"simulated network failure reading {path}")
            return real_read(size)

        f.read = read
        return f


def test_transient_read_errors_are_retried_transparently(digits_dataset, monkeypatch, caplog):
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    monkeypatch.setattr(storage.retries, "RETRY_BASE_DELAY_S", 0.001)
    FlakyFileSystem.failed.clear()
    url = f"flaky://{digits_dataset}"
    with caplog.at_level(logging.WARNING, logger="vitray.data"):
        flaky = [k for b in EvalLoader(url, "test", batch_size=64, img_size=8, num_workers=0) for k in b.keys]
    read = ["dataset.json", "test.manifest.parquet", *(row.name for row in read_manifest(str(digits_dataset), "test"))]
    assert FlakyFileSystem.failed == {f"{digits_dataset}/{name}" for name in read}  # each failed once, was re-read
    assert any("reopening at sample" in r.getMessage() for r in caplog.records)
    local = [
        k for b in EvalLoader(str(digits_dataset), "test", batch_size=64, img_size=8, num_workers=0) for k in b.keys
    ]
    assert flaky == local and len(local) == 360


# ---------------------------------------------------------------- config and iteration


def test_data_config_validates():
    config = DataConfig(train="s3://bucket/digits")
    # num_slots unset: the training config derives it from the cluster (test_config.py)
    assert (config.val_path, config.val_split, config.num_slots, config.shuffle_buffer) == (
        "s3://bucket/digits",
        "test",
        None,
        512,
    )
    with pytest.raises(ValueError, match="num_slot"):
        DataConfig(train="x", num_slot=8)
    with pytest.raises(ValueError, match="greater than 0"):
        DataConfig(train="x", num_slots=0)


def test_a_new_iterator_supersedes_the_old_one(digits_dataset):
    data_loader = loader(digits_dataset)
    old = iter(data_loader)
    first = next(old)
    new = iter(data_loader)
    second = next(new)
    assert second.step == first.step + 1 and not set(first.keys) & set(second.keys)
    assert list(old) == []  # the old iterator ends instead of advancing the shared position


# ---------------------------------------------------------------- batch building (speed paths)

JPEG_COUNT, JPEG_SIZE = 96, 128  # float batches of 64 x 128 px: 12.6 MB, in BatchMemory's mappings


@pytest.fixture(scope="module")
def jpeg_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """96 real JPEGs of 150-260 px (smooth gradients plus noise, 3 classes), prepared into shards."""
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    for i in range(JPEG_COUNT):
        h, w = (int(v) for v in rng.integers(150, 260, size=2))
        ys, xs = np.mgrid[0:h, 0:w]
        pixels = np.stack([xs * 255 // w, ys * 255 // h, (xs + ys) * 127 // (h + w)], axis=-1)
        pixels = np.clip(pixels + rng.integers(-40, 40, size=pixels.shape), 0, 255).astype(np.uint8)
        path = root / "images" / f"class{i % 3}" / f"{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path, quality=85)
    prepare_dataset(f"imagefolder:{root / 'images'}", str(root / "shards"), samples_per_shard=40)
    return root / "shards"


def jpeg_loader(path: Path, *, workers: int, **kwargs) -> ShardLoader:
    return ShardLoader(
        str(path),
        "train",
        rank=0,
        world_size=1,
        batch_size=64,
        img_size=JPEG_SIZE,
        train=True,
        seed=5,
        num_slots=8,
        num_workers=workers,
        shuffle_buffer=4,
        **kwargs,
    )


def test_float_batches_are_the_uint8_batches_in_model_range_with_any_workers(jpeg_dataset):
    # 6 batches held at once: more chunks than a worker's ChunkRing has slots, so a batch that
    # still shared memory with a reused slot (or a recycled BatchMemory mapping) would change.
    floats = {w: take(jpeg_loader(jpeg_dataset, workers=w), 6) for w in (0, 2)}
    uint8 = take(jpeg_loader(jpeg_dataset, workers=1, float_images=False), 6)  # one part: no concatenation
    assert same_batches(floats[0], floats[2])
    for f, u in zip(floats[2], uint8):
        assert f.keys == u.keys and u.images.dtype == torch.uint8 and f.images.dtype == torch.float32
        assert f.images.shape == (64, 3, JPEG_SIZE, JPEG_SIZE) and f.images.is_contiguous()
        assert u.images.shape == f.images.shape and is_channels_last(u.images)  # the crops' own layout
        assert torch.equal(f.images, to_model_range(u.images))  # bit for bit
    assert uint8[0].images.float().std() > 20  # real picture content, not an empty buffer


def test_decoding_into_the_chunk_matches_the_tensor_transforms(jpeg_dataset):
    first_shard = read_manifest(str(jpeg_dataset), "train")[0].name
    stream = SampleStream([str(jpeg_dataset / first_shard)], [ShardRange(0, 0, 12)])
    raws = [stream.read(want=True) for _ in range(12)]
    seeds = list(range(100, 112))
    common = {"img_size": 48, "label_kind": "single", "num_classes": 3, "reporter": SkipReporter(), "where": "test"}

    by_plane = batch_module.decode_chunk(raws, seeds, transform=train_augment(48), **common)
    by_tensor = batch_module.decode_chunk(raws, seeds, transform=train_transform(48), **common)
    by_hand = torch.stack(
        [apply_seeded(train_transform(48), decode_image(r.fields["jpg"]), s) for r, s in zip(raws, seeds)]
    )
    assert torch.equal(by_tensor.images, by_hand)  # the PIL transforms, copied into the chunk
    # The loaders' path (TrainCrop.from_bytes: reduced JPEG decodes, torch's resize): the same
    # crops, so the same picture up to resampling (pixel noise of +-40 averages out differently).
    assert (by_plane.images.float() - by_hand.float()).abs().mean() < 6
    assert by_plane.keys == [r.key for r in raws] and by_plane.labels.tolist() == by_tensor.labels.tolist()
    evaluated = batch_module.decode_chunk(raws, [None] * 12, transform=eval_resize(48), **common)
    assert torch.equal(evaluated.images, torch.stack([eval_transform(48)(decode_image(r.fields["jpg"])) for r in raws]))

    with pytest.raises(ValueError, match=r"the transform gave a RGB \(40, 40\) image; expected RGB \(48, 48\)"):
        batch_module.decode_chunk(raws, seeds, transform=eval_resize(40), **common)
    with pytest.raises(ValueError, match=r"gave a torch.uint8 \(3, 40, 40\) tensor; expected uint8 \(3, 48, 48\)"):
        batch_module.decode_chunk(raws, seeds, transform=train_augment(40), **common)


def _jpeg(width: int, height: int, quality: int = 90) -> bytes:
    """A smooth photo-like JPEG (gradients and a few edges), not noise: what DCT scaling is for."""
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, ((xs // 37 + ys // 23) % 2) * 200], axis=-1)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def test_train_crop_draws_torchvisions_crops_from_the_sample_seed():
    from torchvision.transforms import v2

    crop, _flip = v2.RandomResizedCrop(32, scale=(0.05, 1.0), antialias=True), v2.RandomHorizontalFlip()
    train_crop = TrainCrop(32)
    for seed, (width, height) in itertools.product(range(40), [(500, 375), (40, 300), (300, 20), (7, 7)]):
        image = Image.new("RGB", (width, height))

        def torchvision_draws(_):
            params = crop.make_params([image])
            return params["top"], params["left"], params["height"], params["width"], bool(torch.rand(1) < 0.5)

        generator = torch.Generator()
        generator.manual_seed(seed)
        assert train_crop.params(width, height, generator) == apply_seeded(torchvision_draws, image, seed)
    no_flip = TrainCrop(32, flip=False).params(500, 375, torch.Generator().manual_seed(1))
    assert no_flip[:4] == train_crop.params(500, 375, torch.Generator().manual_seed(1))[:4] and not no_flip[4]


def test_train_crop_from_bytes_matches_the_pil_path_and_decodes_large_crops_reduced(monkeypatch):
    from PIL import JpegImagePlugin

    scales = []
    real_draft = JpegImagePlugin.JpegImageFile.draft

    def recording_draft(self, mode, size):
        width = self.size[0]
        result = real_draft(self, mode, size)
        scales.append(width // self.size[0])  # the reduction the decoder was set to
        return result

    train_crop, pil_path = TrainCrop(64), train_augment(64)
    # Small photos: no crop reaches 2 x 64 in both directions often enough to matter; whatever the
    # path, the pixels are PIL's to within one level (torch's uint8 antialiased resize).
    for data in (_jpeg(100, 90), _png_bytes(120, 80)):
        for seed in range(20):
            expected = torch.from_numpy(np.array(apply_seeded(pil_path, decode_image(data), seed))).permute(2, 0, 1)
            got = train_crop.from_bytes(data, seed)
            if max(train_crop.params(*decode_image(data).size, torch.Generator().manual_seed(seed))[2:4]) < 128:
                assert (got.int() - expected.int()).abs().max() <= 1, seed
    # A large photo: crops of 128+ px decode at 1/2, 1/4 or 1/8 of the size, and look the same.
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", recording_draft)
    data, reduced = _jpeg(1024, 768), 0
    for seed in range(20):
        before = len(scales)
        _top, _left, h, w, _ = train_crop.params(1024, 768, torch.Generator().manual_seed(seed))
        got = train_crop.from_bytes(data, seed)
        expected = torch.from_numpy(np.array(apply_seeded(pil_path, decode_image(data), seed))).permute(2, 0, 1)
        assert got.shape == (3, 64, 64)
        assert (got.float() - expected.float()).abs().mean() < 4, seed
        drafted = scales[before:]
        assert drafted == ([train_crop.draft_scale(w, h)] if train_crop.draft_scale(w, h) > 1 else [])
        reduced += bool(drafted)
    assert reduced >= 15  # most crops of a 1024x768 photo are 4x+ the output: decoded reduced
    assert [train_crop.draft_scale(w, h) for w, h in [(127, 500), (128, 128), (300, 260), (600, 520)]] == [1, 2, 4, 8]


def _smooth_image(width: int, height: int) -> Image.Image:
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, (xs + ys) * 255 // (width + height)], axis=-1)
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.mark.parametrize("kind", ["resmall_crop", "resize_crop"])
def test_resized_random_crops_are_big_visions_resize_then_random_crop(kind):
    """resmall_crop = resize_small(r * S) | random_crop(S); resize_crop = resize(r * S) | random_crop(S):
    each seed's box of the source, resized to S, has the pixels of the resized image's S crop at the
    same place, and the offsets spread over the whole range."""
    size, ratio = 48, 448 / 384
    train_crop = TrainCrop(size, crop=kind, flip=False)
    for width, height in [(200, 150), (90, 160), (32, 32)]:
        image = _smooth_image(width, height)
        if kind == "resmall_crop":  # the shorter side to r * S, the aspect kept
            scale = ratio * size / min(width, height)
            resized_w, resized_h = round(width * scale), round(height * scale)
        else:
            resized_w = resized_h = round(ratio * size)
        resized = np.asarray(image.resize((resized_w, resized_h), Image.Resampling.BILINEAR)).astype(int)
        tops, lefts = set(), set()
        for seed in range(60):
            top, left, h, w, flip = train_crop.params(width, height, torch.Generator().manual_seed(seed))
            assert not flip and 0 <= top <= height - h and 0 <= left <= width - w
            assert (h, w) == (
                (round(min(width, height) / ratio),) * 2
                if kind == "resmall_crop"
                else (round(height / ratio), round(width / ratio))
            )
            tops.add(top), lefts.add(left)
            at_top = min(round(top * resized_h / height), resized_h - size)
            at_left = min(round(left * resized_w / width), resized_w - size)
            mine = np.asarray(image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)))
            theirs = resized[at_top : at_top + size, at_left : at_left + size]
            # the same pixels to within the box's rounding to whole source pixels (< half a pixel:
            # the test image's gradients change by up to 8 levels a source pixel at 32 px)
            assert np.abs(mine.astype(int) - theirs).mean() < 5, (width, height, seed)
            # The loaders' path: the same box from the sample's seed, torch's resize (edges differ
            # from PIL's by a level or two where it enlarges)
            loaders = train_crop.from_bytes(_png_bytes_of(image), seed).permute(1, 2, 0).numpy().astype(int)
            assert np.abs(loaders - mine).max() <= 3 and np.abs(loaders - mine).mean() < 1
        for offsets, room in ((tops, height - h), (lefts, width - w)):  # uniform over the whole range
            assert max(offsets) <= room and max(offsets) - min(offsets) >= 0.8 * room, (width, height)


def _png_bytes_of(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_resize_takes_the_whole_image_and_every_kind_flips_only_where_asked():
    image = _smooth_image(120, 80)
    whole = TrainCrop(32, crop="resize", flip=False)
    expected = np.asarray(image.resize((32, 32), Image.Resampling.BILINEAR))
    for seed in range(5):
        assert whole.params(120, 80, torch.Generator().manual_seed(seed)) == (0, 0, 80, 120, False)
        assert (whole.from_bytes(_png_bytes_of(image), seed).permute(1, 2, 0).numpy().astype(int) - expected).max() <= 1
    for kind in ("inception_crop", "resmall_crop", "resize_crop", "resize"):
        flips = [TrainCrop(32, crop=kind).params(120, 80, torch.Generator().manual_seed(s))[4] for s in range(40)]
        assert 10 < sum(flips) < 30, kind  # a fair coin where flips are on
        assert not any(TrainCrop(32, crop=kind, flip=False).params(120, 80)[4] for _ in range(10))
    with pytest.raises(ValueError, match="crop must be one of inception_crop, resmall_crop, resize_crop, resize"):
        TrainCrop(32, crop="center")
    with pytest.raises(ValueError, match="resize_ratio must be at least 1"):
        TrainCrop(32, crop="resmall_crop", resize_ratio=0.9)


def test_the_loader_crops_as_its_crop_setting_says(digits_dataset):
    """The setting reaches the decoding workers: `resize` without flips at the images' own 8 px
    gives the stored pixels; the inception crop does not."""
    stored = {}
    for shard in sorted(digits_dataset.glob("train-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".png"):
                    image = decode_image(tar.extractfile(member).read())
                    stored[member.name[: -len(".png")]] = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    whole = take(loader(digits_dataset, workers=1, crop="resize", flip=False, float_images=False), 2)
    for batch in whole:
        for key, pixels in zip(batch.keys, batch.images):
            assert torch.equal(pixels, stored[key]), key
    cropped = take(loader(digits_dataset, workers=1, float_images=False), 1)[0]
    assert not all(torch.equal(p, stored[k]) for k, p in zip(cropped.keys, cropped.images))
    with pytest.raises(ValueError, match="crop must be one of"):
        loader(digits_dataset, crop="center")


def test_train_crop_from_bytes_reports_undecodable_images():
    from vitray.data.transforms import CorruptSample

    data = _jpeg(200, 150)
    for bad in (data[: len(data) // 2], b"not an image", data[:2] + b"\x00" * 64):
        with pytest.raises(CorruptSample, match="undecodable image"):
            TrainCrop(32).from_bytes(bad, 0)


def _png_bytes(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_worker_chunks_travel_as_ring_slots_and_labels_by_value_from_single_threaded_workers(jpeg_dataset, monkeypatch):
    def recording_decode(*args, **kwargs):
        chunk = real_decode(*args, **kwargs)
        state = f"{torch.get_num_threads()},{gc.get_freeze_count() > loader_module.FROZEN_BEFORE_VITRAY}"
        chunk.keys = [f"{key}@{state}" for key in chunk.keys]  # travels back with the chunk
        return chunk

    def recording_in_order(items, **kwargs):
        for index, chunks in real_in_order(items, **kwargs):
            received.extend((c.ring, c.images.numel(), c.labels.is_shared()) for c in chunks)
            yield index, chunks

    real_decode, real_in_order, received = loader_module.decode_chunk, loader_module.in_order, []
    monkeypatch.setattr(loader_module, "decode_chunk", recording_decode)  # forked workers inherit it
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a parent with more than one (the suite's processes run on one)
    monkeypatch.setattr(loader_module, "in_order", recording_in_order)
    try:
        batches = take(jpeg_loader(jpeg_dataset, workers=2, float_images=False), 5)
    finally:
        torch.set_num_threads(threads)
    worker_states = {key.rsplit("@", 1)[1] for b in batches for key in b.keys}
    # DataLoader workers run torch on one thread (decoding is per sample), and they were forked with
    # the parent's objects frozen, out of their garbage collections; the parent's are unfrozen.
    assert worker_states == {"1,True"} and gc.get_freeze_count() <= loader_module.FROZEN_BEFORE_VITRAY
    # Images stay in each worker's shared ring; the messages carry (worker, slot), slots in turn.
    assert [ring for ring, _, _ in received] == [(w, s % 4) for s in range(5) for w in (0, 1)]
    assert {numel for _, numel, _ in received} == {0}
    # The labels came by value, not in a shared-memory segment of their own (a file descriptor
    # handed over per chunk); they are still right (the labels match the keys' samples elsewhere).
    assert {shared for _, _, shared in received} == {False}


def test_batch_memory_is_reused_only_when_no_tensor_holds_it():
    memory = shared_memory.BatchMemory(max_regions=2)
    shape = (16, 3, 224, 224)  # 9.6 MB of float32: a pooled mapping
    small = memory.empty((2, 3, 8, 8), torch.float32)
    assert small.shape == (2, 3, 8, 8) and small.dtype == torch.float32
    first = memory.empty(shape, torch.float32)
    assert first.shape == shape and first.is_contiguous()
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return  # plain torch.empty on this platform
    assert first.data_ptr() % shared_memory.HUGE_PAGE == 0
    first.fill_(0.5)
    address = first.data_ptr()
    held_view = first[3:5].numpy()  # a numpy view of a slice keeps the memory in use
    del first
    second = memory.empty(shape, torch.float32)
    assert second.data_ptr() != address and float(held_view.sum()) == 0.5 * held_view.size
    del held_view
    assert memory.empty(shape, torch.float32).data_ptr() == address  # dropped everywhere: reused
    kept = [memory.empty(shape, torch.float32) for _ in range(3)]  # beyond max_regions: fresh ones
    assert len({t.data_ptr() for t in [second, *kept]}) == 4 and len(memory._regions) == 2
    with pytest.raises(TypeError, match="must be uint8"):
        batch_module.concat_chunks([batch_module.Chunk(second, torch.zeros(16))], epoch=0, step=0)


def test_top1_hits_single_and_multi_label():
    assert top1_hits(torch.tensor([1, 2, 0]), torch.tensor([1, 0, 0])) == (2, 3)
    # Multi-hot rows (ImageNet-ReaL): any of the labels counts; a row with none is not scored.
    labels = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert top1_hits(torch.tensor([2, 1, 0]), labels) == (1, 2)


def test_a_16_bit_grayscale_png_keeps_its_tones():
    """Pillow's convert("RGB") of a 16-bit gray PNG clips every value above 255: the image came out
    nearly all white (prepare accepts such files). Now the high byte of each value, as 8-bit decoders
    read it, for the evaluation decode and the training crop alike."""
    from vitray.data.transforms import TrainCrop, decode_image

    gray = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(gray).save(buffer, format="PNG")
    decoded = np.asarray(decode_image(buffer.getvalue()))
    assert decoded.shape == (32, 32, 3) and (decoded[..., 0] == (gray >> 8)).all()
    crop = TrainCrop(16, min_crop_area=1.0).from_bytes(buffer.getvalue(), seed=0)
    assert 100 < float(crop.float().mean()) < 155, float(crop.float().mean())  # a mid-gray ramp, not white
