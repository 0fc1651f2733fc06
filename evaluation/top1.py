"""Top-1 accuracy of a classifier: the one counting loop (big_vision's classification evaluator).

- :func:`count_top1` counts (correct, scored) over batches; the ``val`` evaluator of a training
  run (`vitray.evaluation.evaluators.val`) sums those counts over its ranks.
- :func:`split_top1` is a loaded model's accuracy on a whole prepared split (or slice), e.g. a
  fine-tuned checkpoint scored outside its run.

Multi-label data (ImageNet-ReaL): a prediction counts when it is one of the image's labels, and
images without any label are left out, as ReaL is scored (`vitray.data.top1_hits`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def count_top1(
    model: Any, batches: Iterable[Any], *, device: Any, dtype: torch.dtype = torch.float32
) -> tuple[int, int]:
    """(correct, scored) of `model`'s argmax over `batches` (the data layer's `Batch`), without
    gradients. The model is run in the mode it is in: callers put it in eval mode."""
    from vitray.data import top1_hits

    correct = seen = 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch.images.to(device, dtype))
            hits, scored = top1_hits(logits.float().argmax(1), batch.labels)
            correct, seen = correct + hits, seen + scored
    return correct, seen


def split_top1(
    model: Any,
    path: str,
    split: str,
    *,
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    device: Any = "cpu",
) -> float:
    """Top-1 accuracy of a classifier on a prepared split (or slice), at the model's resolution, in
    eval mode (the model is left in the mode it was in)."""
    from vitray.data import EvalLoader

    loader = EvalLoader(
        path,
        split,
        batch_size=batch_size,
        img_size=model.img_size,
        num_workers=num_workers,
        storage_options=storage_options,
    )
    was_training = model.training
    model.to(device).eval()
    try:
        correct, seen = count_top1(model, loader, device=device)
    finally:
        model.train(was_training)
    if seen == 0:
        raise ValueError(f"split {split!r} of {path} has no labelled sample to score")
    return correct / seen
