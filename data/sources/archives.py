"""The original archives of two of the paper's benchmarks, read as distributed (nothing extracted):

``pets:DIR`` -- Oxford-IIIT Pets: ``DIR/images.tar.gz`` (``images/NAME.jpg``) and
``DIR/annotations.tar.gz`` (``annotations/trainval.txt`` and ``annotations/test.txt``, lines
``NAME CLASS_ID SPECIES BREED_ID`` with CLASS_ID 1..37). Splits ``train`` (trainval, 3,680 images)
and ``test`` (3,669), as TFDS ``oxford_iiit_pet`` has them; label CLASS_ID - 1; class names are the
breed part of the image names (``Abyssinian_100`` -> ``Abyssinian``), in CLASS_ID order.

``flowers102:DIR`` -- Oxford Flowers-102: ``DIR/102flowers.tgz`` (``jpg/image_00001.jpg`` ...),
``DIR/imagelabels.mat`` (``labels``, 1..102 per image) and ``DIR/setid.mat`` (``trnid``,
``valid``, ``tstid``: 1-based image numbers). Splits ``train`` (1,020), ``validation`` (1,020) and
``test`` (6,149), as TFDS ``oxford_flowers102``; label - 1; classes are numbered (the archive has
no names).

Each shard's chunk streams the image archive once and keeps the images it needs, so preparing costs
one pass over the archive per shard.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .base import Sample, SampleChunk, Source, image_ext


class ArchiveChunk(SampleChunk):
    """The members ``{name: label}`` of the tar archive ``path``, in the order of ``members`` (the
    shard's planned, shuffled order: a sample's key is its planned position)."""

    def __init__(self, path: str, members: dict[str, int]) -> None:
        self.path, self.members = path, members

    def __iter__(self) -> Iterator[Sample]:
        # The archive is read once, in its own order (streamed: gzip has no random access); a member
        # met before its turn waits in memory (a shard's worth at most). In archive order -- often
        # class by class -- a shard's samples, and so the held-out tail of a split (`train[90%:]`),
        # were runs of a few classes.
        order, turn = list(self.members), 0
        waiting: dict[str, Sample] = {}
        read: set[str] = set()  # a name met twice in the archive: its first copy counts
        with tarfile.open(self.path, "r|*") as archive:
            for member in archive:
                label = self.members.get(member.name)
                if label is None or not member.isfile() or member.name in read:
                    continue
                read.add(member.name)
                data = archive.extractfile(member).read()
                waiting[member.name] = Sample(
                    data, image_ext(data, member.name), label, origin=f"{self.path}:{member.name}"
                )
                while turn < len(order) and order[turn] in waiting:
                    yield waiting.pop(order[turn])
                    turn += 1
                if turn == len(order):
                    return
        missing = sorted(set(order) - read)
        raise FileNotFoundError(f"{self.path} lacks {len(missing)} of the images listed, e.g. {missing[:3]}")


class _ArchiveSource(Source):
    """A source of (archive member, label) lists per split."""

    def __init__(
        self,
        spec: str,
        name: str,
        classes: list[str],
        archive: Path,
        splits: dict[str, list[tuple[str, int]]],
        sizes: dict[str, int],
    ) -> None:
        super().__init__(spec, name, classes, "single")
        self.archive, self.splits, self.sizes = archive, splits, sizes

    def split_sizes(self) -> dict[str, int]:
        return {split: len(items) for split, items in self.splits.items()}

    def sample_nbytes(self, split: str) -> np.ndarray:
        return np.array([self.sizes.get(name, 0) for name, _ in self.splits[split]], dtype=np.int64)

    def chunk(self, split: str, indices: Sequence[int]) -> ArchiveChunk:
        items = self.splits[split]
        return ArchiveChunk(str(self.archive), {items[i][0]: items[i][1] for i in indices})


def _require(folder: Path, names: Sequence[str], kind: str, hint: str) -> None:
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{kind} source {folder} lacks {missing}; expected {list(names)} ({hint})")


def _member_sizes(path: Path) -> dict[str, int]:
    """Member name -> size, from one streamed pass over the archive's headers."""
    with tarfile.open(path, "r|*") as archive:
        return {m.name: m.size for m in archive if m.isfile()}


