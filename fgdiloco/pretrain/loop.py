"""The example job's training loop, once, with two pluggable parts (as Lightning's ``Trainer`` runs one loop with a
strategy and loggers plugged in).

* A :class:`Synchroniser` keeps this worker's replica together with the others: it runs the forward and backward
  pass (``backward``: the whole model, or one pipeline stage with its replica-wide clipping and the loss from the
  last stage), the optimizer step (``step``), says when an outer round ended and with what statistics
  (``end_of_step``), when the worker was moved to another round (``moved``: an elastic worker rejoining the live
  round), what to do between rounds (``end_round``: an elastic worker's checkpoint) and how to evaluate
  (``evaluate``). :mod:`fgdiloco.pretrain.sync` has DDP, local SGD, FG-DiLoCo on a process group, a pipeline stage
  and elastic FG-DiLoCo; ``benchmarks/peers.py`` plugs in torchft's DiLoCo and Streaming DiLoCo.
* A :class:`Reporter` is told about every round (``round_done``), every evaluation point (``record``, which also
  says whether to stop), every rejoin, and the end (``finish``): :mod:`fgdiloco.pretrain.reports` has one collective
  row per evaluation for a group job and per-worker reports (merged later) for an elastic job; the benchmarks
  keep their own.

:class:`Loop` runs ``steps`` inner steps from where the synchroniser starts: batch, ``backward``, ``step``, then at
each round end the round's mean training loss, and every ``eval_every`` rounds (and after the last) an evaluation
point, inside ``synchroniser.paused()`` and left out of the training clock (:class:`Clock`). With ``deferred`` the
weights of each point are kept and evaluated after training, so nothing but training runs between rounds.

Counting: ``step`` is inner steps done, ``round`` outer rounds done (1-based; 0: before training), as in
``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .recipe import held_out_loss

__all__ = ["Clock", "Layout", "Loop", "Outcome", "Point", "Reporter", "RoundEnd", "Synchroniser"]

Batch = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------------- values
@dataclass(frozen=True)
class RoundEnd:
    """An outer round that ended: ``done`` rounds are done now; ``stats`` the synchroniser's statistics of it
    (``RoundStats.as_dict()`` for FG-DiLoCo; ``utilisation``, ``round_seconds``, ``blocked_seconds``, ... for
    the others)."""

    done: int
    stats: dict[str, Any]


@dataclass
class Point:
    """One evaluation point, as the loop hands it to the reporter. Seconds since training started."""

    step: int
    round: int
    wall_seconds: float
    train_seconds: float  # evaluation and checkpoints excluded
    eval_loss: float | None  # None: deferred (Reporter.evaluated gives it after training)
    train_loss: float | None  # mean over the round's inner steps (None at round 0)
    # the round's (None at round 0), and <key>_since_point: bytes_sent, failed_exchanges, skipped_exchanges summed
    # and utilisation averaged over the rounds since the last point (rounds_since_point of them)
    stats: dict[str, Any] | None


@dataclass(frozen=True)
class Layout:
    """Where this worker sits in the job: ``workers`` processes, ``stages`` per replica; whether it computes the
    model's loss (a pipeline's last stage) and whether its loss is the one the rows report (replica 0's)."""

    workers: int = 1
    stages: int = 1
    holds_loss: bool = True
    reports_loss: bool = True

    @property
    def replicas(self) -> int:
        return self.workers // self.stages


class Clock:
    """Seconds since training started (``wall``) and those of them spent on evaluation, reports and checkpoints
    (``excluded_seconds``); ``train`` is the difference. A restarted worker continues its clocks from a checkpoint
    (``wall``, ``excluded``)."""

    def __init__(self, wall: float = 0.0, excluded: float = 0.0):
        self.base_wall = wall
        self.excluded_seconds = excluded
        self._t0: float | None = None
        self._cpu0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._cpu0 = _cpu_seconds()

    def wall(self) -> float:
        return self.base_wall + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def train(self) -> float:
        return self.wall() - self.excluded_seconds

    def cpu(self) -> float:
        """CPU seconds this process used since :meth:`start` (all its threads)."""
        return _cpu_seconds() - self._cpu0

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Leave the time inside out of the training seconds."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excluded_seconds += time.perf_counter() - t0


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@dataclass
class Outcome:
    """How the loop ended: inner steps done, the clocks when training ended (before any deferred evaluation),
    the CPU seconds used while training, whether a reporter stopped it early; ``clock`` as it is now."""

    steps: int
    wall_seconds: float
    train_seconds: float
    cpu_seconds: float
    stopped: bool
    clock: Clock = field(repr=False)


# ---------------------------------------------------------------------------------------------------- the parts
class Synchroniser:
    """How a worker's replica is kept together with the others; the loop's pluggable part.

    This base trains the replica alone: ``model(x, y)`` returns ``(logits, loss)``; the loss is backpropagated, the
    gradients clipped to a global norm of ``grad_clip`` (0: off), the inner optimizer steps. Subclasses say when a
    round ends (:meth:`end_of_step`) and how the replicas meet.

    Attributes:
        model: the worker's model (or pipeline stage): what is evaluated and what a deferred evaluation keeps.
        module: what the forward pass runs through (``model``, or a ``DistributedDataParallel`` around it).
        layout: where the worker sits (:class:`Layout`).
        method: the method's name in ``run.json`` (``"fgdiloco"``, ``"ddp"``, ...); ``label``: its title.
        resumed: the worker continues a checkpoint (then there is no evaluation before its first step).
    """

    method = "local"
    label = "one replica"
    resumed = False
    #: the precision of the forward passes (:meth:`fgdiloco.pretrain.device.Placement.autocast`; default: as is)
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, *, grad_clip: float = 0.0,
                 layout: Layout | None = None):
        self.model = model
        self.module: torch.nn.Module = model
        self.inner = inner
        self.grad_clip = grad_clip
        self.layout = layout or Layout()

    def start(self) -> int:
        """Called once before the first step; returns the first inner step (0; a rejoining worker: its round's)."""
        return 0

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Forward and backward of one batch (and clipping); the batch's loss, None where this worker holds none."""
        with self.autocast():
            _, loss = self.module(x, y)
        loss.backward()
        self.after_backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        return loss.item()

    def after_backward(self) -> None:
        """Between the backward pass and clipping (DDP: the gradients have just been all-reduced)."""

    def step(self) -> None:
        """The inner optimizer's step, then ``zero_grad``."""
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)

    def end_of_step(self, step: int, last: bool) -> RoundEnd | None:
        """After inner step ``step`` (steps done; ``last``: the run's last): the round that ended with it, or None
        while the round goes on. On the last step a round in progress is ended early."""
        raise NotImplementedError

    def moved(self) -> tuple[int, int] | None:
        """``(from_round, to_round)`` once after this worker was moved to another round (an elastic worker that
        fell behind or restarted joins the live round); None otherwise."""
        return None

    def end_round(self, loop: Loop) -> None:
        """After a round's evaluation point (an elastic worker's checkpoint)."""

    def paused(self) -> contextlib.AbstractContextManager[Any]:
        """What evaluation and reports run inside: time that is not any round's."""
        return contextlib.nullcontext()

    def evaluate(self, batches: list[Batch]) -> float:
        """Held-out loss of the replica (nats/token) on ``batches``; a pipeline stage without the loss: 0.0."""
        return held_out_loss(self.model, batches)

    def metrics(self) -> dict[str, float]:
        """Counters kept beside the round statistics (a pipeline's activation bytes and bubble)."""
        return {}

    def close(self) -> None:
        """Stop synchronising (called once training ended, again on errors: it must be idempotent)."""


