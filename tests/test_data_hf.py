"""``hf:PATH``: Hugging Face datasets saved as Parquet (hub layout: ``data/SPLIT-XXXXX-of-YYYYY.parquet``
and a dataset card), with the image and label columns named by flags or read from the card."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tfds_helpers import png

from vitray.data import prepare_dataset, read_labels
from vitray.data.sources import open_source

CARD = """---
license: unknown
dataset_info:
  features:
  - name: img
    dtype: image
  - name: fine_label
    dtype:
      class_label:
        names:
          '0': apple
          '1': bear
          '2': castle
  - name: coarse_label
    dtype:
      class_label:
        names:
          '0': fruit
          '1': other
  splits:
  - name: train
    num_examples: 11
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
# A CIFAR-100-shaped dataset
"""


def _table(first: int, count: int, *, metadata: dict | None = None) -> pa.Table:
    rows = range(first, first + count)
    table = pa.table(
        {
            "img": [{"bytes": png(i), "path": f"{i}.png"} for i in rows],
            "fine_label": [i % 3 for i in rows],
            "coarse_label": [int(i % 3 == 0) for i in rows],
        }
    )
    return table.replace_schema_metadata(metadata) if metadata else table


def _hub_copy(root: Path, card: str = CARD) -> Path:
    (root / "data").mkdir(parents=True)
    pq.write_table(_table(0, 6), root / "data" / "train-00000-of-00002.parquet")
    pq.write_table(_table(6, 5), root / "data" / "train-00001-of-00002.parquet")
    pq.write_table(_table(100, 4), root / "data" / "test-00000-of-00001.parquet")
    (root / "README.md").write_text(card)
    return root


def test_hf_columns_and_class_names_come_from_the_card(tmp_path):
    root = _hub_copy(tmp_path / "cifar100-like")
    with pytest.raises(
        ValueError, match=r"several class_label features \['fine_label', 'coarse_label'\].*label=COLUMN"
    ):
        open_source(f"hf:{root}")
    source = open_source(f"hf:{root}?label=fine_label")
    assert source.classes == ["apple", "bear", "castle"] and source.label_kind == "single"
    assert source.split_sizes() == {"train": 11, "test": 4}
    prepare_dataset(source, str(tmp_path / "out"), samples_per_shard=4)
    assert read_labels(str(tmp_path / "out"), "train")[1].tolist() == [i % 3 for i in range(11)]
    assert read_labels(str(tmp_path / "out"), "test")[1].tolist() == [i % 3 for i in range(100, 104)]
    coarse = open_source(f"hf:{root}?label=coarse_label")
    assert coarse.classes == ["fruit", "other"]


def test_hf_flags_without_a_card_and_schema_metadata_names(tmp_path, monkeypatch):
    root = tmp_path / "plain"
    root.mkdir()
    features = {
        "info": {
            "features": {"img": {"_type": "Image"}, "fine_label": {"_type": "ClassLabel", "names": ["a", "b", "c"]}}
        }
    }
    pq.write_table(_table(0, 5, metadata={b"huggingface": json.dumps(features).encode()}), root / "train.parquet")
    with pytest.raises(ValueError, match=r"expected columns 'image'.*found \['img', 'fine_label', 'coarse_label'\]"):
        open_source(f"hf:{root}")
    source = open_source(f"hf:{root}?image=img&label=fine_label")
    assert source.classes == ["a", "b", "c"] and source.split_sizes() == {"train": 5}
    assert [s.label for s in source.chunk("train", range(5))] == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="allowed: image=COLUMN, label=COLUMN"):
        open_source(f"hf:{root}?column=img")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(f"hf:{tmp_path / 'nowhere'}")
    # The spec a dataset records names the folder resolved (a relative path from elsewhere is another one).
    monkeypatch.chdir(root.parent)
    relative = open_source(f"hf:{root.name}?image=img&label=fine_label")
    assert relative.spec == f"hf:{root}?image=img&label=fine_label"


def test_hf_split_option_renames_a_split_as_the_benchmarks_read_it(tmp_path):
    """ImageNet on the hub names its validation files `validation-*.parquet`; the benchmark reads
    `val`: `?split=validation:val` renames it (as `tfds:` does), and a mistyped or clashing rename is
    refused naming the splits there are."""
    root = _hub_copy(tmp_path / "hub")
    (root / "data" / "test-00000-of-00001.parquet").rename(root / "data" / "validation-00000-of-00001.parquet")
    source = open_source(f"hf:{root}?label=fine_label&split=validation:val")
    assert source.split_sizes() == {"train": 11, "val": 4}
    info = prepare_dataset(source, str(tmp_path / "out"), samples_per_shard=4)
    assert sorted(info.splits) == ["train", "val"]
    assert read_labels(str(tmp_path / "out"), "val")[1].tolist() == [i % 3 for i in range(100, 104)]
    assert open_source(f"hf:{root}?label=fine_label&split=validation:val,train:pretrain").split_sizes() == {
        "pretrain": 11,
        "val": 4,
    }
    with pytest.raises(
        ValueError, match=r"split='valid:val' is not SPLIT:NAME with SPLIT one of \['train', 'validation'\]"
    ):
        open_source(f"hf:{root}?label=fine_label&split=valid:val")
    with pytest.raises(ValueError, match=r"split='validation:train': the source already has a split 'train'"):
        open_source(f"hf:{root}?label=fine_label&split=validation:train")
    with pytest.raises(ValueError, match="split name 'v-al'.*letters, digits and _ only"):
        open_source(f"hf:{root}?label=fine_label&split=validation:v-al")
