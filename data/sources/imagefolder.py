"""``imagefolder:PATH``: one folder per class, optionally under ``train/``, ``val/``,
``validation/``, ``test/``.

Layouts::

    PATH/CLASS/IMAGE.jpg                      -> one split, "train"
    PATH/{train,val,validation,test}/CLASS/IMAGE.jpg -> the splits that are present (every folder
                                                 of PATH a split's: a class may be called "train")
    PATH/IMAGE.jpg, PATH/{train,...}/IMAGE.jpg -> unlabelled (no class folders at all)

Classes are the sorted union of class folder names over all splits (so a class index means the
same in every split). Images may sit in nested folders under their class folder. A folder with
no class folders, only images, is an unlabelled dataset (``label_kind`` "none", for
self-supervised pre-training); its images are those directly in the (split) folder. Hidden files and
files that are not images are ignored; GIF/BMP/TIFF/WEBP images are an error (shards hold the
original PNG/JPEG bytes).

A split folder (a split's name, holding folders and no image) beside other folders is refused: read as
classes, the split's images would be labelled "train" or "val". A class called "train" that holds
its images itself (CIFAR-100, VOC) is a class.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..image_check import OTHER_FORMAT
from .base import (
    IMAGE_SUFFIXES,
    JPEG_SIGNATURE,
    PNG_SIGNATURE,
    UNSUPPORTED_IMAGE_SUFFIXES,
    Sample,
    SampleChunk,
    Source,
    image_ext,
)

log = logging.getLogger(__name__)

SPLIT_FOLDERS = ("train", "val", "validation", "test")
# The files a listing takes as samples: PNG/JPEG, and images of other formats (bad ones: `_known_bad`)
LISTED_SUFFIXES = IMAGE_SUFFIXES.keys() | UNSUPPORTED_IMAGE_SUFFIXES


class ImageFolderChunk(SampleChunk):
    def __init__(self, files: list[tuple[str, int | None]]) -> None:
        self.files = files

    def __iter__(self) -> Iterator[Sample]:
        for path, label in self.files:
            data = Path(path).read_bytes()
            yield Sample(image=data, ext=image_ext(data, path), label=label, origin=path)


class ImageFolderSource(Source):
    kind = "imagefolder"

    def __init__(
        self, root: Path, split_files: dict[str, list[tuple[str, int | None, int]]], classes: list[str]
    ) -> None:
        super().__init__(f"{self.kind}:{root}", root.name, classes, "single" if classes else "none")
        self.split_files = split_files  # split -> [(path, label or None when unlabelled, size)]

    @classmethod
    def open(cls, location: str) -> ImageFolderSource:
        root = Path(location).expanduser().resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"imagefolder source {root} is not a folder")
        # The split layout only where every folder of PATH is a split's: CIFAR-100 and VOC have a
        # class called "train", and taking such a folder for a split dropped the other classes.
        top = _class_folders(root)
        split_layout = bool(top) and set(top) <= set(SPLIT_FOLDERS)
        if not split_layout:
            _refuse_splits_beside_other_folders(root, top)
        split_roots = {s: root / s for s in SPLIT_FOLDERS if s in top} if split_layout else {"train": root}
        class_dirs = {split: _class_folders(folder) for split, folder in split_roots.items()}
        classes = sorted({name for names in class_dirs.values() for name in names})
        if not classes:
            return cls._unlabelled(root, split_roots)
        without = sorted(split for split, names in class_dirs.items() if not names)
        if without:
            raise ValueError(
                f"imagefolder source {root}: split folders {without} have no class folders but others do; "
                "use PATH/SPLIT/CLASS/IMAGE.jpg throughout (or no class folders at all for unlabelled data)"
            )
        index = {name: i for i, name in enumerate(classes)}
        left_out: list[str] = []
        split_files = {
            split: [
                (path, index[name], size)
                for name in sorted(class_dirs[split])
                for path, size in _image_files(split_roots[split] / name, left_out=left_out)
            ]
            for split in split_roots
        }
        for split, files in split_files.items():
            if not files:
                raise ValueError(f"imagefolder split {split!r} at {split_roots[split]} has no PNG/JPEG images")
        # A class without an example would shift no index but could never be learnt (torchvision
        # refuses it too).
        empty = sorted(set(classes) - {classes[label] for files in split_files.values() for _, label, _ in files})
        if empty:
            raise ValueError(
                f"imagefolder source {root}: class folder(s) {empty[:5]}{' ...' if len(empty) > 5 else ''} hold no "
                "PNG/JPEG images (an archive's __MACOSX folder?); remove them or add their images"
            )
        for folder in split_roots.values():  # images beside the class folders belong to no class
            left_out += [str(p) for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")]
        source = cls(root, split_files, classes)
        source.left_out = left_out
        source.known_bad = _known_bad(split_files)
        return source

    @classmethod
    def _unlabelled(cls, root: Path, split_roots: dict[str, Path]) -> ImageFolderSource:
        split_files: dict[str, list[tuple[str, int | None, int]]] = {}
        left_out: list[str] = []
        for split, folder in split_roots.items():
            files = [(path, None, size) for path, size in _image_files(folder, recursive=False, left_out=left_out)]
            if not files:
                raise ValueError(
                    f"imagefolder source {folder} has neither class folders (PATH/CLASS/IMAGE.jpg) nor PNG/JPEG "
                    "images (PATH/IMAGE.jpg, an unlabelled dataset)"
                )
            split_files[split] = files
        source = cls(root, split_files, [])
        source.left_out = left_out
        source.known_bad = _known_bad(split_files)
        return source

    def split_sizes(self) -> dict[str, int]:
        return {split: len(files) for split, files in self.split_files.items()}

    def sample_nbytes(self, split: str) -> np.ndarray:
        return np.array([size for _, _, size in self.split_files[split]], dtype=np.int64)

    def chunk(self, split: str, indices: Sequence[int]) -> ImageFolderChunk:
        files = self.split_files[split]
        return ImageFolderChunk([(files[i][0], files[i][1]) for i in indices])


def _known_bad(split_files: dict[str, list[tuple[str, int | None, int]]]) -> list[str]:
    """Images known to be bad from the listing, said before any shard is written, not after a pass:
    zero-byte files, and images of a format shards do not hold (shards keep the original bytes): a
    file named so whose first bytes are not a PNG's or a JPEG's (a JPEG named .webp is one)."""
    bad = []
    for path, _, size in (file for files in split_files.values() for file in files):
        suffix = os.path.splitext(path)[1].lower()
        if suffix in UNSUPPORTED_IMAGE_SUFFIXES and size and not _png_or_jpeg(path):
            bad.append(f"{path}: {OTHER_FORMAT} ({suffix})")
        elif size == 0:
            bad.append(f"{path}: empty file (0 bytes)")
    return bad


def _png_or_jpeg(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(len(PNG_SIGNATURE))
    return head.startswith((PNG_SIGNATURE, JPEG_SIGNATURE))


def _refuse_splits_beside_other_folders(root: Path, top: list[str]) -> None:
    """Split folders (a split's name, holding folders and no image) beside other folders: read as classes, the
    splits' images would train under the labels "train" and "val". A class that happens to be
    called "train" holds its images itself (CIFAR-100, VOC) and is left alone."""
    splits = [name for name in top if name in SPLIT_FOLDERS and _holds_folders_not_images(root / name)]
    if splits:
        others = [name for name in top if name not in splits]
        shown = ", ".join(others[:5]) + (f", ... ({len(others)} folders)" if len(others) > 5 else "")
        raise ValueError(
            f"imagefolder source {root} mixes split folders [{', '.join(splits)}] (holding class folders) with "
            f"other folders [{shown}]: move those out of {root}, or give one split as the source "
            f"(imagefolder:{root / splits[0]})"
        )


def _holds_folders_not_images(folder: Path) -> bool:
    entries = [e for e in os.scandir(folder) if not e.name.startswith(".")]
    images = [e for e in entries if os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES and not e.is_dir()]
    return not images and any(e.is_dir() for e in entries)


def _class_folders(folder: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def _image_files(class_dir: Path, recursive: bool = True, left_out: list[str] | None = None) -> list[tuple[str, int]]:
    """(path, size) of the images under ``class_dir`` (recursively or not), in sorted path order;
    the other files (hidden ones aside) are added to ``left_out``."""
    found = []
    top = os.path.realpath(class_dir)
    visited: set[str] = set()  # real paths: a folder linked twice is read once
    for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
        real = os.path.realpath(dirpath)
        if dirpath != str(class_dir) and (real == top or top.startswith(real + os.sep)):
            raise ValueError(
                f"{dirpath} links to {real}, which holds it: a loop that would read the images above it again "
                "(and into this class); remove the link"
            )
        if real in visited:
            dirnames[:] = []
            continue
        visited.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if recursive else []
        for name in filenames:
            suffix = os.path.splitext(name)[1].lower()
            # An image of another format is a sample, and a bad image (`_known_bad`): refused before
            # anything is written, or left out with --skip-bad, as the other unreadable ones.
            if name.startswith(".") or suffix not in LISTED_SUFFIXES:
                if left_out is not None and not name.startswith("."):
                    left_out.append(os.path.join(dirpath, name))
                continue
            path = os.path.join(dirpath, name)
            try:
                found.append((path, os.stat(path).st_size))
            except FileNotFoundError:
                if not os.path.islink(path):
                    raise
                raise ValueError(
                    f"{path} is a link to a missing file ({os.readlink(path)}): remove the link, or restore its target"
                ) from None
    found.sort()
    return found
