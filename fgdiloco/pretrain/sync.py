"""The example job's synchronisers (:class:`fgdiloco.pretrain.loop.Synchroniser`): how one worker's replica meets
the others.

* :class:`DDP`: ``DistributedDataParallel``, gradients all-reduced in every backward pass (the baseline);
* :class:`LocalSGD`: PyTorch's ``PeriodicModelAverager``, parameters averaged every ``sync_every`` steps;
* :class:`FGDiLoCoSync`: :class:`fgdiloco.FGDiLoCo` on a process group (or any transport: in-process workers);
* :class:`PipelineStage`: FG-DiLoCo on one pipeline stage (:class:`fgdiloco.ReplicaMesh`): the replica's batch goes
  through its stages with the 1F1B schedule, gradients are clipped by the whole replica's norm, the loss comes from
  the last stage;
* :class:`ElasticFGDiLoCo`: FG-DiLoCo as one worker of an elastic job: it continues from its checkpoint, rejoins the
  live round, and saves a checkpoint every ``checkpoint_every`` rounds;
* :class:`ElasticPipelineStage`: one stage of a replica of an elastic pipeline job (the replica fails and restarts
  as a whole; each stage gossips with its own stage of the other replicas).

:func:`group_synchroniser` picks the one a group worker's configuration asks for. Round statistics: FG-DiLoCo's are
``RoundStats.as_dict()``; the baselines' carry the same keys (``utilisation``: seconds not blocked in communication
/ round seconds, ``mix2_seconds``: the blocked seconds, ``bytes_sent``: the all-reduce's estimated bytes).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import FGDiLoCoConfig
from .config import TrainConfig
from .loop import Batch, Clock, Layout, Loop, Periodic, RoundEnd, Synchroniser
from .recipe import Batches

__all__ = ["CHECKPOINT_FORMAT", "DDP", "ElasticFGDiLoCo", "ElasticPipelineStage", "FGDiLoCoSync", "LocalSGD",
           "PipelineStage", "group_synchroniser"]

#: Version of the checkpoint files :class:`ElasticFGDiLoCo` writes.
CHECKPOINT_FORMAT = 1


def _ring(world: int) -> float:
    """Bytes each worker sends in a ring all-reduce per byte of the buffer: 2 (M-1)/M (an estimate; Gloo picks
    its algorithm)."""
    return 2 * (world - 1) / world if world > 1 else 0.0


def _baseline_stats(blocked: float, bytes_sent: float) -> dict[str, Any]:
    return {"consensus_distance": None, "mix2_seconds": blocked, "mix1_wait_seconds": None, "mix1_seconds": None,
            "failed_exchanges": 0, "skipped_exchanges": 0, "bytes_sent": bytes_sent}


class DDP(Periodic):
    """``DistributedDataParallel``: the gradients are all-reduced in every backward pass. Blocked seconds: from the
    last gradient bucket being handed to the all-reduce to ``backward()`` returning; bytes: the buckets' bytes
    times 2 (M-1)/M. ``sync_every`` only groups the steps into rounds for the rows."""

    method = "ddp"
    label = "DDP baseline"

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, *, sync_every: int, grad_clip: float,
                 world: int):
        super().__init__(model, inner, sync_every=sync_every, grad_clip=grad_clip, layout=Layout(world))
        self.world = world
        self._bytes = 0
        self._ready = 0.0  # when the last gradient bucket was handed to the all-reduce
        if world > 1:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(model)

            def counting_allreduce(state, bucket):  # no annotations: DDP checks them (strings under __future__)
                buf = bucket.buffer()
                self._bytes += buf.numel() * buf.element_size()
                self._ready = time.perf_counter()
                return default_hooks.allreduce_hook(None, bucket)

            self.module.register_comm_hook(None, counting_allreduce)

    def after_backward(self) -> None:
        if self.world > 1:  # backward() returned when the last bucket's all-reduce did
            self.blocked += time.perf_counter() - self._ready

    def round_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        sent, self._bytes = self._bytes * _ring(self.world), 0
        return _baseline_stats(stats["blocked_seconds"], sent)


class LocalSGD(Periodic):
    """Local SGD with PyTorch's own ``PeriodicModelAverager``: parameters averaged (all-reduce) after every
    ``sync_every``-th step (``warmup_steps = H - 1`` aligns the averaging with the other methods' rounds). Rank 0's
    parameters are broadcast first. Blocked seconds: those inside ``average_parameters``."""

    method = "localsgd"
    label = "local SGD baseline (PeriodicModelAverager)"

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, *, sync_every: int, grad_clip: float,
                 world: int):
        super().__init__(model, inner, sync_every=sync_every, grad_clip=grad_clip, layout=Layout(world))
        self.world = world
        self._bytes = 0
        self.averager = None
        if world > 1:
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            with torch.no_grad():
                for t in model.parameters():
                    dist.broadcast(t.data, src=0)
            self.averager = PeriodicModelAverager(period=sync_every, warmup_steps=sync_every - 1)

    def step(self) -> None:
        self.inner.step()
        a = self.averager
        if a is not None:  # before zero_grad: PeriodicModelAverager averages parameters with a .grad
            t0 = time.perf_counter()
            if a.step >= a.warmup_steps and (a.step - a.warmup_steps) % a.period == 0:
                self._bytes += 4 * sum(p.numel() for p in self.model.parameters())
            a.average_parameters(self.model.parameters())
            self.blocked += time.perf_counter() - t0
        self.inner.zero_grad(set_to_none=True)

    def round_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        sent, self._bytes = self._bytes * _ring(self.world), 0
        return _baseline_stats(stats["blocked_seconds"], sent)


class FGDiLoCoSync(Synchroniser):
    """:class:`fgdiloco.FGDiLoCo` around the inner optimizer: a round ends with every ``sync_every``-th step (the
    wrapper's step hook), the last one early (``sync()``). ``wrapper`` goes to ``FGDiLoCo`` (``process_group``,
    ``transport``, ``mesh``, ``elastic``); ``opt`` is the wrapper."""

    method = "fgdiloco"
    label = "Factored Gossip DiLoCo"

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, config: FGDiLoCoConfig, *,
                 grad_clip: float, layout: Layout | None = None, **wrapper: Any):
        from ..outer import FGDiLoCo

        super().__init__(model, inner, grad_clip=grad_clip, layout=layout)
        self.opt = FGDiLoCo(model, inner, config, **wrapper)
        if layout is None:
            self.layout = Layout(self.opt.world_size)
        self._before: tuple[int, Any, int] = (0, None, 0)
        self._move: tuple[int, int] | None = None

    def step(self) -> None:
        o = self.opt
        self._before = (o.round, o.last_round, o.rejoins)
        o.step()
        o.zero_grad(set_to_none=True)

    def end_of_step(self, step: int, last: bool) -> RoundEnd | None:
        o = self.opt
        before, seen, rejoins = self._before
        if o.round == before and last:
            o.sync()  # end the last, shorter round
        if o.last_round is seen:  # the round goes on (or the step joined a later round)
            if o.rejoins != rejoins:
                self._move = (before, o.round)
            return None
        done = o.last_round.round + 1
        if o.rejoins != rejoins:  # fell behind: sync() moved on to the live round
            self._move = (done, o.round)
        return RoundEnd(done, o.last_round.as_dict())

    def moved(self) -> tuple[int, int] | None:
        move, self._move = self._move, None
        return move

    def paused(self) -> contextlib.AbstractContextManager[Any]:
        return self.opt.paused()

    def close(self) -> None:
        self.opt.close()


class _Pipelined:
    """The pipeline part of a stage's synchroniser: the replica's batch through its stages
    (:class:`fgdiloco.pipeline.Pipeline`, 1F1B, ``microbatches``), a subspace model's boundaries sending its k
    coefficients per token, gradients clipped by the norm of the whole replica, evaluation through the stages."""

    model: torch.nn.Module
    grad_clip: float
    autocast: Any

    def _init_pipeline(self, mesh: Any, microbatches: int) -> None:
        from ..pipeline import Pipeline
        from .model import activation_codec_for, lm_loss

        self.mesh = mesh
        self.pipe = Pipeline(self.model, mesh, lm_loss, n_microbatches=microbatches, schedule="1f1b",
                             activation_codec=activation_codec_for(self.model),
                             device=next(self.model.parameters()).device)
        self._bubble = 0.0  # sum of the steps' bubble fractions

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        with self.autocast():
            loss = self.pipe.step(x, y)  # forward + backward of the replica's batch through its stages
        self._bubble += self.pipe.last_step.bubble
        if self.grad_clip > 0:
            clip_replica_gradients(list(self.model.parameters()), self.grad_clip, self.mesh.pipeline_group)
        return None if loss is None else loss.item()

    def evaluate(self, batches: list[Batch]) -> float:
        """Held-out loss through the replica's pipeline (collective over its stages): the mean over ``batches`` on
        the last stage, 0.0 on the others."""
        was_training = self.model.training
        self.model.eval()
        losses = [self.pipe.eval_loss(x, y) for x, y in batches]
        self.model.train(was_training)
        if losses[0] is None:
            return 0.0
        return sum(float(v) for v in losses) / len(batches)

    def metrics(self) -> dict[str, float]:
        steps = self.pipe.steps
        return {"activation_bytes_sent": float(self.pipe.activation_bytes_sent_total),
                "pipeline_bubble": self._bubble / steps if steps else 0.0}


class PipelineStage(_Pipelined, FGDiLoCoSync):
    """FG-DiLoCo on one stage of a replica's pipeline (``mesh``): gossip among the same stage of the replicas, the
    replica's batch through its stages (:class:`_Pipelined`)."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, config: FGDiLoCoConfig, *,
                 grad_clip: float, mesh: Any, microbatches: int):
        layout = Layout(mesh.replicas * mesh.stages, mesh.stages, holds_loss=mesh.is_last_stage,
                        reports_loss=mesh.is_last_stage and mesh.replica == 0)
        FGDiLoCoSync.__init__(self, model, inner, config, grad_clip=grad_clip, layout=layout, mesh=mesh)
        self._init_pipeline(mesh, microbatches)


