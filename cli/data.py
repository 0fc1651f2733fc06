"""`vitray data prepare`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vitray.cli.app import console, data_app, fail


@data_app.command("prepare")
def data_prepare(
    source: Annotated[
        str,
        typer.Argument(
            help="imagefolder:PATH | cifar10:PATH | cifar100:PATH | parquet:PATH | hf:PATH[?image=COL&label=COL] | "
            "tfds:DATA_DIR/NAME/VERSION | vtab:TASK:DATA_DIR/NAME/VERSION | pets:DIR | flowers102:DIR | builtin:digits"
        ),
    ],
    dest: Annotated[str, typer.Argument(help="Output folder: a local path or s3://bucket/prefix.")],
    samples_per_shard: Annotated[int, typer.Option(help="Samples per tar shard.", min=1)] = 1000,
    overwrite: Annotated[bool, typer.Option(help="Redo a destination that is already prepared.")] = False,
    address: Annotated[
        Optional[str], typer.Option(help="Ray cluster address; an embedded local Ray when unset.")
    ] = None,
    serial: Annotated[bool, typer.Option(help="Write the shards in this process, without Ray.")] = False,
):
    """Write webdataset shards, per-split manifests and dataset.json from SOURCE into DEST."""
    from vitray.data import open_source

    try:
        src = open_source(source)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    if serial:
        from vitray.data import prepare_dataset

        info = prepare_dataset(src, dest, samples_per_shard=samples_per_shard, overwrite=overwrite)
    else:
        from vitray.cluster.prepare import prepare_dataset_on_ray
        from vitray.cluster.runtime import connect

        connect(address)
        info = prepare_dataset_on_ray(src, dest, samples_per_shard=samples_per_shard, overwrite=overwrite)
    splits = ", ".join(f"{name}: {split.num_samples} samples in {split.num_shards} shards" for name, split in info.splits.items())
    console.print(f"{dest}: {info.name}, {info.num_classes} classes ({info.label_kind}-label); {splits}")
