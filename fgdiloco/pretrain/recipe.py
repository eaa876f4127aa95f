"""The example job's training recipe, in one place for every trainer that runs it: the group worker
(:mod:`fgdiloco.pretrain.worker`), the elastic worker (:mod:`fgdiloco.pretrain.elastic_worker`) and the benchmarks
(``benchmarks/peers.py`` for torchft, ``benchmarks/subspace.py``), so that side-by-side runs differ only in how they
synchronise (:mod:`fgdiloco.pretrain.sync`).

The recipe (nanoGPT's): the token ids of the text (:func:`load_tokens`), the seeded model (:func:`build_model`, the
same initial weights on every worker), AdamW with betas (0.9, 0.95), weight decay on matrices only; linear warm-up,
then cosine decay of the learning rate to ``min_lr_ratio``; each replica's own batch stream (:class:`Batches`);
gradients clipped to a global norm of ``grad_clip``; held-out loss as the mean over fixed evaluation batches
(:func:`eval_batches`, :func:`held_out_loss`).
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig
from .data import build_tokenizer, cache_dir_for, encode_corpus, load_text, sample_batch
from .model import GPT, GPTConfig

__all__ = ["Batches", "batch_seed", "build_model", "clip_gradients", "eval_batches", "held_out_loss",
           "inner_optimizer", "load_tokens", "lr_at", "net_bytes", "next_batch", "peak_rss_bytes"]


def load_tokens(cfg: TrainConfig) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """The token ids of ``cfg.data`` (1-D long), the vocabulary size and ``{"chars", "cache_dir",
    "data_seconds"}``: the tokenizer and ids come from the cache :func:`~fgdiloco.pretrain.launcher.preflight`
    filled (built here when missing)."""
    t0 = time.perf_counter()
    text = load_text(cfg.data)
    cache = cache_dir_for(cfg.data, cfg.cache_dir)
    tok = build_tokenizer(text, cfg.tokenizer, cfg.vocab_size, cache_dir=cache)
    tokens = encode_corpus(text, tok, cache_dir=cache)
    return tokens, tok.vocab_size, {"chars": len(text), "cache_dir": str(cache),
                                    "data_seconds": time.perf_counter() - t0}


def build_model(cfg: TrainConfig, vocab_size: int) -> GPT:
    """The job's GPT, seeded with ``cfg.seed`` (the global generator): the same initial weights on every worker."""
    torch.manual_seed(cfg.seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_embd=cfg.n_embd, dropout=cfg.dropout), subspace_rank=cfg.subspace_rank,
               subspace_stages=cfg.stages if cfg.stages > 1 else None,  # only what crosses a boundary: in U
               stage_embeddings=cfg.stage_embeddings and cfg.subspace_rank is not None and cfg.stages > 1)


def eval_batches(cfg: TrainConfig, val: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches (``cfg.eval_batches`` of them, the same on every worker and at every
    evaluation)."""
    gen = torch.Generator().manual_seed(cfg.seed + 7919)
    return [sample_batch(val, cfg.batch_size, cfg.block_size, gen) for _ in range(cfg.eval_batches)]


def batch_seed(cfg: TrainConfig, replica: int) -> int:
    """Seed of the training batches of ``replica``: every stage of a replica draws the same batches (stage 0 uses
    the inputs, the last stage the targets), and replica r draws what worker r of a one-stage run draws."""
    return cfg.seed * 100_003 + replica + 1


class Batches:
    """The training batches of one replica: ``batches(step)`` sets the learning rate of inner step ``step``
    (:func:`lr_at`) and draws its batch from ``train`` (:func:`next_batch`). ``generator`` is what a checkpoint
    saves."""

    def __init__(self, cfg: TrainConfig, train: torch.Tensor, inner: torch.optim.Optimizer, replica: int):
        self.cfg, self.train, self.inner = cfg, train, inner
        self.generator = torch.Generator().manual_seed(batch_seed(cfg, replica))

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return next_batch(self.inner, self.cfg, step, self.train, self.generator)


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
