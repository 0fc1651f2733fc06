"""Writers of small datasets in their real on-disk formats, for the tests of the dataset sources:
TFDS build folders (``dataset_info.json``, ``features.json``, ``LABEL.labels.txt`` and
``NAME-SPLIT.tfrecord-XXXXX-of-YYYYY`` files of ``tf.train.Example`` records, as TFDS writes them)."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vitray.data.sources.tfrecord import make_example, write_records


def png(value: int, size: int = 8, mode: str = "RGB") -> bytes:
    """A small PNG whose pixels encode ``value`` (so images can be told apart)."""
    rng = np.random.default_rng(value)
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    pixels.flat[0] = value % 256
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_tfds_build(
    folder: Path,
    name: str,
    splits: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    shards: int = 2,
    class_names: Mapping[str, Sequence[str]] | None = None,
    num_classes: Mapping[str, int] | None = None,
    file_format: str = "tfrecord",
    config: str | None = None,
) -> Path:
    """A TFDS version folder holding ``splits`` ({split: [feature dict per example]}), each split cut
    into ``shards`` tfrecord files; ``class_names`` become ``LABEL.labels.txt`` files."""
    folder.mkdir(parents=True, exist_ok=True)
    info_splits = []
    for split, examples in splits.items():
        records = [make_example(e) for e in examples]
        bounds = np.linspace(0, len(records), shards + 1).astype(int)
        lengths = []
        for i in range(shards):
            part = records[bounds[i] : bounds[i + 1]]
            write_records(str(folder / f"{name}-{split}.tfrecord-{i:05d}-of-{shards:05d}"), part)
            lengths.append(str(len(part)))
        info_splits.append(
            {
                "name": split,
                "shardLengths": lengths,
                "numBytes": str(sum(map(len, records))),
                "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
            }
        )
    info = {
        "name": name,
        "version": folder.name,
        "fileFormat": file_format,
        "splits": info_splits,
        "moduleName": f"tensorflow_datasets.image_classification.{name}",
    }
    if config:
        info["configName"] = config
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    features: dict[str, Any] = {
        "image": {
            "pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
            "image": {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "uint8", "encodingFormat": "png"},
        },
    }
    for label, count in {**{k: len(v) for k, v in (class_names or {}).items()}, **(num_classes or {})}.items():
        features[label] = {
            "pythonClassName": "tensorflow_datasets.core.features.class_label_feature.ClassLabel",
            "classLabel": {"numClasses": str(count)},
        }
    spec = {
        "pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
        "featuresDict": {"features": features},
    }
    (folder / "features.json").write_text(json.dumps(spec, indent=2))
    for label, names in (class_names or {}).items():
        (folder / f"{label}.labels.txt").write_text("\n".join(names) + "\n")
    return folder
