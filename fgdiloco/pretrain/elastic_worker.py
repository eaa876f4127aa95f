"""One worker of an elastic ``fgdiloco pretrain`` job: its own single-process ``torchrun`` job (docs/faults.md).

    python -m torch.distributed.run --standalone --nproc-per-node=1 --max-restarts=N \\
        -m fgdiloco.pretrain.elastic_worker OUT/config.json

:func:`fgdiloco.pretrain.launcher.launch` starts one per worker slot, with the gossip store's address and the slot
in the environment (:mod:`fgdiloco.elastic`). The worker runs no collective over all workers: it loads the
token ids from the cache the launcher's preflight filled and runs the one training loop
(:class:`fgdiloco.pretrain.loop.Loop`) with :class:`fgdiloco.pretrain.sync.ElasticFGDiLoCo` (``FGDiLoCo(...,
elastic=True)``) and :class:`fgdiloco.pretrain.reports.WorkerEvents`, which writes what it measures to the worker's
own file, ``<out>/workers/worker<k>.jsonl`` (:data:`fgdiloco.pretrain.reports.EVENTS`); the launcher merges the
workers' files into ``metrics.jsonl``, ``summary.json`` and ``loss.png``.

Restarts: every ``checkpoint_every`` rounds (and after the last) the worker saves ``<out>/checkpoints/worker<k>.pt``
atomically (temporary file, then ``os.replace``: a worker killed mid-write keeps its previous one): the wrapper's
state dict (parameters, outer momentum, inner AdamW state, round), the batch generator and its clocks. A restarted
worker (torchrun's ``TORCHELASTIC_RESTART_COUNT`` > 0, or ``fgdiloco pretrain --resume``) loads it, or starts from
the seeded initial model when it has none, and rejoins the job (:meth:`fgdiloco.FGDiLoCo.rejoin`);
its step and learning rate follow the round it is in (``round * sync_every`` + steps done in the round). A restart
costs no one a gossip deadline: exchange keys name each side's incarnation, and an exchange whose peer has already
started a later round is skipped at once (:mod:`fgdiloco.elastic`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import TrainConfig
from .data import split_tokens, unigram_loss
from .device import on_device, place, resolve_device
from .loop import Clock, Loop, Reporter
from .recipe import Batches, build_model, eval_batches, inner_optimizer, load_tokens
from .reports import WorkerEvents
from .results import checkpoint_path, run_info, title
from .sync import ElasticFGDiLoCo

__all__ = ["START_ROUND_ENV", "main", "train_elastic"]

#: The round every worker of a resumed job starts at (the newest of their checkpoints; set by the launcher):
#: workers whose checkpoints are of different rounds would otherwise each wait a whole timeout for the others.
START_ROUND_ENV = "FGDILOCO_PRETRAIN_START_ROUND"


def train_elastic(cfg: TrainConfig) -> dict[str, Any]:
    """Run this process's part of the elastic job described by ``cfg`` (slot, store and slots from the environment:
    :func:`fgdiloco.elastic.settings`): a worker slot, or with ``cfg.stages > 1`` one stage (torchrun's local rank)
    of pipeline replica ``slot``, whose torchrun job holds the replica's stages. Returns the ``end`` event of the
    slot's report (the last stage reports; the other stages return None).

    Raises:
        ValueError: ``cfg`` is not an elastic configuration (:attr:`TrainConfig.elastic`) or is invalid.
        StoreUnreachable: the gossip store was out of reach for ``store_timeout``; the checkpoint was saved first.
    """
    from ..elastic import WORKER_ENV, settings

    cfg.validate()
    if not cfg.elastic:
        raise ValueError("train_elastic runs FG-DiLoCo with a gossip topology only "
                         f"(baseline={cfg.baseline!r}, topology={cfg.topology!r})")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    t_setup = time.perf_counter()
    slot = int(settings()["worker"]) if os.environ.get(WORKER_ENV) is not None else 0
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mesh = _replica_mesh(cfg)
    try:
        return _train(cfg, slot, life, mesh, t_setup)
    finally:
        if mesh is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _replica_mesh(cfg: TrainConfig) -> Any:
    """A pipeline replica's mesh over its torchrun job's group (``ReplicaMesh(1, stages)``), or None."""
    if cfg.stages == 1:
        return None
    from ..elastic import init_replica_group
    from ..mesh import ReplicaMesh

    init_replica_group("gloo", timeout=cfg.stage_timeout + 60)  # a store prefix per life: restarts meet afresh
    return ReplicaMesh(1, cfg.stages, stage_timeout=cfg.stage_timeout)


def _train(cfg: TrainConfig, slot: int, life: int, mesh: Any, t_setup: float) -> dict[str, Any] | None:
    from ..elastic import StoreUnreachable
    from .sync import ElasticPipelineStage

    tokens, vocab, found = load_tokens(cfg)
    train, val = split_tokens(tokens, cfg.val_fraction)
    unigram = unigram_loss(train, val, vocab)
    model = build_model(cfg, vocab)  # the same initial model on every worker: an elastic job has no broadcast
    n_params = model.num_parameters(non_embedding=False)
    stage = None if mesh is None else mesh.stage
    if mesh is not None:
        model = model.split(cfg.stages)[stage]
    placement = resolve_device(cfg.device, worker=slot * cfg.stages + (stage or 0), workers=cfg.workers)
    eval_set = place(placement, model, eval_batches(cfg, val))
    inner = inner_optimizer(model, cfg)
    batches = Batches(cfg, train, inner, slot)  # every stage of a replica draws the replica's batches
    common = dict(grad_clip=cfg.grad_clip, checkpoint=checkpoint_path(cfg.out, slot, stage), run_id=cfg.run_id,
                  worker=slot, checkpoint_every=cfg.checkpoint_every)
    if mesh is None:
        sync = ElasticFGDiLoCo(model, inner, cfg.fgdiloco_config(), **common)
    else:
        sync = ElasticPipelineStage(model, inner, cfg.fgdiloco_config(), mesh=mesh, microbatches=cfg.microbatches,
                                    replicas=cfg.replicas, **common)
    sync.autocast = placement.autocast
    clock = Clock()
    try:
        resumed = sync.restore(batches, clock, start_round=int(os.environ.get(START_ROUND_ENV, "0") or 0),
                               first_life=life == 0)
    except BaseException:
        sync.close()
        raise
    if resumed is not None:
        print(f"[fgdiloco] worker {slot}{'' if stage is None else f' stage {stage}'} (life {life}): continuing "
              f"from {sync.checkpoint} of round {resumed}", flush=True)
    replicas = sync.opt.world_size
    info = run_info(cfg, method="fgdiloco", elastic=True, workers=replicas * cfg.stages, replicas=replicas,
                    tokens_per_step=cfg.batch_size * cfg.block_size * replicas, params=n_params, vocab_size=vocab,
                    train=train, val=val, unigram=unigram, cache_dir=found["cache_dir"],
                    setup_seconds=time.perf_counter() - t_setup,
                    title=title(cfg, method="fgdiloco", label=sync.label, workers=replicas * cfg.stages,
                                params=n_params, elastic=True))
    reports = mesh is None or mesh.is_last_stage  # the replica's loss lives on its last stage
    reporter: Any = WorkerEvents(cfg, sync, worker=slot, life=life, info=info, resumed_round=resumed) if reports \
        else Reporter()
    if mesh is not None:
        reporter = StagesAgree(reporter, mesh, sync)
    loop = Loop(sync, reporter, on_device(batches, placement.device), eval_set, steps=cfg.steps,
                sync_every=cfg.round_steps,
                eval_every=cfg.eval_every, clock=clock)
    try:
        outcome = loop.run()
        return reporter.finish(outcome) if reports else None
    except StoreUnreachable:
        with contextlib.suppress(Exception):
            sync.save(loop)  # the last round's state: --resume continues from it
        raise
    finally:
        reporter.close()


class StagesAgree(Reporter):
    """A pipeline replica's stages stop together: the last stage's reporter decides at every evaluation point
    (``max_seconds``), and every stage hears it (one broadcast over the replica's pipeline group)."""

    def __init__(self, inner: Reporter, mesh: Any, sync: Any):
        self.inner, self.mesh, self.sync = inner, mesh, sync

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def record(self, point: Any) -> bool:
        if point.stats is not None:  # the replica's row: per-stage means of the gossip and pipeline counters
            mine = {"bytes_sent": point.stats.get("bytes_sent") or 0.0,
                    "bytes_sent_since_point": point.stats.get("bytes_sent_since_point") or 0.0, **self.sync.metrics()}
            t = torch.tensor(list(mine.values()), dtype=torch.float64)
            dist.all_reduce(t, group=self.mesh.pipeline_group)
            means = dict(zip(mine, (t / self.mesh.stages).tolist()))
            point = dataclasses.replace(point, stats={**point.stats, **means})
        stop = torch.tensor([int(self.inner.record(point))], dtype=torch.int64)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=self.mesh.pipeline_group)
        return bool(stop.item())

    def start(self) -> None:
        self.inner.start()

    def round_done(self, end: Any) -> None:
        self.inner.round_done(end)

    def evaluated(self, point: Any, loss: float) -> None:
        self.inner.evaluated(point, loss)

    def rejoined(self, from_round: int, to_round: int, step: int) -> None:
        self.inner.rejoined(from_round, to_round, step)

    def finish(self, outcome: Any) -> dict[str, Any]:
        return self.inner.finish(outcome)

    def close(self) -> None:
        self.inner.close()


def _interrupt_once(signum: int, frame: Any) -> None:
    """The first SIGINT (Ctrl-C reaches the whole process group) stops training with KeyboardInterrupt; later
    ones are ignored (the worker is already stopping)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """``python -m fgdiloco.pretrain.elastic_worker CONFIG_JSON``: the :class:`TrainConfig` the launcher wrote
    (``<out>/config.json``). Exit status 0 when the worker finished, 130 when interrupted."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fgdiloco.pretrain.elastic_worker CONFIG_JSON", file=sys.stderr)
        return 2
    cfg = TrainConfig.from_dict(json.loads(Path(args[0]).read_text(encoding="utf-8")))
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        train_elastic(cfg)
    except KeyboardInterrupt:
        print("[fgdiloco] worker interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
