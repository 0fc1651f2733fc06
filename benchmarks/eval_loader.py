"""Throughput of the evaluation reader (EvalLoader: resize + central crop, what the val and
few-shot evaluators, fine-tune evaluation and `vitray fewshot` read) against a plain PIL +
torchvision loop, and of its transform alone against torchvision's and the whole-image resize.

    python benchmarks/eval_loader.py [--images 2000] [--samples 4000] [--rounds 3]

The JPEGs are `benchmarks/data_pipeline.py`'s ``imagenet`` set (about 500x375, quality 90, cut
from scikit-learn's sample photos), prepared into local shards. Measured, in rounds alternating
the readers, each round's figures in samples per CPU-second of this process (torch on one thread):

1. the reference: a plain loop over the JPEG files: read, PIL decode to RGB, torchvision's
   ``Resize(256)`` + ``CenterCrop(224)`` on the PIL image, out as a uint8 array;
2. ``EvalLoader`` decoding in this process (``num_workers=0``, as the val evaluator reads a
   small split), uint8 batches;
3. the transforms alone on decoded images (microseconds an image): vitray's ``eval_transform``
   (the crop's part resampled alone), the same geometry resampling the whole image (vitray's
   transform before), and torchvision's.

The medians over the rounds print last, with the ratios: EvalLoader / plain loop, and the
transform against the whole-image resize and against torchvision.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from data_pipeline import cpu_seconds, write_jpegs
from PIL import Image
from torchvision.transforms import v2

from vitray.data import EvalLoader, eval_transform, prepare_dataset
from vitray.data.sources import open_source

OUTPUT, RESIZED = 224, 256


def plain_loop(paths: list[Path], samples: int) -> float:
    """Samples per CPU-second of the reference: decode, Resize + CenterCrop, uint8 out."""
    transform = v2.Compose([v2.Resize(RESIZED, antialias=True), v2.CenterCrop(OUTPUT)])
    cpu = cpu_seconds()
    for i in range(samples):
        with Image.open(paths[i % len(paths)]) as image:
            out = np.asarray(transform(image.convert("RGB")))
        assert out.shape == (OUTPUT, OUTPUT, 3)
    return samples / (cpu_seconds() - cpu)


def eval_loader(shards: str, samples: int) -> float:
    """Samples per CPU-second of EvalLoader in this process (passes until `samples` are read)."""
    cpu, read = cpu_seconds(), 0
    while read < samples:
        loader = EvalLoader(shards, "train", batch_size=64, img_size=OUTPUT, num_workers=0, float_images=False)
        for batch in loader:
            read += len(batch)
            if read >= samples:
                break
    return read / (cpu_seconds() - cpu)


def whole_then_crop(image: Image.Image) -> Image.Image:
    """vitray's geometry resampling the whole image, then cropping (its transform before)."""
    width, height = image.size
    scaled = (RESIZED, int(RESIZED * height / width)) if width <= height else (int(RESIZED * width / height), RESIZED)
    resized = image.resize(scaled, Image.BILINEAR)
    left, top = (round((side - OUTPUT) / 2.0) for side in scaled)
    return resized.crop((left, top, left + OUTPUT, top + OUTPUT))


def transform_microseconds(images: list[Image.Image]) -> dict[str, float]:
    ours = eval_transform(OUTPUT, "aspect", RESIZED / OUTPUT)
    theirs = v2.Compose([v2.Resize(RESIZED, antialias=True), v2.CenterCrop(OUTPUT), v2.PILToTensor()])
    timed = {}
    for name, transform in (
        ("eval_transform", ours),
        ("whole resize", lambda image: np.asarray(whole_then_crop(image))),
        ("torchvision", theirs),
    ):
        start = time.perf_counter()
        for image in images:
            transform(image)
        timed[name] = (time.perf_counter() - start) / len(images) * 1e6
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000, help="JPEGs")
    parser.add_argument("--samples", type=int, default=4000, help="samples per run of each reader")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="vitray-bench-eval-") as tmp:
        paths = write_jpegs(Path(tmp) / "jpegs", args.images, "imagenet")
        shards = str(Path(tmp) / "shards")
        prepare_dataset(open_source(f"imagefolder:{Path(tmp) / 'jpegs'}"), shards, samples_per_shard=500)
        decoded = []
        for path in paths[:300]:
            with Image.open(path) as image:
                decoded.append(image.convert("RGB"))
        rounds: dict[str, list[float]] = {}
        for r in range(args.rounds):
            measured = {
                "plain loop": lambda: plain_loop(paths, args.samples),
                "EvalLoader": lambda: eval_loader(shards, args.samples),
            }
            for name in list(measured)[:: 1 if r % 2 == 0 else -1]:
                rounds.setdefault(name, []).append(measured[name]())
            for name, micros in transform_microseconds(decoded).items():
                rounds.setdefault(name, []).append(micros)
            print(f"round {r}: " + ", ".join(f"{name} {values[-1]:.1f}" for name, values in rounds.items()), flush=True)
    median = {name: statistics.median(values) for name, values in rounds.items()}
    print(
        f"samples per CPU-second: EvalLoader {median['EvalLoader']:.1f}, plain loop {median['plain loop']:.1f}: "
        f"**{median['EvalLoader'] / median['plain loop']:.2f}**"
    )
    print(
        f"microseconds an image: eval_transform {median['eval_transform']:.0f}, whole resize "
        f"{median['whole resize']:.0f}, torchvision {median['torchvision']:.0f}: whole / eval_transform "
        f"**{median['whole resize'] / median['eval_transform']:.2f}**, torchvision / eval_transform "
        f"**{median['torchvision'] / median['eval_transform']:.2f}**"
    )


if __name__ == "__main__":
    main()
