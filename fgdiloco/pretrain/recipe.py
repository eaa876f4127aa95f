"""The example job's training recipe, in one place for every trainer that runs it: the group worker
(:mod:`fgdiloco.pretrain.worker`), the elastic worker (:mod:`fgdiloco.pretrain.elastic_worker`) and the benchmarks'
own loops (``benchmarks/peers.py`` for torchft, ``benchmarks/subspace.py``), so that side-by-side runs differ only in
how they synchronise.

The recipe (nanoGPT's): AdamW with betas (0.9, 0.95), weight decay on matrices only; linear warm-up, then cosine
decay of the learning rate to ``min_lr_ratio``; gradients clipped to a global norm of ``grad_clip``; held-out loss as
the mean over fixed evaluation batches.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .data import sample_batch

if TYPE_CHECKING:
    from .worker import TrainConfig

__all__ = ["lr_at", "inner_optimizer", "next_batch", "clip_gradients", "held_out_loss", "net_bytes",
           "peak_rss_bytes"]


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of inner step ``step`` (0-based): linear warm-up over ``cfg.warmup_steps``, then cosine decay
    from ``cfg.lr`` to ``cfg.lr * cfg.min_lr_ratio`` at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def inner_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters: ``cfg.weight_decay`` on those with 2+ dimensions, none on
    biases and norms; betas (0.9, 0.95); learning rate ``cfg.lr`` (:func:`next_batch` sets it per step)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def next_batch(inner: torch.optim.Optimizer, cfg: TrainConfig, step: int, train: torch.Tensor,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Start inner step ``step``: set every parameter group of ``inner`` to :func:`lr_at` and draw the step's
    batch from ``train`` with ``gen``: inputs and targets, each ``(cfg.batch_size, cfg.block_size)`` token ids."""
    for group in inner.param_groups:
        group["lr"] = lr_at(cfg, step)
    return sample_batch(train, cfg.batch_size, cfg.block_size, gen)


def clip_gradients(params: Iterable[torch.Tensor], cfg: TrainConfig) -> None:
    """Clip the gradients of ``params`` to a global L2 norm of ``cfg.grad_clip`` (nothing when it is 0)."""
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss (nats/token) of ``model`` over ``batches`` of ``(inputs, targets)``, in eval mode (restored)."""
    was_training = model.training
    model.eval()
    total = sum(float(model(x, y)[1]) for x, y in batches)
    model.train(was_training)
    return total / len(batches)


def net_bytes() -> tuple[float, float]:
    """``(tx, rx)`` byte counters of the interface named by ``GLOO_SOCKET_IFNAME`` (the benchmarks' shaped veth;
    ``(0, 0)`` when unset or unreadable)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    try:
        base = Path("/sys/class/net") / name / "statistics"
        return (float((base / "tx_bytes").read_text()), float((base / "rx_bytes").read_text()))
    except (OSError, ValueError):
        return (0.0, 0.0)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (bytes)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