# ---------------------------------------------------------------------------------------------
# Oxford-IIIT Pets
# ---------------------------------------------------------------------------------------------

_PETS_LINE = re.compile(r"^(?P<name>\S+)\s+(?P<class_id>\d+)\s+\d+\s+\d+$")


class PetsSource(_ArchiveSource):
    kind = "pets"
    files = ("images.tar.gz", "annotations.tar.gz")

    @classmethod
    def open(cls, location: str) -> PetsSource:
        folder = Path(location).expanduser().resolve()
        _require(folder, cls.files, cls.kind, "the two archives from the Oxford-IIIT Pets site")
        lists = {}
        with tarfile.open(folder / "annotations.tar.gz", "r:*") as archive:
            for split, member in (("train", "annotations/trainval.txt"), ("test", "annotations/test.txt")):
                try:
                    lists[split] = archive.extractfile(member).read().decode()
                except (KeyError, AttributeError):
                    raise FileNotFoundError(f"{folder / 'annotations.tar.gz'} has no {member}") from None
        splits: dict[str, list[tuple[str, int]]] = {}
        breeds: dict[int, str] = {}
        for split, text in lists.items():
            items = []
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip() or line.startswith("#"):
                    continue
                match = _PETS_LINE.match(line.strip())
                if not match:
                    raise ValueError(
                        f"annotations/{split} line {number}: {line!r} is not 'NAME CLASS_ID SPECIES BREED_ID'"
                    )
                class_id = int(match["class_id"])
                breeds.setdefault(class_id, match["name"].rsplit("_", 1)[0])
                items.append((f"images/{match['name']}.jpg", class_id - 1))
            splits[split] = items
        if sorted(breeds) != list(range(1, len(breeds) + 1)):
            raise ValueError(f"{folder}: class ids {sorted(breeds)[:5]}... are not 1..{len(breeds)}")
        classes = [breeds[i] for i in range(1, len(breeds) + 1)]
        archive = folder / "images.tar.gz"
        return cls(f"{cls.kind}:{folder}", "oxford_iiit_pet", classes, archive, splits, _member_sizes(archive))


# ---------------------------------------------------------------------------------------------
# Oxford Flowers-102
# ---------------------------------------------------------------------------------------------


class Flowers102Source(_ArchiveSource):
    kind = "flowers102"
    files = ("102flowers.tgz", "imagelabels.mat", "setid.mat")

    @classmethod
    def open(cls, location: str) -> Flowers102Source:
        from scipy.io import loadmat  # only this source reads MATLAB files

        folder = Path(location).expanduser().resolve()
        _require(folder, cls.files, cls.kind, "the files of the Oxford Flowers-102 site")
        labels = np.asarray(loadmat(folder / "imagelabels.mat").get("labels", np.zeros(0))).ravel().astype(int)
        setid = loadmat(folder / "setid.mat")
        if not len(labels) or labels.min() < 1:
            raise ValueError(f"{folder / 'imagelabels.mat'}: 'labels' must hold a class 1..102 for every image")
        splits = {}
        for split, key in (("train", "trnid"), ("validation", "valid"), ("test", "tstid")):
            if key not in setid:
                raise ValueError(f"{folder / 'setid.mat'} has no {key!r} (expected trnid, valid, tstid)")
            ids = np.asarray(setid[key]).ravel().astype(int)
            if ids.min() < 1 or ids.max() > len(labels):
                raise ValueError(f"{folder / 'setid.mat'}: {key} holds image numbers outside 1..{len(labels)}")
            splits[split] = [(f"jpg/image_{i:05d}.jpg", int(labels[i - 1]) - 1) for i in ids]
        classes = [str(i) for i in range(int(labels.max()))]
        archive = folder / "102flowers.tgz"
        return cls(f"{cls.kind}:{folder}", "oxford_flowers102", classes, archive, splits, _member_sizes(archive))
