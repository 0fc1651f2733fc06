"""The files of a DeepSpeed checkpoint a rank reads to resume, and the universal conversion that
lets a run resume on another number of workers.

Light on purpose: the driver (`prepare_resume`) and the restore-file selection run where DeepSpeed
is not imported; only the conversion itself imports it, inside `to_universal`.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import fsspec

from vitray import storage
from vitray.runfolder.derived_weights import DEEPSPEED_SUBDIR as CHECKPOINT_SUBDIR
from vitray.runfolder.derived_weights import DEEPSPEED_TAG as CHECKPOINT_TAG


def to_universal(checkpoint_dir: Path, out_dir: Path) -> Path:
    """Convert a checkpoint's DeepSpeed shards to the universal (world-size free) layout.

    Used when a run resumes on a different number of workers; the global batch is unchanged,
    only the partitioning of the optimizer state moves.
    """
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = out_dir / UNIVERSAL_SUBDIR
    args = argparse.Namespace(
        input_folder=str(checkpoint_dir / CHECKPOINT_SUBDIR / CHECKPOINT_TAG),
        output_folder=str(target),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal(args)
    return target


def restore_files(rank: int, world_size: int, zero_stage: int):
    """The checkpoint files rank `rank` of `world_size` reads to resume (a `checkpoint.FileSelector`):
    the trainer state and EMA weights, the module states every rank loads (ZeRO 0-2) and this
    rank's own shards -- not the other ranks' optimizer shards, nor `model.safetensors` (the
    consolidated copy for users). A checkpoint of another world size is read whole, with the shared
    universal conversion (`shared_universal`), which every rank loads."""
    own = re.compile(rf"(^|_)zero_pp_rank_{rank}_")

    def select(state: dict[str, Any], names: list[str]) -> list[str] | None:
        if state.get("backend", "deepspeed") != "deepspeed" or (state["world_size"] != world_size and zero_stage > 0):
            return None
        picked = []
        for name in names:
            base = name.rsplit("/", 1)[-1]
            if name.startswith(f"{CHECKPOINT_SUBDIR}/"):
                if "zero_pp_rank_" not in base or own.search(base):
                    picked.append(name)
            elif base != "model.safetensors":
                picked.append(name)
        return picked

    return select


UNIVERSAL_SUBDIR = f"{CHECKPOINT_TAG}_universal"  # under <checkpoint>/deepspeed/, next to the shards
UNIVERSAL_RECORD = "complete.json"  # written last: file name -> size of the whole conversion


def shared_universal(checkpoint: str) -> str:
    """Convert a checkpoint's shards to DeepSpeed's universal layout once, into the checkpoint
    folder itself (`deepspeed/state_universal/`), for a resume onto another number of workers:
    the driver calls it before starting them, and every rank loads the shared conversion instead
    of each converting the whole checkpoint itself. Returns the universal folder's path.

    Already there (an earlier resume) means nothing to do. The conversion runs in a local scratch
    folder, its files are uploaded (sizes checked), and a record listing them is written last, so
    a conversion cut short is never taken for a whole one (`universal_ready`)."""
    fs, root = storage.filesystem(checkpoint)
    root = root.rstrip("/")
    shared = storage.join(checkpoint.rstrip("/"), CHECKPOINT_SUBDIR, UNIVERSAL_SUBDIR)
    if _universal_record(fs, f"{root}/{CHECKPOINT_SUBDIR}/{UNIVERSAL_SUBDIR}") is not None:
        return shared
    with tempfile.TemporaryDirectory(prefix="vitray-universal-") as scratch:
        local = Path(scratch) / "checkpoint"
        shards = local / CHECKPOINT_SUBDIR / CHECKPOINT_TAG
        shards.mkdir(parents=True)
        fs.get(f"{root}/{CHECKPOINT_SUBDIR}/{CHECKPOINT_TAG}/", str(shards) + "/", recursive=True)
        out = to_universal(local, Path(scratch) / "out")
        listing = {}
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            name = path.relative_to(out).as_posix()
            storage.upload_file(str(path), storage.join(shared, name))
            listing[name] = path.stat().st_size
    storage.write_bytes_atomic(
        storage.join(shared, UNIVERSAL_RECORD), json.dumps(listing, indent=1, sort_keys=True).encode()
    )
    return shared


def _universal_record(fs, folder: str) -> dict[str, int] | None:
    """The conversion's record when every file it lists is there whole, else None."""
    try:
        with fs.open(f"{folder}/{UNIVERSAL_RECORD}", "r") as f:
            listing = json.load(f)
        sizes = {info["name"].rstrip("/"): info["size"] for info in fs.find(folder, detail=True).values()}
    except (OSError, ValueError):
        return None
    prefix = fs._strip_protocol(folder).rstrip("/")
    return listing if all(sizes.get(f"{prefix}/{name}") == size for name, size in listing.items()) else None


def universal_ready(checkpoint_dir: Path) -> Path | None:
    """The shared conversion in a local copy of a checkpoint folder, when it is whole."""
    folder = checkpoint_dir / CHECKPOINT_SUBDIR / UNIVERSAL_SUBDIR
    return folder if _universal_record(fsspec.filesystem("file"), str(folder)) is not None else None
