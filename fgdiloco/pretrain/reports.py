"""The example job's reporters (:class:`fgdiloco.pretrain.loop.Reporter`): what becomes of the loop's measurements.

* :class:`GroupRows`: a group job (one process group): at every evaluation point one all-reduce over the ranks
  makes the row (rank 0's values and the means over replicas or workers, totals so far); rank 0 writes
  ``run.json`` before the first step, ``metrics.jsonl`` row by row, and at the end ``summary.json`` and
  ``loss.png`` (:mod:`fgdiloco.pretrain.results` describes every field). The collective also agrees on stopping:
  any rank past ``max_seconds`` stops them all after the same round.
* :class:`WorkerEvents`: one worker of an elastic job: no collective; it appends what it measures to its own file,
  ``<out>/workers/worker<k>.jsonl`` (:data:`EVENTS`), which the launcher merges
  (:class:`fgdiloco.pretrain.merge.Merger`). The first worker past ``max_seconds`` writes its next evaluation
  point's round into ``<out>/workers/stop``; every worker stops at that point (at once when already past it).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import TrainConfig
from .loop import Outcome, Point, Reporter, RoundEnd, Synchroniser
from .recipe import net_bytes, peak_rss_bytes
from .results import format_round, plot, rows_path, stop_path, summarise, write_json

__all__ = ["EVENTS", "GroupRows", "WorkerEvents"]

#: The lines of ``<out>/workers/worker<k>.jsonl``, by their ``"event"`` field.
EVENTS: dict[str, str] = {
    "start": "a process took the slot: worker, life (torchrun's restart count), pid, time (unix s), info (what "
             "run.json holds), resumed_round (the round of the checkpoint it loaded; None: the seeded init)",
    "row": "an evaluation point: round, step, eval_loss, train_loss, utilisation, bytes_sent, failed_exchanges, "
           "skipped_exchanges (the round's), bytes_sent_since_point, failed_exchanges_since_point, "
           "skipped_exchanges_since_point, utilisation_since_point, rounds_since_point (the rounds since the "
           "worker's last row: one unless --eval-every > 1), consensus_distance, mix timings, rejoins (this "
           "worker's, all lives), "
           "peak_rss_bytes, wall_seconds and train_seconds (the worker's clocks, continued from its checkpoint), "
           "time (unix s)",
    "rejoin": "the worker joined the job's live round: round (joined), from_round (where it was), step, life, "
              "time (unix s)",
    "end": "the worker finished (or stopped at --max-seconds): round, step, clocks, peak_rss_bytes, rejoins",
}

#: Round statistics a worker's row carries as they are.
_ROUND_KEYS = ("utilisation", "bytes_sent", "mix2_seconds", "mix1_wait_seconds", "mix1_seconds", "round_seconds",
               "consensus_distance", "failed_exchanges", "skipped_exchanges")
_PIPELINE_KEYS = ("activation_bytes_sent", "pipeline_bubble")
#: ... and what the rounds since the last row add up to (a row per ``eval_every`` rounds)
_SINCE_KEYS = ("bytes_sent_since_point", "failed_exchanges_since_point", "skipped_exchanges_since_point",
               "utilisation_since_point", "rounds_since_point")


def _all_sum(values: list[float], world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


def _all_max(value: float, world: int) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _or0(v: float | None) -> float:
    return 0.0 if v is None else float(v)


class GroupRows(Reporter):
    """The rows of a group job (see the module docstring). Collective: every rank records every point.

    Args:
        cfg: the run's configuration (``out``, ``quiet``, ``max_seconds``, ``net_counters``).
        sync: the worker's synchroniser (its :class:`~fgdiloco.pretrain.loop.Layout` and pipeline metrics).
        rank: this worker's rank; rank 0 writes.
        info: what ``run.json`` holds (:func:`fgdiloco.pretrain.results.run_info`).
    """

    def __init__(self, cfg: TrainConfig, sync: Synchroniser, rank: int, info: dict[str, Any]):
        self.cfg, self.sync, self.rank, self.info = cfg, sync, rank, info
        self.layout = sync.layout
        self.rows: list[dict[str, Any]] = []
        self._pending: dict[int, dict[str, Any]] = {}  # deferred points' rows, by id(point)
        self._file: Any = None
        self._net0 = (0.0, 0.0)
        self._bytes_total = 0.0
        self._util_sum = 0.0
        self._util_n = 0
        self._failed = self._skipped = 0

    def start(self) -> None:
        if self.rank == 0:
            out = Path(self.cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            for stale in ("summary.json", "loss.png"):  # an earlier run's: never left beside this run's rows
                with contextlib.suppress(FileNotFoundError):
                    (out / stale).unlink()
            write_json(out / "run.json", self.info)
            self._file = open(out / "metrics.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._net0 = net_bytes() if self.cfg.net_counters else (0.0, 0.0)

    def round_done(self, end: RoundEnd) -> None:
        s = end.stats
        self._bytes_total += float(s["bytes_sent"])
        self._util_sum += s["utilisation"]
        self._util_n += 1
        self._failed += s["failed_exchanges"]
        self._skipped += s["skipped_exchanges"]

    def record(self, point: Point) -> bool:
        cfg, lay = self.cfg, self.layout
        net = net_bytes() if cfg.net_counters else (0.0, 0.0)
        over = cfg.max_seconds is not None and point.train_seconds >= cfg.max_seconds
        loss = float("nan") if point.eval_loss is None else point.eval_loss
        stats = point.stats or {}
        util, cons, train_loss = stats.get("utilisation"), stats.get("consensus_distance"), point.train_loss
        bytes_round = float(stats["bytes_sent"]) if point.stats else None
        local = [loss, _or0(train_loss), _or0(util), _or0(bytes_round), _or0(cons), 0.0 if cons is None else 1.0,
                 net[0] - self._net0[0], net[1] - self._net0[1], 1.0 if over else 0.0, self._bytes_total,
                 self._util_sum / self._util_n if self._util_n else 0.0, float(self._failed), float(self._skipped)]
        metrics = self.sync.metrics()
        if lay.stages > 1:  # only the last stages hold losses; replica 0's comes from its last stage
            local[0] = loss if lay.holds_loss else 0.0
            local[1] = _or0(train_loss) if lay.holds_loss else 0.0
            local += [loss if lay.reports_loss else 0.0, _or0(train_loss) if lay.reports_loss else 0.0,
                      metrics["activation_bytes_sent"], metrics["pipeline_bubble"]]
        s = _all_sum(local, lay.workers)  # after the round: costs no round time (the loop excludes it)
        # the slowest worker's training clock: the others' waits at this collective are excluded from their clocks
        slowest = _all_max(point.train_seconds, lay.workers)
        if lay.stages > 1:
            loss, train_loss = s[13], (s[14] if train_loss is not None else None)
        row = self._row(point, stats, loss, train_loss, bytes_round, s)
        row["train_seconds_slowest"] = slowest
        if cfg.net_counters:  # bytes on this worker's interface since training started (headers included)
            row.update(net_tx_bytes=net[0] - self._net0[0], net_rx_bytes=net[1] - self._net0[1],
                       net_tx_bytes_mean=s[6] / lay.workers, net_rx_bytes_mean=s[7] / lay.workers)
        if point.eval_loss is None:
            self._pending[id(point)] = row
        else:
            self._write(row)
        return s[8] > 0  # any rank past max_seconds: all stop after this round

    def _row(self, point: Point, stats: dict[str, Any], loss: float, train_loss: float | None,
             bytes_round: float | None, s: list[float]) -> dict[str, Any]:
        lay, has = self.layout, bool(point.stats)
        world, replicas = lay.workers, lay.replicas
        row = {
            "step": point.step, "round": point.round, "tokens": point.step * self.info["tokens_per_step"],
            "wall_seconds": point.wall_seconds, "train_seconds": point.train_seconds,
            "eval_loss": loss, "eval_loss_mean": s[0] / replicas,
            "train_loss": train_loss, "train_loss_mean": s[1] / replicas if train_loss is not None else None,
            "utilisation": stats.get("utilisation"),
            "utilisation_mean": s[2] / world if stats.get("utilisation") is not None else None,
            "bytes_sent": bytes_round, "bytes_sent_mean": s[3] / world if bytes_round is not None else None,
            "bytes_sent_per_worker_so_far": s[9] / world,
            "utilisation_so_far": s[10] / world if self._util_n else None,
            "failed_exchanges_so_far": int(s[11]), "skipped_exchanges_so_far": int(s[12]),
        }
        for key in ("mix2_seconds", "mix1_wait_seconds", "mix1_seconds", "round_seconds"):
            row[key] = stats[key] if has else None
        row["consensus_distance"] = stats.get("consensus_distance")
        row["consensus_distance_mean"] = s[4] / s[5] if s[5] else None
        for key in ("failed_exchanges", "skipped_exchanges"):
            row[key] = stats[key] if has else None
        if lay.stages > 1:
            row.update(activation_bytes_sent_per_worker_so_far=s[15] / world,
                       pipeline_bubble_so_far=s[16] / world if point.step > 0 else None)
        return row

    def evaluated(self, point: Point, loss: float) -> None:
        lay = self.layout
        row = self._pending.pop(id(point))
        if lay.stages == 1:
            row["eval_loss"] = loss
            row["eval_loss_mean"] = _all_sum([loss], lay.workers)[0] / lay.workers
        else:
            mean, mine = _all_sum([loss if lay.holds_loss else 0.0, loss if lay.reports_loss else 0.0], lay.workers)
            row["eval_loss"], row["eval_loss_mean"] = mine, mean / lay.replicas
        self._write(row)

    def _write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if not self.cfg.quiet:
            print("[fgdiloco] " + format_round(row, self.cfg.rounds, self.cfg.steps), flush=True)

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        """The run's summary (complete on rank 0, which writes ``summary.json`` and ``loss.png``). Collective: the
        peak memory is the maximum over the ranks."""
        peak = torch.tensor([peak_rss_bytes()], dtype=torch.int64)
        if self.layout.workers > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        # the clocks when training ended: a deferred evaluation after it is in neither
        total, train = outcome.wall_seconds, outcome.train_seconds
        summary = summarise(self.info, self.rows, extra={
            "rank": self.rank,
            "wall_seconds": total,
            "train_seconds": train,
            "eval_seconds": total - train,
            "tokens_per_second": outcome.steps * self.info["tokens_per_step"] / max(train, 1e-9),
            "peak_rss_bytes": int(peak),
        })
        if self.rank == 0:
            out = Path(self.cfg.out)
            write_json(out / "summary.json", summary)
            plot(out, self.rows, self.info["unigram_loss"], self.info["title"])
            summary.update(metrics_path=str(out / "metrics.jsonl"), plot_path=str(out / "loss.png"),
                           summary_path=str(out / "summary.json"))
        return summary

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _stop_round(path: Path, worker: int, mine: int | None) -> int | None:
    """The round the job stops at (``max_seconds``): the one in ``path``, written once, by the first worker past
    the limit (``mine``: the round this worker would stop at when it is past it; the file is made whole and
    linked, so two workers past it at once cannot both write it). None: nobody is past it yet."""
    if mine is not None and not path.exists():
        tmp = path.with_name(f".stop.{worker}.{os.getpid()}")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps({"worker": worker, "round": mine}) + "\n")
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        with contextlib.suppress(OSError):
            tmp.unlink()
    try:
        return int(json.loads(path.read_text())["round"])
    except FileNotFoundError:
        return mine
    except (OSError, ValueError, KeyError, TypeError):
        return mine if mine is not None else -1  # unreadable: stop here, as before the round was written


class WorkerEvents(Reporter):
    """What one elastic worker reports, to its own file (:data:`EVENTS`).

    Args:
        cfg: the run's configuration (``out``, ``max_seconds``, ``net_counters``).
        sync: the worker's :class:`~fgdiloco.pretrain.sync.ElasticFGDiLoCo` (its round and rejoins).
        worker: the worker's slot; life: torchrun's restart count.
        info: what ``run.json`` holds; resumed_round: the round of the checkpoint it loaded (None: none).
    """

    def __init__(self, cfg: TrainConfig, sync: Any, *, worker: int, life: int, info: dict[str, Any],
                 resumed_round: int | None):
        self.cfg, self.sync, self.worker, self.life = cfg, sync, worker, life
        self.info, self.resumed_round = info, resumed_round
        self.stopped = False
        path = rows_path(cfg.out, worker)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._sink = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._net0 = (0.0, 0.0)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event line (flushed: the launcher reads the file as it grows)."""
        line = {"event": event, "worker": self.worker, "life": self.life, "time": time.time(), **fields}
        self._sink.write(json.dumps(line) + "\n")
        self._sink.flush()
        return line

    def start(self) -> None:
        self.emit("start", pid=os.getpid(), info=self.info, resumed_round=self.resumed_round)
        self._net0 = net_bytes() if self.cfg.net_counters else (0.0, 0.0)

    def rejoined(self, from_round: int, to_round: int, step: int) -> None:
        self.emit("rejoin", round=to_round, from_round=from_round, step=step)
        print(f"[fgdiloco] worker {self.worker} (life {self.life}): rejoined the job at round {to_round} (was at "
              f"round {from_round})", flush=True)

    def record(self, point: Point) -> bool:
        cfg = self.cfg
        over = cfg.max_seconds is not None and point.train_seconds >= cfg.max_seconds
        net = net_bytes() if cfg.net_counters else (0.0, 0.0)
        row = {"round": point.round, "step": point.step, "wall_seconds": point.wall_seconds,
               "train_seconds": point.train_seconds, "eval_loss": point.eval_loss, "train_loss": point.train_loss,
               "rejoins": self.sync.rejoins_total, "peak_rss_bytes": peak_rss_bytes(), "over_max_seconds": over}
        for key in _ROUND_KEYS + _SINCE_KEYS:
            row[key] = point.stats[key] if point.stats else None
        for key in _PIPELINE_KEYS:  # a pipeline replica's (this life's total, its stages' mean)
            if point.stats and key in point.stats:
                row[key] = point.stats[key]
        if cfg.net_counters:
            row.update(net_tx_bytes=net[0] - self._net0[0], net_rx_bytes=net[1] - self._net0[1])
        self.emit("row", **row)
        # every worker stops at the evaluation point after the one where the first passed max_seconds: the others
        # may have checked that point already (there is no collective), and one that stopped a round before its
        # partners would leave them that round alone. One already past it stops at once.
        nxt = min(point.round + cfg.eval_every, cfg.rounds)
        at = _stop_round(stop_path(cfg.out), self.worker, nxt if over else None)
        self.stopped = at is not None and point.round >= at
        return self.stopped

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        """The worker's ``end`` event (its clocks after the wrapper closed)."""
        r = self.sync.opt.round
        clock = outcome.clock
        return self.emit("end", round=r, step=min(r * self.cfg.round_steps, self.cfg.steps),
                         wall_seconds=clock.wall(), train_seconds=clock.train(),
                         eval_seconds=clock.excluded_seconds, peak_rss_bytes=peak_rss_bytes(),
                         rejoins=self.sync.rejoins_total, stopped=self.stopped)

    def close(self) -> None:
        self._sink.close()
