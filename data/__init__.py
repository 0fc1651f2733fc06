"""vitray.data: dataset sources, shard writing, the epoch plan and the resumable readers.

Prepare once, read anywhere::

    from vitray.data import prepare_dataset, ShardLoader, EvalLoader

    prepare_dataset("builtin:digits", "/tmp/digits")              # or s3://bucket/digits
    loader = ShardLoader("/tmp/digits", "train", rank=0, world_size=1, batch_size=64,
                         img_size=32, train=True, seed=0)
    for batch in loader:                                          # endless; batch.images, .labels
        ...
    state = loader.state_dict()                                   # resume with load_state_dict

Split arguments may slice a split, TFDS style: ``"train[:98%]"``, ``"train[800:1000]"`` (see
:mod:`vitray.data.splits`).

The rooms of this package:

- write side (``vitray data prepare``): :mod:`.sources` (one sub-package: the registry, the shared
  types in :mod:`.sources.base`, one module per source format), :mod:`.prepare`, :mod:`.shards`,
  :mod:`.image_check`, :mod:`.shard_progress` (the bar, or plain lines in a log);
- checking a prepared dataset against its manifests (``vitray data verify``): :mod:`.verify`;
- what both sides agree on: :mod:`.layout` (``dataset.json``, shard names, manifests),
  :mod:`.splits`, :mod:`.config`;
- read side (training and evaluation workers): :mod:`.plan` (the epoch plan), :mod:`.slots`,
  :mod:`.reader`, :mod:`.loader` (:class:`ShardLoader`), :mod:`.batch`, :mod:`.shared_memory`,
  :mod:`.transforms`, :mod:`.model_range`, :mod:`.eval_loader` (:class:`EvalLoader`). It never imports the write side
  (tests/test_architecture.py checks it), so a worker that reads shards does not load the sources.

Every path is read and written through :mod:`vitray.storage` (fsspec), the one other vitray
package this one imports; it never imports ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> module. Imported on first use: preparing shards (e.g. in a Ray task) then does not
# pay for importing torch and torchvision, which only the readers need.
_EXPORTS = {
    "Batch": "batch",
    "DataConfig": "config",
    "StoragePath": "config",
    "EvalLoader": "eval_loader",
    "load_split": "eval_loader",
    "read_labels": "eval_loader",
    "top1_hits": "eval_loader",
    "DatasetInfo": "layout",
    "ManifestRow": "layout",
    "ResolvedSplit": "layout",
    "SplitInfo": "layout",
    "dataset_digest": "layout",
    "read_dataset_info": "layout",
    "read_manifest": "layout",
    "read_split": "layout",
    "ShardLoader": "loader",
    "EpochPlan": "plan",
    "ShardRange": "plan",
    "epoch_plan": "plan",
    "rank_slots": "plan",
    "DestinationNotEmpty": "prepare",
    "SourceChanged": "prepare",
    "Preparation": "prepare",
    "begin_prepare": "prepare",
    "check_destination": "prepare",
    "check_unchanged": "prepare",
    "finalize": "prepare",
    "prepare_dataset": "prepare",
    "opened": "prepare",
    "refuse_known_bad": "prepare",
    "settle_bad_images": "prepare",
    "start_preparation": "prepare",
    "write_shard_recorded": "prepare_resume",
    "DEFAULT_MAX_SHARD_BYTES": "shards",
    "DEFAULT_SAMPLES_PER_SHARD": "shards",
    "BadImagesError": "shards",
    "ShardResult": "shards",
    "ShardTask": "shards",
    "plan_shards": "shards",
    "write_shard": "shards",
    "write_shard_checked": "shards",
    "SPLIT_SYNTAX": "splits",
    "SplitSpec": "splits",
    "parse_split": "splits",
    "slice_bounds": "splits",
    "split_extents": "splits",
    "Source": "sources",
    "open_source": "sources",
    "eval_transform": "transforms",
    "train_transform": "transforms",
    "to_model_range": "model_range",
    "Verified": "verify",
    "verify_dataset": "verify",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .batch import Batch
    from .config import DataConfig
    from .eval_loader import EvalLoader, load_split, read_labels, top1_hits
    from .layout import (
        DatasetInfo,
        ManifestRow,
        ResolvedSplit,
        SplitInfo,
        dataset_digest,
        read_dataset_info,
        read_manifest,
        read_split,
    )
    from .loader import ShardLoader
    from .model_range import to_model_range
    from .plan import EpochPlan, ShardRange, epoch_plan, rank_slots
    from .prepare import (
        DestinationNotEmpty,
        Preparation,
        SourceChanged,
        begin_prepare,
        check_destination,
        check_unchanged,
        finalize,
        opened,
        prepare_dataset,
        refuse_known_bad,
        settle_bad_images,
        start_preparation,
    )
    from .prepare_resume import write_shard_recorded
    from .shards import (
        DEFAULT_MAX_SHARD_BYTES,
        DEFAULT_SAMPLES_PER_SHARD,
        BadImagesError,
        ShardResult,
        ShardTask,
        plan_shards,
        write_shard,
        write_shard_checked,
    )
    from .sources import Source, open_source
    from .splits import SPLIT_SYNTAX, SplitSpec, parse_split, slice_bounds, split_extents
    from .transforms import eval_transform, train_transform
    from .verify import Verified, verify_dataset


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
