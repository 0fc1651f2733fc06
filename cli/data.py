"""`vitray data prepare` and `vitray data verify`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vitray.cli.app import console, data_app, fail, handled
from vitray.common import exit_codes
from vitray.common.redact import redact_text


def plural(count: int, noun: str, many: str = "") -> str:
    """ "1 shard", "2 shards"; "1 class", "10 classes", "1,437 samples" (``many`` when not noun + "s")."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"


@data_app.command("prepare")
def data_prepare(
    source: Annotated[
        str,
        typer.Argument(
            help="imagefolder:PATH | cifar10:PATH | cifar100:PATH | parquet:PATH | "
            "hf:PATH[?image=COL&label=COL&split=FROM:TO] | tfds:DATA_DIR/NAME/VERSION[?split=FROM:TO] | vtab:TASK:DATA_DIR/NAME/VERSION | webdataset:PATH[?image=EXT&label=EXT&split=FROM:TO] | pets:DIR | flowers102:DIR | builtin:digits | "
            "unlabelled:SOURCE (any of these, its labels dropped)"
        ),
    ],
    dest: Annotated[str, typer.Argument(help="Output folder: a local path or s3://bucket/prefix.")],
    samples_per_shard: Annotated[int, typer.Option(help="Samples per tar shard.", min=1)] = 1000,
    overwrite: Annotated[
        bool, typer.Option(help="Redo a prepared destination, or write into a non-empty folder that is not a dataset.")
    ] = False,
    skip_bad: Annotated[
        bool,
        typer.Option("--skip-bad", help="Leave zero-byte, undecodable and too large images out (refused otherwise)."),
    ] = False,
    address: Annotated[str | None, typer.Option(help="Ray cluster address; an embedded local Ray when unset.")] = None,
    serial: Annotated[bool, typer.Option(help="Write the shards in this process, without Ray.")] = False,
):
    """Write webdataset shards, per-split manifests and dataset.json from SOURCE into DEST."""
    from vitray import storage
    from vitray.data import check_destination, check_unchanged, open_source, refuse_known_bad
    from vitray.data.sources import source_folder, source_kind

    _refuse_dest_inside_source(source, dest, source_folder(source))
    # Everything the input decides is checked here, before Ray starts: the source, the
    # destination's storage and what the destination already holds.
    from vitray.cluster.prepare import PreparationLease, prepare
    from vitray.runfolder.lease import RunLeaseHeld

    with handled((ValueError, FileNotFoundError, RunLeaseHeld)):
        # The destination first: its refusals need no listing of the source, which can take long.
        storage.check_remote_reachable(dest, writable=True)
        existing = check_destination(dest, overwrite=overwrite)
        PreparationLease(dest).refuse_if_held()  # another preparation writing there now
        if source_kind(source)[0] == "imagefolder":  # its listing: a minute for a million files, more on NFS
            say(f"listing {source} ...")
        src = open_source(source)
        if existing is None:  # zero-byte images, known from the listing: not after a pass over everything
            refuse_known_bad(src, "skip" if skip_bad else "refuse")
        elif existing.source == src.spec:  # the same spec, but images added or removed since
            check_unchanged(existing, src, dest)
    if existing is not None and existing.source != src.spec:  # not the dataset asked for: never taken for it
        fail(
            f"{dest} holds a dataset prepared from {existing.source}, not from {src.spec}: choose another DEST, "
            "or pass --overwrite to replace it"
        )
    if existing is not None:  # its layout said, so that a different --samples-per-shard is not missed
        console.print(
            f"{dest} is already prepared from {existing.source} ({_splits_text(existing)}); nothing to do "
            "(--overwrite prepares it again, e.g. with another --samples-per-shard)",
            soft_wrap=True,
        )
        return
    say(_listed_text(src))
    for note in src.notes:
        console.print(note, soft_wrap=True)
    if src.left_out:
        console.print(
            f"leaving out {plural(len(src.left_out), 'file')} (not PNG/JPEG images, or outside the class folders), "
            f"e.g. {sorted(src.left_out)[0]}"
        )
    if not serial:  # Ray's start takes seconds, with nothing on the console
        say("starting a local Ray instance ..." if address is None else f"connecting to Ray at {address} ...")
    with handled((ValueError, RunLeaseHeld)):  # bad images, a destination that changed or was taken meanwhile
        try:
            info = prepare(
                src,
                dest,
                address=address,
                serial=serial,
                samples_per_shard=samples_per_shard,
                overwrite=overwrite,
                bad_images="skip" if skip_bad else "refuse",
            )
        except KeyboardInterrupt:  # the one line, saying what a re-run does
            typer.echo(
                "stopped by user (Ctrl-C): vitray data prepare did not finish; "
                f"the same command goes on preparing {dest} from the shards written",
                err=True,
            )
            raise typer.Exit(exit_codes.STOPPED_BY_USER) from None
    labels = (
        "unlabelled"
        if info.label_kind == "none"
        else f"{plural(info.num_classes, 'class', 'classes')} ({info.label_kind}-label)"
    )
    console.print(f"{dest}: {info.name}, {labels}; " + _splits_text(info), soft_wrap=True)


