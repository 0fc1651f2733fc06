"""Split slices (``train[:800]``, ``train[98%:]``): parsing, resolution to per-shard extents, and
the readers on a slice -- every sample of the slice once per epoch, exact resume on another world
size, the evaluation pass -- while unsliced splits read exactly as before."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from vitray.data import (
    DataConfig,
    EvalLoader,
    ShardLoader,
    epoch_plan,
    load_split,
    parse_split,
    read_split,
    slice_bounds,
    split_extents,
)
from vitray.data.plan import ShardRange, whole_shards

DIGITS_TRAIN, DIGITS_TEST = 1437, 360  # builtin:digits, 100 samples per shard (conftest)


def keys(indices, split: str = "train") -> list[str]:
    return [f"{split}_{i:08d}" for i in indices]


def expand(extents, shard_sizes) -> list[int]:
    """Global sample indices of extents, in their order (an oracle independent of slice_extents)."""
    offsets = np.concatenate([[0], np.cumsum(shard_sizes)])
    return [int(offsets[e.shard]) + i for e in extents for i in range(e.start, e.stop)]


# ---------------------------------------------------------------- parsing and resolution


@pytest.mark.parametrize("n", [1, 7, 100, 1000, DIGITS_TRAIN])
def test_index_slices_resolve_like_python_slices(n):
    bounds = [None, 0, 1, n // 3, n - 1, n, -1, -(n // 2), -n]
    for start, stop in itertools.product(bounds, bounds):
        text = f"train[{'' if start is None else start}:{'' if stop is None else stop}]"
        expected = range(n)[slice(start, stop)]
        if len(expected) == 0:
            with pytest.raises(ValueError, match="selects no samples"):
                slice_bounds(text, n)
        else:
            assert slice_bounds(text, n) == (expected.start, expected.stop), text


@pytest.mark.parametrize("n", [101, 1000, DIGITS_TRAIN, 1_281_167])
def test_percent_slices_round_to_the_nearest_index_and_split_in_two(n):
    for pct in [1, 2, 10, 33, 50, 90, 98, 99, 99.5]:
        boundary = int(np.round(pct * n / 100))  # float arithmetic, round half to even (numpy), as TFDS
        head, tail = slice_bounds(f"train[:{pct}%]", n), slice_bounds(f"train[{pct}%:]", n)
        assert head == (0, boundary) and tail == (boundary, n)
        assert slice_bounds(f"train[-{100 - pct}%:]", n)[0] in (boundary - 1, boundary, boundary + 1)
    assert slice_bounds("train[:100%]", n) == slice_bounds("train[0%:]", n) == slice_bounds("train", n) == (0, n)


def test_extents_cover_the_slice_in_natural_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(0, 9, size=rng.integers(1, 8)).tolist()
        n = sum(sizes)
        if n == 0:
            continue
        start = int(rng.integers(0, n))
        stop = int(rng.integers(start + 1, n + 1))
        extents = split_extents(f"x[{start}:{stop}]", sizes)
        assert expand(extents, sizes) == list(range(start, stop))
        assert all(len(e) > 0 for e in extents) and [e.shard for e in extents] == sorted({e.shard for e in extents})
    # The whole split is every shard whole, empty ones included: exactly what the unsliced name reads.
    assert split_extents("x[:]", [3, 0, 4]) == split_extents("x", [3, 0, 4]) == whole_shards([3, 0, 4])
    assert split_extents("x[2:5]", [3, 0, 4]) == (ShardRange(0, 2, 3), ShardRange(2, 0, 2))


def test_disjoint_slices_together_are_their_union():
    sizes = [100] * 14 + [37]
    train800, val200 = split_extents("train[:800]", sizes), split_extents("train[800:1000]", sizes)
    assert expand(train800, sizes) + expand(val200, sizes) == expand(split_extents("train[:1000]", sizes), sizes)
    head, tail = split_extents("train[:98%]", sizes), split_extents("train[98%:]", sizes)
    assert expand(head, sizes) + expand(tail, sizes) == list(range(DIGITS_TRAIN))


@pytest.mark.parametrize(
    "text, message",
    [
        ("train[1:2:3]", "malformed"),
        ("train[1]", "malformed"),
        ("train(1:2)", "malformed"),
        ("train[:800", "malformed"),
        ("", "malformed"),
        ("train.v2", "malformed"),
        ("train[a:b]", "neither a sample index"),
        ("train[1e3:]", "neither a sample index"),
        ("train[1.5:]", "must be a whole number"),
        ("train[:101%]", "outside -100%..100%"),
    ],
)
def test_malformed_splits_say_what_is_allowed(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_split(text)
    if message == "malformed":
        assert "NAME[start:stop]" in str(error.value) and "train[:98%]" in str(error.value)


def test_out_of_range_and_empty_slices_are_errors():
    with pytest.raises(
        ValueError, match=r"index 2000 is out of range for a split of 1437 samples \(indices go from -1"
    ):
        slice_bounds("train[:2000]", DIGITS_TRAIN)
    with pytest.raises(ValueError, match="index -1500 is out of range"):
        slice_bounds("train[-1500:]", DIGITS_TRAIN)
    with pytest.raises(ValueError, match=r"'train\[5:5\]' selects no samples: it resolves to \[5:5\]"):
        slice_bounds("train[5:5]", DIGITS_TRAIN)
    with pytest.raises(ValueError, match="selects no samples"):
        slice_bounds("train[:0.01%]", DIGITS_TRAIN)  # rounds to 0
    assert slice_bounds("train", 0) == (0, 0)  # an empty split unsliced stays readable (as before)


def test_data_config_checks_split_syntax_up_front():
    config = DataConfig(train="/data", train_split="train[:98%]", val_split="train[98%:]")
    assert (config.train_split, config.val_split) == ("train[:98%]", "train[98%:]")
    with pytest.raises(ValueError, match=r"val_split\n.*malformed"):
        DataConfig(train="/data", val_split="train[98%]")


# ---------------------------------------------------------------- on prepared data


def test_read_split_resolves_against_the_manifest(digits_dataset):
    source = read_split(str(digits_dataset), "train[150:320]")
    assert source.num_samples == 170 and len(source.shard_urls) == 15
    assert source.extents == (ShardRange(1, 50, 100), ShardRange(2, 0, 100), ShardRange(3, 0, 20))
    with pytest.raises(KeyError, match=r"has no split 'trian'; it has \['test', 'train'\]"):
        read_split(str(digits_dataset), "trian[:10]")
    with pytest.raises(ValueError, match="out of range for a split of 360 samples"):
        EvalLoader(str(digits_dataset), "test[:400]", batch_size=8, img_size=8)


def test_eval_loader_reads_exactly_the_slice_across_ranks(digits_dataset):
    split = "train[150:320]"
    read = []
    for rank in range(3):
        ranked = EvalLoader(
            str(digits_dataset), split, rank=rank, world_size=3, batch_size=16, img_size=8, num_workers=0
        )
        read += [k for b in ranked for k in b.keys]
    assert read == keys(range(150, 320))
    tail = load_split(str(digits_dataset), "test[-40:]", img_size=8)
    assert tail.keys == keys(range(320, 360), "test") and tail.images.shape == (40, 3, 8, 8)
    whole = load_split(str(digits_dataset), "test", img_size=8)
    assert torch.equal(whole.images[-40:], tail.images) and torch.equal(whole.labels[-40:], tail.labels)


def sliced_loader(path, split, *, rank=0, world_size=1, batch_size=32, seed=5, workers=0) -> ShardLoader:
    return ShardLoader(
        str(path),
        split,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        img_size=8,
        train=True,
        seed=seed,
        num_slots=8,
        num_workers=workers,
        shuffle_buffer=64,
    )


def test_a_sliced_epoch_visits_every_sample_of_the_slice_once(digits_dataset):
    split = "train[100:740]"  # 640 samples: 8 slots of 80, 20 batches of 32, nothing dropped
    plan = epoch_plan(5, 0, read_split(str(digits_dataset), split).extents, 8)
    planned = sorted(expand([r for slot in plan.slots for r in slot], [100] * 14 + [37]))
    assert plan.dropped == 0 and planned == list(range(100, 740))
    data = sliced_loader(digits_dataset, split)
    assert data.steps_per_epoch == 20 and data.state_dict()["num_samples"] == 640
    epochs = [list(itertools.islice(data, 20)) for _ in range(2)]
    for batches in epochs:
        seen = [k for b in batches for k in b.keys]
        assert sorted(seen) == keys(range(100, 740))
    assert [k for b in epochs[0] for k in b.keys] != [k for b in epochs[1] for k in b.keys]  # reshuffled


def test_unsliced_and_whole_slices_read_the_same_batches(digits_dataset):
    reference = list(itertools.islice(sliced_loader(digits_dataset, "train"), 3))
    for split in ("train[:]", "train[0:100%]", f"train[-{DIGITS_TRAIN}:]"):
        same = list(itertools.islice(sliced_loader(digits_dataset, split), 3))
        assert [b.keys for b in same] == [b.keys for b in reference]
        assert all(torch.equal(a.images, b.images) for a, b in zip(same, reference))
    assert epoch_plan(5, 1, [100] * 14 + [37], 8) == epoch_plan(5, 1, whole_shards([100] * 14 + [37]), 8)


def test_resume_on_a_slice_from_two_ranks_to_one(digits_dataset):
    split = "train[:90%]"  # 1293 samples: 161 per slot, 5 dropped each epoch
    total_steps, cut = 45, 17  # crosses the epoch boundary at step 40

    def run(world_size, steps, state=None):
        ranks = [
            sliced_loader(digits_dataset, split, rank=r, world_size=world_size, batch_size=32 // world_size)
            for r in range(world_size)
        ]
        for rank_loader in ranks:
            if state:
                rank_loader.load_state_dict(state)
        per_rank = [list(itertools.islice(r, steps)) for r in ranks]
        return [sorted(k for r in per_rank for k in r[s].keys) for s in range(steps)], ranks[0].state_dict()

    reference, _ = run(1, total_steps)
    before, state = run(2, cut)
    assert state["num_samples"] == 1293 and state["consumed_per_slot"] == cut * 4
    after, _ = run(1, total_steps - cut, state)
    assert before + after == reference
    first_epoch = [k for step in reference[:40] for k in step]
    assert len(set(first_epoch)) == len(first_epoch) and set(first_epoch) <= set(keys(range(1293)))
    with pytest.raises(ValueError, match="saved num_samples=1293 but this loader has num_samples=1437"):
        sliced_loader(digits_dataset, "train").load_state_dict(state)


def test_eval_loader_reads_only_the_given_positions_of_a_slice(digits_dataset):
    wanted = [0, 1, 99, 100, 199]  # positions in the slice: samples 100, 101, 199, 200, 299
    read = []
    for rank in range(2):
        ranked = EvalLoader(
            str(digits_dataset),
            "train[100:300]",
            rank=rank,
            world_size=2,
            batch_size=2,
            img_size=8,
            num_workers=1,
            indices=wanted,
        )
        read += [k for b in ranked for k in b.keys]
    assert read == keys([100, 101, 199, 200, 299])
    with pytest.raises(ValueError, match="strictly increasing"):
        EvalLoader(str(digits_dataset), "train", batch_size=2, img_size=8, indices=[5, 3])
    with pytest.raises(ValueError, match=r"must lie in \[0, 200\)"):
        EvalLoader(str(digits_dataset), "train[100:300]", batch_size=2, img_size=8, indices=[0, 200])