class Periodic(Synchroniser):
    """A synchroniser whose outer rounds are every ``sync_every`` inner steps the loop counts (DDP, local SGD,
    torchft). Subclasses add the seconds blocked in communication to ``blocked``; a round's statistics are
    ``utilisation`` (1 - blocked / round seconds), ``round_seconds`` (evaluation excluded) and
    ``blocked_seconds``, plus what :meth:`round_stats` adds."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, *, sync_every: int,
                 grad_clip: float = 0.0, layout: Layout | None = None):
        super().__init__(model, inner, grad_clip=grad_clip, layout=layout)
        self.sync_every = sync_every
        self.blocked = 0.0
        self._done = 0
        self._t_round = time.perf_counter()

    def start(self) -> int:
        self._t_round = time.perf_counter()
        return 0

    def end_of_step(self, step: int, last: bool) -> RoundEnd | None:
        if step % self.sync_every and not last:
            return None
        round_seconds = max(time.perf_counter() - self._t_round, 1e-9)
        stats = {"utilisation": min(max(1.0 - self.blocked / round_seconds, 0.0), 1.0),
                 "round_seconds": round_seconds, "blocked_seconds": self.blocked}
        stats.update(self.round_stats(stats))
        self.blocked = 0.0
        self._t_round = time.perf_counter()
        self._done += 1
        return RoundEnd(self._done, stats)

    def round_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """More statistics of the round that just ended (called once per round)."""
        return {}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        try:
            yield
        finally:
            self._t_round = time.perf_counter()  # the round's seconds start after the evaluation


class Reporter:
    """What becomes of the loop's measurements; the loop's other pluggable part. Every method has a default that
    does nothing."""

    def start(self) -> None:
        """Before the first step (``run.json``, a worker's ``start`` event)."""

    def round_done(self, end: RoundEnd) -> None:
        """After every round (totals so far), before its evaluation point if it has one."""

    def record(self, point: Point) -> bool:
        """An evaluation point; returns True when training should stop after it (``max_seconds``)."""
        return False

    def evaluated(self, point: Point, loss: float) -> None:
        """The held-out loss of a deferred point, after training (in the order of the points)."""

    def rejoined(self, from_round: int, to_round: int, step: int) -> None:
        """The worker was moved from ``from_round`` to ``to_round`` (whose first step is ``step``)."""

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        """After training (and any deferred evaluation): the run's or the worker's summary."""
        return {}

    def close(self) -> None:
        """Release files; called once, also after errors."""


# ---------------------------------------------------------------------------------------------------- the loop
#: Round statistics summed over the rounds between two evaluation points (``<key>_since_point``).
_SUMMED = ("bytes_sent", "failed_exchanges", "skipped_exchanges")


class Loop:
    """``steps`` inner steps of one worker, synchronised by ``sync`` and reported to ``reporter``.

    Args:
        sync, reporter: the pluggable parts.
        batches: ``batches(step)`` gives inner step ``step``'s ``(inputs, targets)`` (it may set the learning rate).
        eval_set: the held-out batches of every evaluation.
        steps: inner steps per worker; sync_every: H (a round's step is ``min(round * H, steps)``).
        eval_every: rounds between evaluation points (the last round always has one).
        deferred: keep the weights of each point and evaluate them after training.
        clock: the training clock (a restarted worker's continues from its checkpoint).
        after_step: called with the steps done after every inner step (fault injection).
    """

    def __init__(self, sync: Synchroniser, reporter: Reporter, batches: Callable[[int], Batch],
                 eval_set: list[Batch], *, steps: int, sync_every: int, eval_every: int = 1, deferred: bool = False,
                 clock: Clock | None = None, after_step: Callable[[int], Any] | None = None):
        self.sync, self.reporter = sync, reporter
        self.batches, self.eval_set = batches, eval_set
        self.steps, self.sync_every, self.eval_every = steps, sync_every, eval_every
        self.deferred = deferred
        self.clock = clock or Clock()
        self.after_step = after_step
        self.stop = False
        self._kept: list[tuple[Point, dict[str, torch.Tensor]]] = []
        self._since: dict[str, float] = {}  # the rounds since the last evaluation point (see _add_since)

    @property
    def rounds(self) -> int:
        """Outer rounds per run (the last one may be shorter than ``sync_every``)."""
        return -(-self.steps // self.sync_every)

    def run(self) -> Outcome:
        """Train, then evaluate the kept weights (``deferred``); the synchroniser is closed on the way out."""
        try:
            self.reporter.start()
            step = self.sync.start()
            moved = self._moved()
            step = step if moved is None else moved
            self.clock.start()
            if step == 0 and not self.sync.resumed:
                self._evaluation_point(0, 0, None, None)
            step = self._train(step)
            outcome = Outcome(steps=step, wall_seconds=self.clock.wall(), train_seconds=self.clock.train(),
                              cpu_seconds=self.clock.cpu(), stopped=self.stop and step < self.steps,
                              clock=self.clock)
            self.sync.close()
            self._evaluate_kept()
            return outcome
        finally:
            self.sync.close()

    def _train(self, step: int) -> int:
        losses: list[float] = []
        while step < self.steps and not self.stop:
            x, y = self.batches(step)
            loss = self.sync.backward(x, y)
            self.sync.step()
            losses.append(0.0 if loss is None else loss)  # 0.0: a pipeline stage without the loss
            step += 1
            if self.after_step is not None:
                self.after_step(step)
            end = self.sync.end_of_step(step, step >= self.steps)
            if end is None:  # the round goes on (or the step joined a later round)
                moved = self._moved()
                if moved is not None:
                    step, losses = moved, []
                continue
            step = self._end_round(end, step, sum(losses) / len(losses))
            losses = []
        return step

    def _end_round(self, end: RoundEnd, step: int, train_loss: float) -> int:
        self.reporter.round_done(end)
        self._add_since(end.stats)
        if end.done % self.eval_every == 0 or step >= self.steps:
            stats = {**end.stats, **{f"{k}_since_point": v for k, v in self._since.items()}}
            stats["utilisation_since_point"] = stats.pop("utilisation_sum_since_point") / max(self._since["rounds"], 1)
            self._since = {}
            self._evaluation_point(min(end.done * self.sync_every, self.steps), end.done, train_loss, stats)
        moved = self._moved()  # the round ended and the worker fell behind: it continues at the live round
        self.sync.end_round(self)
        return step if moved is None else moved

    def _add_since(self, stats: dict[str, Any]) -> None:
        """Count a round into the totals the next evaluation point carries (``<key>_since_point``: bytes and
        exchanges summed, utilisation averaged, ``rounds``): with ``eval_every`` > 1 a point's own round is not
        all that was sent since the last one."""
        since = self._since
        for key in _SUMMED:
            since[key] = since.get(key, 0.0) + float(stats.get(key) or 0.0)
        since["utilisation_sum"] = since.get("utilisation_sum", 0.0) + float(stats.get("utilisation") or 0.0)
        since["rounds"] = since.get("rounds", 0) + 1

    def _moved(self) -> int | None:
        move = self.sync.moved()
        if move is None:
            return None
        frm, to = move
        self.reporter.rejoined(frm, to, min(to * self.sync_every, self.steps))
        return to * self.sync_every

    def _evaluation_point(self, step: int, rnd: int, train_loss: float | None, stats: dict[str, Any] | None) -> None:
        with self.sync.paused(), self.clock.excluded():  # evaluation is not training time
            point = Point(step=step, round=rnd, wall_seconds=self.clock.wall(), train_seconds=self.clock.train(),
                          eval_loss=None if self.deferred else self.sync.evaluate(self.eval_set),
                          train_loss=train_loss, stats=stats)
            self.stop = bool(self.reporter.record(point))
            if self.deferred:
                self._kept.append((point, _copy(self.sync.model)))

    def _evaluate_kept(self) -> None:
        if not self._kept:
            return
        with self.clock.excluded():
            model = self.sync.model
            live = _copy(model)
            for point, weights in self._kept:
                model.load_state_dict(weights)
                self.reporter.evaluated(point, self.sync.evaluate(self.eval_set))
            model.load_state_dict(live)
        self._kept = []


def _copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