@data_app.command("verify")
def data_verify(
    dest: Annotated[str, typer.Argument(help="A prepared dataset: a local folder or s3://bucket/prefix.")],
    split: Annotated[
        list[str] | None, typer.Option("--split", help="Check only this split (repeatable); all of them by default.")
    ] = None,
):
    """Check a prepared dataset (DEST) against its manifests, after a copy with `aws s3 sync`, say.

    Every shard a manifest lists must be there, with the manifest's size and sha256, and no shard
    that a manifest does not list. One line per problem, then a summary; exit 0 when the dataset
    is whole, 1 when not."""
    from vitray import storage
    from vitray.data import verify_dataset

    if storage.is_local_file(dest):
        fail(f"{dest} is a file, not a prepared dataset (a folder with dataset.json, written by `vitray data prepare`)")
    with handled((ValueError, FileNotFoundError)):
        storage.check_reachable(dest, must_exist=True)  # a typo, a disk not mounted, S3's credentials
        result = verify_dataset(dest, split or (), show_progress=True)
    for problem in result.problems:
        typer.echo(str(problem))
    shards = ", ".join(f"{name}: {plural(count, 'shard')}" for name, count in result.shards.items())
    if result.whole:
        typer.echo(f"{dest}: whole ({shards}; {result.bytes_read / 1e6:,.1f} MB read, every sha256 as listed)")
        return
    typer.echo(
        f"{dest}: {plural(len(result.problems), 'problem')} ({shards} listed): copy the shards named again from "
        "where the dataset was prepared, or prepare it again (vitray data prepare ... --overwrite)"
    )
    raise typer.Exit(exit_codes.FAILED)


def say(line: str) -> None:
    """A line of what the command is doing, as written (a path's [brackets] are not rich markup), a
    URL's password masked."""
    console.print(redact_text(line), markup=False, highlight=False, soft_wrap=True)


def _listed_text(src) -> str:
    """ "imagefolder:/data/pets: 7,349 images in 37 classes (train: 3,680, test: 3,669)"."""
    sizes = src.split_sizes()
    total = sum(sizes.values())
    images = f"{total:,} image{'s' if total != 1 else ''}"
    labels = ", unlabelled" if src.label_kind == "none" else f" in {plural(len(src.classes), 'class', 'classes')}"
    splits = ", ".join(f"{name}: {size:,}" for name, size in sizes.items())
    return f"{src.spec}: {images}{labels} ({splits})"


def _refuse_dest_inside_source(source: str, dest: str, folder: Path | None) -> None:
    """A DEST inside the source's folder: the next listing would read the shards (or, for Parquet,
    the manifests) as the source's own files. Refused before anything is listed."""
    if folder is None or "://" in dest:
        return
    target = Path(dest).expanduser().resolve()
    if target == folder or folder in target.parents:
        fail(
            f"{dest} is inside the source folder {folder}: a later listing of {source} would read the prepared "
            "files as its own; choose a DEST outside it"
        )


def _splits_text(info) -> str:
    return ", ".join(
        f"{name}: {plural(split.num_samples, 'sample')} in {plural(split.num_shards, 'shard')}"
        for name, split in info.splits.items()
    )