def clip_replica_gradients(params: list[torch.Tensor], max_norm: float, group: Any) -> None:
    """Clip by the gradient norm of the whole replica (all its stages), as ``clip_grad_norm_`` does for the unsplit
    model: one all-reduce of the squared stage norms over the pipeline group."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    sq = (norm.double() ** 2).reshape(1)
    dist.all_reduce(sq, group=group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt().to(norm.dtype)[0])


def group_synchroniser(cfg: TrainConfig, model: torch.nn.Module, inner: torch.optim.Optimizer, *, world: int,
                       mesh: Any = None) -> Synchroniser:
    """The synchroniser of a group worker (one process group): the baseline ``cfg.baseline`` names, a pipeline stage
    (``mesh``), or FG-DiLoCo on the default group. Collective: every rank builds it."""
    if cfg.baseline == "ddp":
        return DDP(model, inner, sync_every=cfg.sync_every, grad_clip=cfg.grad_clip, world=world)
    if cfg.baseline == "localsgd":
        return LocalSGD(model, inner, sync_every=cfg.sync_every, grad_clip=cfg.grad_clip, world=world)
    if mesh is not None:
        return PipelineStage(model, inner, cfg.fgdiloco_config(), grad_clip=cfg.grad_clip, mesh=mesh,
                             microbatches=cfg.microbatches)
    return FGDiLoCoSync(model, inner, cfg.fgdiloco_config(), grad_clip=cfg.grad_clip)


# ---------------------------------------------------------------------------------------------------- elastic
def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a worker killed mid-write keeps its previous checkpoint


class ElasticFGDiLoCo(FGDiLoCoSync):
    """FG-DiLoCo as worker ``worker`` of an elastic job (``FGDiLoCo(..., elastic=True)``: its own torchrun job, no
    collective over all workers).

    :meth:`restore` continues ``checkpoint`` when there is one (the wrapper's state, the batch generator, the
    clocks, the rejoins); :meth:`start` joins the job's live round; every ``checkpoint_every`` rounds, after the
    last and when stopped early the worker saves ``checkpoint`` atomically. ``rejoins_total``: this worker's
    rejoins over all its lives.
    """

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, config: FGDiLoCoConfig, *,
                 grad_clip: float, checkpoint: Path, run_id: str | None, worker: int, checkpoint_every: int,
                 **wrapper: Any):
        FGDiLoCoSync.__init__(self, model, inner, config, grad_clip=grad_clip, elastic=True, **wrapper)
        self.checkpoint = Path(checkpoint)
        self.run_id, self.worker, self.checkpoint_every = run_id, worker, checkpoint_every
        self.rejoins_total = 0
        self.resumed_round: int | None = None

    def restore(self, batches: Batches, clock: Clock, start_round: int = 0, first_life: bool = True) -> int | None:
        """Load :attr:`checkpoint` when it exists; returns its round (None: none, the seeded initial model).

        ``start_round``: the round every worker of a resumed job starts at (the newest of their checkpoints): a
        first life whose checkpoint is older starts there (a round boundary: its parameters are the anchor, as a
        rejoin does).

        Raises:
            ValueError: the checkpoint belongs to another run or worker.
        """
        if not self.checkpoint.is_file():
            return None
        state = torch.load(self.checkpoint, map_location="cpu", weights_only=False)
        if state.get("run_id") != self.run_id or state.get("worker") != self.worker:
            raise ValueError(f"{self.checkpoint} belongs to run {state.get('run_id')!r} worker "
                             f"{state.get('worker')!r}, not run {self.run_id!r} worker {self.worker}")
        saved = state["fgdiloco"]
        if first_life and start_round > saved["round"]:
            saved = {**saved, "round": start_round}
        self.opt.load_state_dict(saved)
        batches.generator.set_state(state["batches"])
        clock.base_wall, clock.excluded_seconds = float(state["wall_seconds"]), float(state["eval_seconds"])
        self.rejoins_total = int(state["rejoins"])
        self.resumed_round = int(state["round"])
        self.resumed = True
        return self.resumed_round

    def start(self) -> int:
        frm = self.resumed_round if self.resumed_round is not None else self.opt.round
        self.opt.rejoin()  # a restarted worker or a late joiner enters the job's live round
        if self.opt.round != frm:
            self._move = (frm, self.opt.round)
        return self.opt.round * self.opt.steps_per_round

    def moved(self) -> tuple[int, int] | None:
        move = super().moved()
        if move is not None:
            self.rejoins_total += 1
        return move

    def end_round(self, loop: Loop) -> None:
        r = self.opt.round
        if r % self.checkpoint_every == 0 or r >= loop.rounds or loop.stop:
            self.save(loop)

    def save(self, loop: Loop) -> None:
        """Save the checkpoint now (not training time)."""
        with self.opt.paused(), loop.clock.excluded():
            r = self.opt.round
            _save_checkpoint(self.checkpoint, {
                "format": CHECKPOINT_FORMAT, "run_id": self.run_id, "worker": self.worker, "round": r,
                "step": min(r * self.opt.steps_per_round, loop.steps), "fgdiloco": self.opt.state_dict(),
                "batches": loop.batches.generator.get_state(), "wall_seconds": loop.clock.wall(),
                "eval_seconds": loop.clock.excluded_seconds, "rejoins": self.rejoins_total, "time": time.time()})


class ElasticPipelineStage(_Pipelined, ElasticFGDiLoCo):
    """One stage of a replica of an elastic pipeline job: the replica is one torchrun job of ``stages`` processes
    (``mesh = ReplicaMesh(1, stages)`` over its group), the unit that fails and restarts together; this stage
    gossips with the same stage of the other replicas (``FGDiLoCo(..., mesh=mesh, elastic=True)``: a job of its own
    on the store per stage), keeps its own checkpoint, and joins the live round together with its replica's other
    stages."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, config: FGDiLoCoConfig, *,
                 grad_clip: float, checkpoint: Path, run_id: str | None, worker: int, checkpoint_every: int,
                 mesh: Any, microbatches: int, replicas: int):
        layout = Layout(replicas * mesh.stages, mesh.stages, holds_loss=mesh.is_last_stage,
                        reports_loss=mesh.is_last_stage)
        ElasticFGDiLoCo.__init__(self, model, inner, config, grad_clip=grad_clip, checkpoint=checkpoint,
                                 run_id=run_id, worker=worker, checkpoint_every=checkpoint_every, mesh=mesh,
                                 layout=layout)
        self._init_pipeline(mesh, microbatches)

    def restore(self, batches: Batches, clock: Clock, start_round: int = 0, first_life: bool = True) -> int | None:
        """:meth:`ElasticFGDiLoCo.restore`, then every stage takes the first stage's batch generator (collective
        over the replica's stages): their checkpoints can be a round apart (a death between two stages' saves), and
        stages that draw different batches train on inputs that do not match their targets (seen in
        ``benchmarks.chaos --pipeline``: a replica stuck at the loss of chance)."""
        resumed = super().restore(batches, clock, start_round, first_life)
        state = batches.generator.get_state()
        dist.broadcast(state, group=self.mesh.pipeline_group, group_src=0)
        batches.generator.set_state(state)
        return resumed
