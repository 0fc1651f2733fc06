"""The device feed: uint8 training batches copied to the accelerator one step ahead.

The loader hands uint8 images (a quarter of float32's bytes); the feed puts each batch's tensors
in pinned host memory and starts their copy to the device on a side stream as soon as the batch
is read, one batch ahead of the step that uses it, so the copy overlaps the previous step's
compute. Images arrive channels-last (how the crops come out of their resize); on a GPU they are
made planar on the device after the copy, on the CPU the model takes them channels-last.
Conversion to the model's range, targets, mixup and masked-patch targets then happen on the
device (`trainers/step/objectives.py`, `trainers/step/masked_patch.py`).

With ``data.decode=gpu`` (a loader made with ``device_decode=True``) a batch's JPEGs arrive
undecoded with their crop boxes; the feed decodes, crops, resizes and flips them on the device
(nvjpeg, :mod:`vitray.data.device_decode`) on the same side stream, after the copy of the crops
the loader workers made on the CPU (PNGs, CMYK), so that it too overlaps the previous step.

On the CPU the same code runs with the copy a no-op (there is no side stream and nothing to pin),
so the CPU tests cover the feed the GPU uses.

On CUDA all of that runs on a thread of its own (``vitray-feed``), up to ``ahead`` batches ahead
of the step: reading a batch (receiving the loader workers' chunks and assembling them), pinning it,
and with ``data.decode=gpu`` nvjpeg's decode, which holds the calling thread until the whole batch
is decoded (torchvision synchronises its decoder's stream). Done in the training thread, all of it
was time between two steps in which no kernel was launched, counted as ``data_wait``; on the
feed's thread it overlaps the step, and the training thread only takes a ready batch off a queue.
The thread's torch calls release the GIL while they run (copies, nvjpeg). On the CPU the feed runs
in the training thread (there it would only take cores from the step); ``background=True`` runs the
thread there too, for the tests.

Because the feed reads ahead, the wrapped loader's own position runs ahead of training;
:meth:`DeviceFeed.state_dict` is the position after the last batch handed to the loop, recorded
with each batch as it was read (as `trainers/engines/xla/loader.py` does for torch-xla's loader), so a
checkpoint resumes exactly.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from vitray.data.batch import Batch, is_channels_last
from vitray.data.device_decode import decode_batch

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the feed's thread, waiting to queue a batch, checks whether to stop
_JOIN_TIMEOUT_S = 30
_END = object()  # queued by the feed's thread when the loader has no more batches


class DeviceFeed:
    """Wraps a :class:`vitray.data.ShardLoader` made with ``float_images=False``: its batches with
    ``images`` (uint8) and ``labels`` on ``device``, each copied while the previous one trains.

    ``background``: read and copy on the feed's own thread, up to ``ahead`` batches ahead (None: on
    CUDA only); otherwise in the caller's thread, one batch ahead."""

    def __init__(self, loader, device: torch.device | str, *, background: bool | None = None, ahead: int = 2):
        if ahead < 1:
            raise ValueError(f"ahead={ahead}: the feed reads at least one batch ahead")
        self._loader = loader
        self.device = torch.device(device)
        self._copy = _Copier(loader, self.device)
        self._background = self.device.type == "cuda" if background is None else background
        self._ahead = ahead
        self._state: dict[str, Any] | None = None
        self._running: Iterator[Batch] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed to the caller."""
        return dict(self._state) if self._state is not None else self._loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()  # the feed's thread stops before the loader's position changes under it
        self._loader.load_state_dict(state)  # ends a running iterator (the loader's generation moves on)
        self._state = None

    def __getattr__(self, name: str) -> Any:  # epoch, steps_per_epoch, stats ... of the wrapped loader
        return getattr(self._loader, name)

    def __iter__(self) -> Iterator[Batch]:
        """Batches from the position after the last batch handed over (or loaded) on. One iterator at
        a time: a new one ends the last, and what that one read ahead is read again."""
        self.close()
        if self._state is not None:
            self._loader.load_state_dict(self._state)
        source = iter(self._loader)
        # Taken before anything is read: once a thread reads ahead, the loader's own position is
        # no longer the caller's.
        self._state = self._loader.state_dict()
        self._running = self._in_background(source) if self._background else self._batches(source)
        return self._running

    def close(self) -> None:
        """End the running iterator (and stop the feed's thread, with the loader's iterator)."""
        running, self._running = self._running, None
        if running is not None:
            running.close()

    def _batches(self, source: Iterator[Batch]) -> Iterator[Batch]:
        ahead = self._copy(next(source))
        while True:
            batch, state, ready = ahead
            ahead = self._copy(next(source))  # the next copy runs while the loop trains on `batch`
            self._state = state
            yield self._hand_over(batch, ready)

    def _in_background(self, source: Iterator[Batch]) -> Iterator[Batch]:
        ready: queue.Queue = queue.Queue(maxsize=self._ahead)
        stop = threading.Event()
        # The thread is given what it uses, never the feed: a feed and iterator dropped without
        # close() are then collected, and this generator's `finally` stops the thread.
        thread = threading.Thread(
            target=_produce, args=(source, self._copy, ready, stop), name="vitray-feed", daemon=True
        )
        thread.start()
        try:
            while True:
                item = _next_from(ready, thread)
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item  # the reader's own error (a corrupt shard, an unreadable store ...)
                batch, state, copied = item
                self._state = state
                yield self._hand_over(batch, copied)
        finally:
            stop.set()
            with contextlib.suppress(queue.Empty):
                ready.get_nowait()  # a thread waiting to put its next batch sees the stop
            # A dropped iterator is finalised by the garbage collector, which may run on the feed's
            # own thread: that thread then stops by itself at its next put, and cannot join itself.
            if thread is not threading.current_thread():
                thread.join(timeout=_JOIN_TIMEOUT_S)
                if thread.is_alive():  # waiting on the loader; it stops when its next batch comes
                    log.warning("the feed's thread did not stop within %d s; left to end on its own", _JOIN_TIMEOUT_S)

    def _hand_over(self, batch: Batch, ready: Any) -> Batch:
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)  # the step's kernels wait for the copy, not the host
            for tensor in (batch.images, batch.labels):
                # Made on the side stream, used on the step's: the allocator must not reuse the
                # memory before the step's stream is done with it.
                tensor.record_stream(stream)
        return batch


class _Copier:
    """Starts one batch's copy (and decode) to the device on the side stream; returns the batch on
    the device, the loader's position right after it, and the event that marks the copy done."""

    def __init__(self, loader, device: torch.device):
        self._loader = loader
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None

    def __call__(self, batch: Batch) -> tuple[Batch, dict[str, Any], Any]:
        if batch.images.dtype != torch.uint8:
            raise TypeError(
                f"the device feed takes uint8 images (a ShardLoader with float_images=False), got {batch.images.dtype}"
            )
        state = self._loader.state_dict()  # right after this batch
        stream = torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext()
        with stream:
            images = _to_device(batch.images, self.device, pin=self._cuda)
            # Training batches leave the loader channels-last (the crops' own layout). On CUDA they
            # are made planar here, after the copy: a transpose on the GPU instead of in every
            # decode. On the CPU they stay as they are: the patch embedding's convolution reads
            # either layout (the same outputs, no slower), and a host transpose here (~6 ms for 64
            # crops of 224 px) is CPU time taken from the loader workers (BENCHMARKS.md).
            if self._cuda:
                images = images.contiguous()
            if batch.encoded:  # data.decode=gpu: the JPEGs are decoded and cropped here
                images, failed = decode_batch(images, batch.encoded, len(batch))
                batch = _without(replace(batch, encoded=()), failed)
            labels = _to_device(batch.labels, self.device, pin=self._cuda)
            ready = self._stream.record_event() if self._cuda else None
        return replace(batch, images=images, labels=labels), state, ready


