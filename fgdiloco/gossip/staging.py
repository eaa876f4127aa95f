"""Staging: the device-aware data path of the mixes and of the pipeline's boundaries, in one place.

**Mixes.** The round-start snapshot ``θ^t`` and the outer momentum live where the parameters live (fp32 masters on
the GPU for CUDA parameters: :class:`~fgdiloco.outer.state.OuterState`). What a mix *sends* is copied to host
buffers first (:class:`HostStaging`): for CUDA tensors into pinned buffers, kept per slot (the mix and the fragment)
and reused round after round, by non-blocking copies on a side stream; the mix's background thread waits for the
copy's event, the main thread does not (Mix1 still overlaps the inner steps). The mix then runs on host tensors
exactly as on a CPU job (codecs, frames, Gloo over TCP): the pair sessions' bit-exact ``c_j = −c_i`` does not depend
on which device each peer trains on. The mixed values go back to the parameters' device and dtype once, in the
outer step (:meth:`HostStaging.to_device`). CPU tensors are never copied here beyond what a CPU job always did, so a
CPU job is bit-identical with and without this module.

**Backends** (:func:`pipeline_backend`). Gossip always travels over Gloo on TCP (pairwise exchanges between any two
hosts, fault-isolated private groups, no GPU needed on either side). A pipeline's stage-to-stage activations go over
NCCL when the default backend is NCCL and every stage on a host has a GPU of its own (NCCL refuses two ranks on one
GPU); otherwise over Gloo, the stage computing on its GPU and its boundary tensors staged through the host
(:class:`HostBoundary`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["HostBoundary", "HostStaging", "Staged", "pipeline_backend"]


def pipeline_backend(default_backend: str, *, gpus: int, ranks_on_host: int) -> str:
    """The backend of a pipeline's stage-to-stage group: ``"nccl"`` when the job's default backend is NCCL and the
    host has a GPU for each of its ``ranks_on_host`` ranks (``gpus >= ranks_on_host``), else ``"gloo"`` (CPU jobs,
    Gloo jobs, and CUDA stages sharing GPUs; then the stages stage their boundaries through the host)."""
    if "nccl" in default_backend and gpus >= max(ranks_on_host, 1):
        return "nccl"
    return "gloo"


class Staged:
    """Host values a mix will read: :meth:`wait` returns them once their copies have landed (the copies' event; no
    wait for values that were on the host already)."""

    def __init__(self, values: list[torch.Tensor], event: Any = None):
        self.values = values
        self._event = event

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.values


class HostStaging:
    """Host buffers for what the mixes send, reused per slot.

    Args:
        force: stage CPU tensors too (into fresh, reused buffers): the same bookkeeping as for CUDA tensors, for
            tests on machines without a GPU. Default False: CPU tensors pass through.
        pin: allocate pinned (page-locked) buffers, so the device-to-host copies can be asynchronous. Default: when
            CUDA is available.

    Attributes:
        allocations: buffers allocated so far (a slot's are reused while its shapes and dtypes stay).
        copies: tensors copied to host buffers so far; ``bytes``: their size.
        seconds: host time spent issuing the copies (the copies themselves run on the side stream).
    """

    def __init__(self, *, force: bool = False, pin: bool | None = None):
        self.force = force
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._slots: dict[Hashable, list[torch.Tensor]] = {}
        self._streams: dict[torch.device, Any] = {}
        self.allocations = 0
        self.copies = 0
        self.bytes = 0
        self.seconds = 0.0

    def needed(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are copied to host buffers (any of them off the CPU, or ``force``)."""
        return self.force or any(t.device.type != "cpu" for t in tensors)

    def _buffers(self, slot: Hashable, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        bufs = self._slots.get(slot)
        if bufs is None or len(bufs) != len(tensors) or any(
                b.shape != t.shape or b.dtype != t.dtype for b, t in zip(bufs, tensors)):
            bufs = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin and t.device.type == "cuda")
                    for t in tensors]
            self.allocations += len(bufs)
            self._slots[slot] = bufs
        return bufs

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def to_host(self, tensors: Sequence[torch.Tensor], slot: Hashable, *, copy: bool = False) -> Staged:
        """Host values of ``tensors`` for slot ``slot`` (e.g. ``("mix1", fragment)``).

        CPU tensors (without ``force``) pass through, as clones with ``copy`` (what a CPU job always sent). Otherwise
        each is copied into the slot's host buffer: CUDA tensors by non-blocking copies on a side stream that first
        waits for the current stream (the values are ready), with an event the returned :class:`Staged` waits for.
        A slot's buffers are overwritten by its next call: its previous values must have been used by then (a
        round's mix ends before the fragment's next round starts)."""
        tensors = list(tensors)
        if not self.needed(tensors):
            return Staged([t.clone() for t in tensors] if copy else tensors)
        t0 = time.perf_counter()
        bufs = self._buffers(slot, tensors)
        cuda = [t.device for t in tensors if t.device.type == "cuda"]
        event = None
        if cuda:
            stream = self._stream(cuda[0])
            stream.wait_stream(torch.cuda.current_stream(cuda[0]))
            with torch.cuda.stream(stream):
                for b, t in zip(bufs, tensors):
                    b.copy_(t.detach(), non_blocking=True)
                    if t.device.type == "cuda":
                        t.record_stream(stream)  # the allocator keeps t until the copy is done
                event = torch.cuda.Event()
                event.record(stream)
        else:
            for b, t in zip(bufs, tensors):
                b.copy_(t.detach())
        self.copies += len(tensors)
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.seconds += time.perf_counter() - t0
        return Staged(bufs, event)

    @staticmethod
    def to_device(values: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``values`` on the devices and in the dtypes of ``like`` (a value already there is returned as it is)."""
        return [v if v.device == t.device and v.dtype == t.dtype else v.to(device=t.device, dtype=t.dtype)
                for v, t in zip(values, like)]


def _moved(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or a tuple / list / dict of them) on ``device``; other values as they are."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_moved(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _moved(v, device) for k, v in x.items()}
    return x


class HostBoundary(nn.Module):
    """A pipeline stage computing on ``device`` behind a host boundary: what it receives (host tensors from Gloo)
    moves to ``device``, what it sends (its output, unless ``last``) moves back to the host. Autograd carries the
    gradients across both copies. The ``PipelineStage`` around it is built with the CPU as its device (its receive
    buffers are host tensors) and must not move the stage off its GPU (:class:`fgdiloco.pipeline.Pipeline` skips
    that move for a ``HostBoundary``).

    Args:
        module: the stage (on ``device``).
        device: where it computes.
        last: the last stage: its output goes to the loss on ``device`` and is not sent.
    """

    def __init__(self, module: nn.Module, device: torch.device | str, *, last: bool = False):
        super().__init__()
        self.inner = module
        self.device = torch.device(device)
        self.last = last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*_moved(args, self.device), **_moved(kwargs, self.device))
        return out if self.last else _moved(out, torch.device("cpu"))
