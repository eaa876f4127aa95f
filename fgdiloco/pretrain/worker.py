"""One worker of a group job: pretrain a small GPT on real text with Factored Gossip DiLoCo, a pipeline of its
stages, or a DDP / local SGD baseline, on one process group.

:func:`train_worker` is what one worker (one process, one rank) runs; :func:`fgdiloco.pretrain.launcher.launch`
starts ``cfg.workers`` local workers with torchelastic (the engine behind ``torchrun``) and returns rank 0's summary;
``fgdiloco pretrain`` (:mod:`fgdiloco.cli`) is a thin layer over it. The worker assembles the one training loop
(:class:`fgdiloco.pretrain.loop.Loop`) from the recipe (:mod:`fgdiloco.pretrain.recipe`), the synchroniser its
configuration asks for (:func:`fgdiloco.pretrain.sync.group_synchroniser`) and the group's collective rows
(:class:`fgdiloco.pretrain.reports.GroupRows`).

Outputs in ``cfg.out`` (written by rank 0; :mod:`fgdiloco.pretrain.results` describes every field):
``run.json`` (before the first step), ``metrics.jsonl`` (one row per evaluation: step 0, then every
``eval_every`` rounds and at the end), ``summary.json`` and ``loss.png``. A folder is reused as it is: rank 0
removes an earlier run's ``summary.json`` and ``loss.png`` first, so the folder never mixes two runs.

Evaluation (held-out loss on a fixed set of validation windows, the same on every rank) runs between rounds and
is kept out of the diagnostics: it runs inside the synchroniser's ``paused()``, so its time is not in any round's
round or inner seconds, and it is subtracted from ``train_seconds``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .config import TrainConfig
from .data import split_tokens, unigram_loss
from .device import on_device, place, resolve_device
from .loop import Loop
from .recipe import Batches, build_model, eval_batches, inner_optimizer, load_tokens
from .reports import GroupRows
from .results import run_info, title
from .sync import group_synchroniser

__all__ = ["TrainConfig", "train_worker"]


def train_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Run one worker of a pretraining job and return the run summary (complete on rank 0).

    Joins the job's process group from torchrun's environment variables (Gloo) unless ``torch.distributed`` is
    already initialised; without either it trains a single worker. Every worker must call it with the same
    ``cfg``. Rank 0 writes ``metrics.jsonl``, ``summary.json`` and ``loss.png`` into ``cfg.out``.
    """
    cfg.validate()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    created = _init_distributed()
    try:
        return _train(cfg)
    finally:
        if created and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _train(cfg: TrainConfig) -> dict[str, Any]:
    t_setup = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    data = _load_data(cfg, rank, world)
    train, val, vocab = data["train"], data["val"], data["vocab_size"]
    unigram = unigram_loss(train, val, vocab)
    mesh = _mesh(cfg, world)

    model = build_model(cfg, vocab)
    n_params = model.num_parameters(non_embedding=False)
    if mesh is not None:  # every rank builds the same seeded model and keeps its own stage
        model = model.split(cfg.stages)[mesh.stage]
    placement = resolve_device(cfg.device, worker=rank, workers=world)
    eval_set = place(placement, model, eval_batches(cfg, val))
    inner = inner_optimizer(model, cfg)
    batches = Batches(cfg, train, inner, mesh.replica if mesh is not None else rank)
    sync = group_synchroniser(cfg, model, inner, world=world, mesh=mesh)
    sync.autocast = placement.autocast

    replicas = world // cfg.stages
    info = run_info(cfg, method=sync.method, workers=world, replicas=replicas,
                    tokens_per_step=cfg.batch_size * cfg.block_size * replicas, params=n_params, vocab_size=vocab,
                    train=train, val=val, unigram=unigram, cache_dir=data.get("cache_dir"),
                    setup_seconds=time.perf_counter() - t_setup,
                    title=title(cfg, method=sync.method, label=sync.label, workers=world, params=n_params))
    reporter = GroupRows(cfg, sync, rank, info)
    loop = Loop(sync, reporter, on_device(batches, placement.device), eval_set, steps=cfg.steps,
                sync_every=cfg.round_steps,
                eval_every=cfg.eval_every, deferred=cfg.eval_deferred)
    try:
        outcome = loop.run()
    finally:
        reporter.close()
    return reporter.finish(outcome)


def _mesh(cfg: TrainConfig, world: int) -> Any:
    """The replicas x stages grid of a pipeline job (collective), None with one stage."""
    if cfg.stages == 1:
        return None
    if world % cfg.stages:
        raise ValueError(f"stages={cfg.stages} must divide the world size {world} (workers = replicas x stages)")
    from ..mesh import ReplicaMesh

    return ReplicaMesh(world // cfg.stages, cfg.stages, stage_timeout=cfg.stage_timeout)


def _init_distributed() -> bool:
    """Join the job's process group from torchrun's environment; True when this call created it."""
    if dist.is_available() and dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return False
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return True


def _load_data(cfg: TrainConfig, rank: int, world: int) -> dict[str, Any]:
    """Rank 0 reads the text, builds (or loads from cache) the tokenizer and token ids, and broadcasts the ids;
    every rank gets the same train / validation split. Only rank 0 touches the cache, so ranks never race."""
    info: dict[str, Any] = {}
    header = torch.zeros(3, dtype=torch.int64)
    tokens = None
    error: BaseException | None = None
    if rank == 0:
        try:
            tokens, vocab0, found = load_tokens(cfg)
            info.update(found)
            header = torch.tensor([tokens.numel(), vocab0, 1], dtype=torch.int64)
        except BaseException as e:  # noqa: BLE001 - told to the other ranks, then re-raised
            error = e
            header = torch.tensor([0, 0, 0], dtype=torch.int64)
    if world > 1:
        dist.broadcast(header, src=0)
    if error is not None:
        raise error
    if int(header[2]) != 1:
        raise RuntimeError("rank 0 failed to load the training data (see its error)")
    n, vocab = int(header[0]), int(header[1])
    if world > 1:
        buf = tokens.to(torch.int32) if rank == 0 else torch.empty(n, dtype=torch.int32)
        dist.broadcast(buf, src=0)
        tokens = buf.long()
    assert tokens is not None
    train, val = split_tokens(tokens, cfg.val_fraction)
    for name, part in (("training", train), ("validation", val)):
        if part.numel() < cfg.block_size + 1:
            raise ValueError(f"the {name} split has {part.numel()} tokens, fewer than block_size + 1 = "
                             f"{cfg.block_size + 1}: use more text, a smaller --block-size or another --val-fraction")
    info.update(train=train, val=val, vocab_size=vocab, tokens_total=n)
    return info
