"""``hf:PATH``: a Hugging Face dataset saved as Parquet (a hub repository's files, or ``to_parquet``).

PATH is the dataset's folder (e.g. a ``huggingface-cli download --repo-type dataset`` copy), searched
recursively for ``SPLIT-*.parquet`` / ``SPLIT.parquet`` files, as :mod:`vitray.data.sources.parquet`
reads them. Unlike ``parquet:``, the columns need not be called ``image`` and ``label``:

- ``hf:PATH?image=img&label=fine_label`` names them;
- otherwise they are read from the dataset card's features (``README.md``'s YAML header,
  ``dataset_info.features``): the one ``image`` feature and the one ``class_label`` feature
  (a card with several, such as CIFAR-100's ``fine_label`` and ``coarse_label``, needs ``label=``).

The splits are named by the files (``validation-00000-of-00014.parquet`` is split ``validation``);
``hf:PATH?split=validation:val`` renames one (ImageNet's validation set as the benchmark's ``val``).

Class names come from the Parquet schema's ``huggingface`` metadata, else from the card's
``class_label.names``, else they are numbered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import yaml

from .parquet import ParquetSource

CARD = "README.md"


def read_card_features(root: Path) -> list[dict[str, Any]]:
    """The ``dataset_info.features`` list of the dataset card under ``root`` ([] without a card)."""
    card = root / CARD if root.is_dir() else root.parent / CARD
    if not card.is_file():
        return []
    text = card.read_text(encoding="utf-8")
    if not text.startswith("---"):
        return []
    header = text.split("---", 2)[1]
    try:
        meta = yaml.safe_load(header) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{card}: the YAML header of the dataset card does not parse: {error}") from None
    info = meta.get("dataset_info") or {}
    if isinstance(info, list):  # one entry per config: the "default" one, else the first
        info = next((i for i in info if i.get("config_name") == "default"), info[0] if info else {})
    features = info.get("features") or []
    return [f for f in features if isinstance(f, dict) and "name" in f]


def _is_image(feature: dict[str, Any]) -> bool:
    return feature.get("dtype") == "image"


def _class_label(feature: dict[str, Any]) -> dict[str, Any] | None:
    dtype = feature.get("dtype")
    return dtype.get("class_label") if isinstance(dtype, dict) and "class_label" in dtype else None


def _is_class_label(feature: dict[str, Any]) -> bool:
    return _class_label(feature) is not None


def _card_names(feature: dict[str, Any] | None) -> list[str] | None:
    label = _class_label(feature or {}) or {}
    names = label.get("names")
    if isinstance(names, dict):  # {'0': cat, '1': dog}
        return [str(names[k]) for k in sorted(names, key=lambda k: int(k))]
    return [str(n) for n in names] if isinstance(names, list) else None


class HfSource(ParquetSource):
    kind = "hf"

    @classmethod
    def open(cls, location: str) -> HfSource:
        path, _, query = location.partition("?")
        values = parse_qs(query)
        options = {k: v[-1] for k, v in values.items()}
        unknown = sorted(set(options) - {"image", "label", "split"})
        if unknown:
            raise ValueError(
                f"hf source options {unknown} are not known; allowed: image=COLUMN, label=COLUMN, split=SPLIT:NAME"
            )
        root = Path(path).expanduser().resolve()
        if not root.exists():
            raise FileNotFoundError(f"hf source {root} does not exist")
        features = read_card_features(root)
        image = options.get("image") or _pick(features, _is_image, "image", "image", root)
        label = options.get("label") or _pick(features, _is_class_label, "class_label", "label", root)
        card_feature = next((f for f in features if f["name"] == label), None)
        # The spec recorded with the dataset names the folder resolved, as the other sources do: a relative
        # path typed elsewhere must not read as another (or the same) source.
        spec = f"{cls.kind}:{root}" + (f"?{query}" if query else "")
        return cls.from_files(
            root, (image, label), _card_names(card_feature), spec, split_options=values.get("split", [])
        )


def _pick(features: list[dict[str, Any]], want: Any, what: str, default: str, root: Path) -> str:
    """The one card feature of kind `what`, or `default` when the card names none."""
    found = [f["name"] for f in features if want(f)]
    if len(found) > 1:
        option = "image" if what == "image" else "label"
        raise ValueError(
            f"hf source {root}: the dataset card has several {what} features {found}; "
            f"choose one with hf:{root}?{option}=COLUMN"
        )
    return found[0] if found else default
