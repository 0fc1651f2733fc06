"""Training batches for the XLA backend: put on the device by torch-xla's parallel loader,
sharded along the batch over the SPMD mesh, always of the same shape.

Each host loads its own part of the global batch (its data slots, as under DeepSpeed); the
sharding spec says so (`minibatch=True`), and the mesh spreads each host's part over its local
devices. The parallel loader reads ahead on background threads, so the wrapped loader's own
position runs ahead of training: :meth:`DeviceLoader.state_dict` is therefore the position after
the last batch handed to the loop, recorded with each batch as it was read, and a new iterator
starts there (as `trainers/step/feed.py`'s device feed does).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from vitray.data.batch import Batch


@dataclass
class _Read:
    """What travels beside a batch's tensors: everything but the tensors, and the loader's
    position right after this batch."""

    batch: Batch  # with empty tensors
    state: dict[str, Any]


def fill_to(batch: Batch, size: int) -> Batch:
    """`batch` with exactly `size` samples: a batch that lost corrupt samples is filled up with
    repeats of its own samples, because XLA compiles one program per input shape. The recorded
    keys stay those actually read."""
    have = len(batch.images)
    if have == size:
        return batch
    if have == 0:
        raise RuntimeError(
            f"a training batch lost all {size} samples to corrupt data (epoch {batch.epoch}, step {batch.step})"
        )
    index = torch.arange(size) % have
    return replace(batch, images=batch.images[index], labels=batch.labels[index])


class DeviceLoader:
    """Wraps a :class:`vitray.data.ShardLoader`: its batches with `images` and `labels` on the
    XLA device, sharded along the batch dimension over the mesh axis `axis`."""

    def __init__(self, loader, mesh, batch_size: int, device: torch.device, *, axis: str = "fsdp", prefetch: int = 2):
        self._loader, self._mesh, self._axis = loader, mesh, axis
        self._batch_size, self._device, self._prefetch = batch_size, device, prefetch
        self._state: dict[str, Any] | None = None
        self._parallel = None
        self._source: Iterator[Batch] | None = None  # the wrapped loader's iterator the threads read

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed to the caller."""
        return dict(self._state) if self._state is not None else self._loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._close()
        self._loader.load_state_dict(state)
        self._state = None

    def __getattr__(self, name: str) -> Any:  # epoch, steps_per_epoch, stats ... of the wrapped loader
        return getattr(self._loader, name)

    def __iter__(self) -> Iterator[Batch]:
        """Batches from the position after the last batch handed over (or loaded) on. One iterator at
        a time: a new one ends the last, and what that one read ahead is read again."""
        import torch_xla.distributed.parallel_loader as pl

        self._close()
        if self._state is not None:
            self._loader.load_state_dict(self._state)
        source = self._source = iter(self._loader)
        # Before anything is read: from here on the parallel loader reads ahead of the caller.
        self._state = self._loader.state_dict()
        first = fill_to(next(source), self._batch_size)
        sharding = {"images": self._batch_sharding(first.images), "labels": self._batch_sharding(first.labels)}
        reads: collections.deque[_Read] = collections.deque()

        def host_batches():  # runs on the parallel loader's thread
            batch = first
            while True:
                empty = torch.empty(0)
                reads.append(_Read(replace(batch, images=empty, labels=empty), self._loader.state_dict()))
                # planar on the host: training batches leave the loader channels-last
                yield {"images": batch.images.contiguous(), "labels": batch.labels}
                batch = fill_to(next(source), self._batch_size)

        self._parallel = pl.ParallelLoader(
            host_batches(),
            [self._device],
            input_sharding=sharding,
            loader_prefetch_size=self._prefetch,
            device_prefetch_size=self._prefetch,
        )
        return self._device_batches(self._parallel, reads)

    def _device_batches(self, parallel, reads: collections.deque) -> Iterator[Batch]:
        try:
            for tensors in parallel.per_device_loader(self._device):
                read = reads.popleft()  # appended before its tensors were handed over
                self._state = read.state
                yield replace(read.batch, images=tensors["images"], labels=tensors["labels"])
        finally:  # the iterator ended or was closed (the loop closes it when it ends): so are the threads
            if self._parallel is parallel:
                self._close()

    def _batch_sharding(self, tensor: torch.Tensor):
        import torch_xla.distributed.spmd as xs

        spec = (self._axis,) + (None,) * (tensor.ndim - 1)
        return xs.ShardingSpec(self._mesh, spec, minibatch=True)

    def _close(self) -> None:
        if self._parallel is not None:
            self._parallel.close()  # joins its threads: nothing reads the source any more
            self._parallel = None
        if self._source is not None:
            self._source.close()  # the wrapped loader's own threads and workers stop with it
            self._source = None