def _produce(source: Iterator[Batch], copy: _Copier, ready: queue.Queue, stop: threading.Event) -> None:
    """The feed's thread: each batch read, copied (and decoded) on the side stream, queued."""

    def put(item: Any) -> bool:  # False: the training thread has stopped the feed
        while not stop.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    device = torch.cuda.device(copy.device) if copy.device.type == "cuda" else contextlib.nullcontext()
    try:
        with device:
            for batch in source:
                if not put(copy(batch)):
                    return
        put(_END)  # a loader that ends (the training loader does not)
    except BaseException as error:  # handed to the training thread, which raises it
        put(error)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()  # the loader's workers stop with it (only this thread may close it)


def _next_from(ready: queue.Queue, thread: threading.Thread) -> Any:
    """The feed thread's next item; should the thread be gone without one, an error, not a hang."""
    while True:
        try:
            return ready.get(timeout=_POLL_S)
        except queue.Empty:
            if not thread.is_alive() and ready.empty():
                raise RuntimeError("the device feed's thread ended without handing over a batch or an error") from None


def decodes_on_device(setting: str, device: torch.device) -> bool:
    """Whether the training loader hands JPEGs to ``device`` to decode (``data.decode``): gpu, or
    auto on a CUDA device whose torchvision decodes JPEGs there (nvjpeg; checked on a tiny JPEG)."""
    if setting == "cpu" or (setting == "auto" and device.type != "cuda"):
        return False
    if device.type != "cuda":
        raise ValueError(
            f"data.decode=gpu needs a CUDA device, but this worker trains on {device}: "
            "use data.decode=auto (gpu on CUDA, cpu otherwise) or data.decode=cpu"
        )
    from torchvision.io import decode_jpeg, encode_jpeg

    try:
        decode_jpeg([encode_jpeg(torch.zeros((3, 16, 16), dtype=torch.uint8))], device=device)
    except RuntimeError as error:
        if setting == "gpu":
            raise ValueError(f"data.decode=gpu: torchvision cannot decode JPEGs on {device} ({error})") from None
        log.warning("data.decode=auto: torchvision cannot decode JPEGs on %s (%s); decoding on the CPU", device, error)
        return False
    return True


def _without(batch: Batch, positions: list[int]) -> Batch:
    """``batch`` less the samples at ``positions`` (JPEGs no decoder could read: corrupt samples)."""
    if not positions:
        return batch
    gone = set(positions)
    keep = [i for i in range(len(batch)) if i not in gone]
    return replace(
        batch,
        labels=batch.labels[keep],
        keys=[batch.keys[i] for i in keep],
        num_skipped=batch.num_skipped + len(gone),
    )


def _to_device(tensor: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """``tensor`` on ``device``; from pinned memory without blocking the host when ``pin``.
    Pinned blocks come from torch's caching host allocator, which reuses one only after the copy
    that read it has finished. A channels-last batch is pinned and copied as its ``(B, H, W, 3)``
    memory, so that neither step transposes it on the host."""
    if is_channels_last(tensor):
        return _to_device(tensor.permute(0, 2, 3, 1), device, pin=pin).permute(0, 3, 1, 2)
    if pin:
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=pin)
