"""Where a worker of the example job computes (``--device``) and in which precision.

``--device auto`` (the default) trains on CUDA when it is available, else on the CPU; ``cuda`` insists on it.
Worker ``k`` of ``W`` on a host with ``G`` GPUs takes GPU ``k % G``: one GPU per worker when ``G >= W``, otherwise
workers share GPUs (gossip is on Gloo over host buffers, so sharing needs nothing else; a pipeline's stages then
send over Gloo through the host, :func:`fgdiloco.gossip.staging.pipeline_backend`). On a GPU that supports bf16 the
inner steps' forward and backward passes run under bf16 autocast; the parameters, the inner optimizer and the
outer loop's masters stay fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DEVICES", "Placement", "on_device", "place", "resolve_device"]

#: ``--device``'s choices
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    """A worker's device, whether it shares its GPU with other workers, and whether its inner steps run in bf16
    autocast."""

    device: torch.device
    shared: bool = False
    bf16: bool = False

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision of the inner steps' forward and backward: bf16 autocast on a GPU that has it, else
        nothing."""
        if self.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def resolve_device(choice: str, *, worker: int, workers: int) -> Placement:
    """The :class:`Placement` of ``worker`` (0-based, on this host) of ``workers`` for ``--device choice``.

    Raises:
        ValueError: an unknown ``choice``.
        RuntimeError: ``"cuda"`` without a CUDA device.
    """
    if choice not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {choice!r}")
    available = torch.cuda.is_available()
    if choice == "cuda" and not available:
        raise RuntimeError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False); use "
                           "--device auto or cpu")
    if choice == "cpu" or not available:
        return Placement(torch.device("cpu"))
    gpus = torch.cuda.device_count()
    index = worker % gpus
    return Placement(torch.device("cuda", index), shared=workers > gpus, bf16=_bf16(index))


def _bf16(index: int) -> bool:
    """Whether GPU ``index`` computes in bf16 natively (compute capability 8.0, Ampere, or later)."""
    try:
        return torch.cuda.get_device_capability(index)[0] >= 8
    except (RuntimeError, AssertionError):  # no usable CUDA runtime: no autocast
        return False


def on_device(batches: Callable[[int], Any], device: torch.device) -> Callable[[int], Any]:
    """``batches`` whose ``(inputs, targets)`` are moved to ``device`` (itself on the CPU: a CPU run is
    unchanged)."""
    if device.type == "cpu":
        return batches

    def moved(step: int) -> Any:
        x, y = batches(step)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    return moved


def place(placement: Placement, model: torch.nn.Module, eval_set: list[Any]) -> list[Any]:
    """Put ``model`` on the placement's device (making it the current CUDA device) and return ``eval_set``'s
    ``(inputs, targets)`` there; on the CPU nothing moves."""
    if placement.device.type == "cpu":
        return eval_set
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    model.to(placement.device)
    return [(x.to(placement.device), y.to(placement.device)) for x, y in eval_set]
