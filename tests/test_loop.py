"""The example job's one training loop (fgdiloco.pretrain.loop) against stand-in synchronisers and reporters: rounds,
evaluation points, the last shorter round, a worker moved to the live round, deferred evaluation, stopping. Fast:
one process, a linear model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fgdiloco.pretrain.loop import Clock, Loop, Periodic, Point, Reporter, RoundEnd, Synchroniser


class Linear(nn.Module):
    """``model(x, y) -> (prediction, mean squared error)``, as the GPT's ``(logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = x @ self.w
        return pred, ((pred - y) ** 2).mean()


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 3, generator=g)
    return x, x @ torch.tensor([1.0, -2.0, 0.5])


EVAL = [_batches(10_000)]


class Every(Periodic):
    """A round every ``sync_every`` steps; nothing is exchanged."""

    def __init__(self, sync_every: int):
        model = Linear()
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=sync_every)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class Notes(Reporter):
    def __init__(self, stop_at: int | None = None):
        self.points: list[Point] = []
        self.rounds: list[int] = []
        self.late: list[tuple[int, float]] = []
        self.moves: list[tuple[int, int, int]] = []
        self.stop_at = stop_at
        self.started = 0

    def start(self) -> None:
        self.started += 1

    def round_done(self, end: RoundEnd) -> None:
        self.rounds.append(end.done)

    def record(self, point: Point) -> bool:
        self.points.append(point)
        return self.stop_at is not None and point.round >= self.stop_at

    def evaluated(self, point: Point, loss: float) -> None:
        self.late.append((point.round, loss))

    def rejoined(self, from_round: int, to_round: int, step: int) -> None:
        self.moves.append((from_round, to_round, step))


def test_rounds_evaluation_points_and_the_last_shorter_round():
    sync, notes = Every(4), Notes()
    out = Loop(sync, notes, _batches, EVAL, steps=10, sync_every=4, eval_every=2).run()
    assert notes.started == 1 and notes.rounds == [1, 2, 3]  # 4 + 4 + 2 steps
    assert [(p.step, p.round) for p in notes.points] == [(0, 0), (8, 2), (10, 3)]  # every 2nd round and the last
    assert notes.points[0].train_loss is None and notes.points[0].stats is None
    assert all(p.eval_loss is not None for p in notes.points)
    assert notes.points[-1].eval_loss < notes.points[0].eval_loss  # it trained
    assert 0 <= notes.points[1].stats["utilisation"] <= 1 and notes.points[1].stats["blocked_seconds"] == 0.0
    assert out.steps == 10 and not out.stopped and sync.closed >= 1
    assert out.train_seconds <= out.wall_seconds and out.clock.excluded_seconds > 0  # evaluation left out


def test_a_point_carries_what_the_rounds_since_the_last_one_add_up_to():
    """With eval_every > 1 a point's own round is not all that was sent: its stats carry the rounds since the last
    point (bytes and exchanges summed, utilisation averaged), which the rows' totals are made of."""

    class Sending(Every):
        def round_stats(self, stats):
            n = self._done + 1  # the round that ends: 1, 2, 3
            return {"bytes_sent": 100.0 * n, "failed_exchanges": n, "skipped_exchanges": 1, "utilisation": n / 10}

    notes = Notes()
    Loop(Sending(2), notes, _batches, EVAL, steps=6, sync_every=2, eval_every=2).run()
    (_, two, three) = notes.points  # rounds 0, 2 and the last, 3
    assert two.stats["bytes_sent"] == 200.0 and two.stats["bytes_sent_since_point"] == 300.0  # rounds 1 + 2
    assert two.stats["failed_exchanges_since_point"] == 3 and two.stats["skipped_exchanges_since_point"] == 2
    assert two.stats["rounds_since_point"] == 2 and two.stats["utilisation_since_point"] == pytest.approx(0.15)
    assert three.stats["bytes_sent_since_point"] == 300.0 and three.stats["rounds_since_point"] == 1  # round 3


def test_train_loss_is_the_mean_of_the_rounds_steps():
    seen: list[float] = []

    class Recording(Every):
        def backward(self, x, y):
            loss = super().backward(x, y)
            seen.append(loss)
            return loss

    notes = Notes()
    Loop(Recording(3), notes, _batches, EVAL, steps=6, sync_every=3).run()
    assert [p.train_loss for p in notes.points[1:]] == pytest.approx([sum(seen[:3]) / 3, sum(seen[3:]) / 3])


def test_deferred_points_are_evaluated_after_training_with_the_weights_they_had():
    sync, notes = Every(2), Notes()
    Loop(sync, notes, _batches, EVAL, steps=6, sync_every=2, deferred=True).run()
    assert all(p.eval_loss is None for p in notes.points)
    assert [r for r, _ in notes.late] == [0, 1, 2, 3]
    again = Notes()
    Loop(Every(2), again, _batches, EVAL, steps=6, sync_every=2).run()  # the same run, evaluated as it goes
    assert [v for _, v in notes.late] == pytest.approx([p.eval_loss for p in again.points])


def test_a_reporter_stops_training_after_the_point_it_says():
    notes = Notes(stop_at=2)
    out = Loop(Every(2), notes, _batches, EVAL, steps=100, sync_every=2).run()
    assert [p.round for p in notes.points] == [0, 1, 2] and out.steps == 4 and out.stopped


def test_after_step_sees_every_step():
    steps: list[int] = []
    Loop(Every(2), Notes(), _batches, EVAL, steps=5, sync_every=2, after_step=steps.append).run()
    assert steps == [1, 2, 3, 4, 5]


class Jumps(Synchroniser):
    """A worker that is moved to round 3 after its 3rd step (mid-round 1): an elastic worker that fell behind."""

    def __init__(self) -> None:
        model = Linear()
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=0.05))
        self.round = 0
        self._move: tuple[int, int] | None = None
        self.taken: list[int] = []
        self.ends: list[int] = []

    def end_of_step(self, step: int, last: bool) -> RoundEnd | None:
        self.taken.append(step)
        if step == 3:
            self._move, self.round = (1, 3), 3
            return None
        if step % 2 == 0 or last:
            self.round += 1
            return RoundEnd(self.round, {"utilisation": 1.0})
        return None

    def moved(self) -> tuple[int, int] | None:
        move, self._move = self._move, None
        return move

    def end_round(self, loop: Loop) -> None:
        self.ends.append(self.round)


def test_a_moved_worker_continues_at_the_live_round():
    sync, notes = Jumps(), Notes()
    out = Loop(sync, notes, _batches, EVAL, steps=10, sync_every=2).run()
    assert notes.moves == [(1, 3, 6)]  # told where it was, where it is and that round's first step
    assert sync.taken == [1, 2, 3, 7, 8, 9, 10]  # steps 4-6 belong to the rounds it skipped
    assert [p.round for p in notes.points] == [0, 1, 4, 5] and notes.points[2].step == 8
    assert sync.ends == [1, 4, 5] and out.steps == 10


def test_a_restored_clock_continues():
    clock = Clock(wall=100.0, excluded=30.0)
    notes = Notes()
    Loop(Every(2), notes, _batches, EVAL, steps=2, sync_every=2, clock=clock).run()
    assert notes.points[0].wall_seconds >= 100.0 and notes.points[0].train_seconds >= 70.0
