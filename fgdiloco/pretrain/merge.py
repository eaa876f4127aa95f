"""Merging per-worker reports into ``metrics.jsonl`` rows: an elastic job's (in the launching process, as they
grow), and a benchmark's per-rank rows (:func:`write_merged`, after a ``benchmarks/peers.py`` run).

Each elastic worker writes its own ``<out>/workers/worker<k>.jsonl``
(:data:`fgdiloco.pretrain.reports.EVENTS`); no worker waits for another to report. :class:`Merger` reads
the files as they grow and makes the row of evaluation point R once every worker has reported R or a later point
(or joined a later round: it will never report R), or has ended for good. The row has today's format
(:data:`~fgdiloco.pretrain.results.ROW_FIELDS`): "rank 0" fields are the lowest reporting slot's, means are over
the workers that reported R, totals "so far" are over every report of every life up to R.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["Merger", "merge_rank_rows", "read_rank_rows", "write_merged"]

#: Worker row fields the merged row takes from the lowest reporting slot and averages over the reporters.
_PER_WORKER = ("eval_loss", "train_loss", "utilisation", "bytes_sent", "consensus_distance")
_LOWEST_ONLY = ("mix2_seconds", "mix1_wait_seconds", "mix1_seconds", "round_seconds", "failed_exchanges",
                "skipped_exchanges")


class Merger:
    """Follows ``workers`` report files in ``folder`` (``worker<k>.jsonl``) and merges them.

    Args:
        folder: ``<out>/workers``.
        workers: the job's worker slots.
        points: the evaluation points (rounds done) in order, ``0`` first.
        sync_every: H (a row's step is ``min(R * H, steps)``).
        steps: planned steps per worker.
    """

    def __init__(self, folder: Path, workers: int, points: list[int], *, sync_every: int, steps: int):
        self.folder = Path(folder)
        self.workers = workers
        self.points = list(points)
        self.sync_every, self.steps = sync_every, steps
        self._offset = [0] * workers
        self._buf = [""] * workers
        self.rows: list[dict[int, dict[str, Any]]] = [{} for _ in range(workers)]  # first report per round
        self.reports: list[dict[str, Any]] = []  # every report of every life (totals so far)
        self.position = [-1] * workers  # every point <= position[k]: worker k reported it or never will
        self.lives = [0] * workers  # torchrun restarts seen per slot
        self.ended: set[int] = set()
        self.ends: dict[int, dict[str, Any]] = {}
        self.rejoin_events: list[dict[str, Any]] = []
        self.starts: list[dict[str, Any]] = []
        self.info: dict[str, Any] | None = None
        self.merged: list[dict[str, Any]] = []
        self._next = 0

    # ------------------------------------------------------------------ reading
    def read(self) -> None:
        """Take in every complete line appended to the workers' files since the last call."""
        for k in range(self.workers):
            path = self.folder / f"worker{k}.jsonl"
            try:
                with open(path, encoding="utf-8") as f:
                    f.seek(self._offset[k])
                    chunk = f.read()
                    self._offset[k] = f.tell()
            except FileNotFoundError:
                continue
            self._buf[k] += chunk
            *lines, self._buf[k] = self._buf[k].split("\n")
            for line in lines:
                try:
                    ev = json.loads(line)
                except ValueError:  # a line cut short by a kill: skipped
                    continue
                self._take(k, ev)

    def _take(self, k: int, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        self.lives[k] = max(self.lives[k], int(ev.get("life", 0)))
        if kind == "start":
            self.starts.append(ev)
            if self.info is None or (k == 0 and self.info.get("_worker", 0) != 0):
                self.info = dict(ev["info"], _worker=k)
        elif kind == "row":
            self.reports.append(ev)
            self.rows[k].setdefault(int(ev["round"]), ev)
            self.position[k] = max(self.position[k], int(ev["round"]))
        elif kind == "rejoin":
            self.rejoin_events.append({key: ev[key] for key in ("worker", "life", "round", "from_round", "step",
                                                                "time")})
            self.position[k] = max(self.position[k], int(ev["round"]))
        elif kind == "end":
            self.ended.add(k)
            self.ends[k] = ev

    # ------------------------------------------------------------------ merging
    def ready(self, gone: set[int] | frozenset[int] = frozenset()) -> list[dict[str, Any]]:
        """The merged rows that became complete; ``gone``: slots whose torchrun job has ended (for good)."""
        done = self.ended | set(gone)
        new = []
        while self._next < len(self.points):
            r = self.points[self._next]
            if any(self.position[k] < r and k not in done for k in range(self.workers)):
                break
            self._next += 1
            reporters = [k for k in range(self.workers) if r in self.rows[k]]
            if reporters:
                new.append(self._merge(r, reporters))
        self.merged += new
        return new

    def _merge(self, r: int, reporters: list[int]) -> dict[str, Any]:
        rs = [self.rows[k][r] for k in reporters]
        first = rs[0]

        def mean(key: str) -> float | None:
            vals = [x[key] for x in rs if x.get(key) is not None]
            return sum(vals) / len(vals) if vals else None

        upto = [x for x in self.reports if x["round"] <= r]

        def since(x: dict[str, Any], key: str) -> float:
            """What a row adds to a total: the rounds since the worker's last row (a row of before they were
            reported: its own round)."""
            v = x.get(f"{key}_since_point")
            return float((x.get(key) if v is None else v) or 0.0)

        timed = [(since(x, "utilisation"), x.get("rounds_since_point") or 1) for x in upto
                 if x["round"] > 0 and x.get("utilisation") is not None]  # (mean, rounds it is the mean of)
        rounds = sum(n for _, n in timed)
        util = sum(u * n for u, n in timed)
        clock = max(rs, key=lambda x: x["wall_seconds"])  # the longest-lived clock: a restarted worker's lost time
        step = min(r * self.sync_every, self.steps)
        tokens_per_step = int(self.info["tokens_per_step"]) if self.info else 0
        row: dict[str, Any] = {
            "step": step,
            "round": r,
            "tokens": step * tokens_per_step,
            "wall_seconds": clock["wall_seconds"],
            "train_seconds": clock["train_seconds"],
        }
        for key in _PER_WORKER:
            row[key] = first.get(key)
            row[f"{key}_mean"] = mean(key)
        row.update(
            bytes_sent_per_worker_so_far=sum(since(x, "bytes_sent") for x in upto) / self.workers,
            utilisation_so_far=util / rounds if rounds else None,
            failed_exchanges_so_far=int(sum(since(x, "failed_exchanges") for x in upto)),
            skipped_exchanges_so_far=int(sum(since(x, "skipped_exchanges") for x in upto)),
        )
        for key in _LOWEST_ONLY:
            row[key] = first.get(key)
        if any("activation_bytes_sent" in x for x in rs):  # pipeline replicas: their stages' means
            row.update(activation_bytes_sent_per_worker_so_far=mean("activation_bytes_sent"),
                       pipeline_bubble_so_far=mean("pipeline_bubble"))
        row.update(
            workers_reporting=len(reporters),
            eval_worker=reporters[0],
            rejoins_so_far=sum(1 for e in self.rejoin_events if e["round"] <= r),
            restarts_so_far=sum(self.lives),
        )
        if "net_tx_bytes" in first:
            row.update(net_tx_bytes=first["net_tx_bytes"], net_rx_bytes=first["net_rx_bytes"],
                       net_tx_bytes_mean=mean("net_tx_bytes"), net_rx_bytes_mean=mean("net_rx_bytes"))
        return row

    # ------------------------------------------------------------------ totals
    @property
    def restarts(self) -> int:
        """torchrun restarts of all workers together (each slot's highest ``TORCHELASTIC_RESTART_COUNT``)."""
        return sum(self.lives)

    @property
    def peak_rss_bytes(self) -> int:
        """The largest peak resident memory any worker process reported (bytes)."""
        vals = [int(x.get("peak_rss_bytes") or 0) for x in self.reports + list(self.ends.values())]
        return max(vals, default=0)


# ---------------------------------------------------------------------------------------------------- per-rank rows
def read_rank_rows(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """``{rank: rows}`` from the ``rank<i>.jsonl`` files of a peer run."""
    out = {}
    for p in sorted(run_dir.glob("rank*.jsonl")):
        rank = int(p.stem[4:])
        out[rank] = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


def merge_rank_rows(per_rank: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows ``wan.py`` reads (``metrics.jsonl``) from the ranks' own rows: rank 0's row per evaluation point,
    with ``eval_loss`` rank 0's, ``train_seconds_slowest`` the largest ``train_seconds`` of the ranks at that step, and
    ``eval_loss_mean``, ``utilisation_mean``, ``net_tx_bytes_mean`` and
    ``net_rx_bytes_mean`` the means over the ranks that reached that step (a dead rank drops out of later means).

    Raises:
        ValueError: no rank 0 rows.
    """
    if not per_rank.get(0):
        raise ValueError("rank 0 wrote no rows")
    by_step = {r: {row["step"]: row for row in rows} for r, rows in per_rank.items()}

    def mean(key: str, step: int) -> float | None:
        v = [by_step[r][step][key] for r in by_step if step in by_step[r] and by_step[r][step].get(key) is not None]
        return sum(v) / len(v) if v else None

    merged = []
    for row in per_rank[0]:
        s = row["step"]
        m = dict(row)
        m.update(train_seconds_slowest=max(by_step[r][s]["train_seconds"] for r in by_step if s in by_step[r]),
                 eval_loss_mean=mean("eval_loss", s), utilisation_mean=mean("utilisation", s),
                 net_tx_bytes_mean=mean("net_tx_bytes", s), net_rx_bytes_mean=mean("net_rx_bytes", s),
                 ranks=sum(1 for r in by_step if s in by_step[r]))
        merged.append(m)
    return merged


def write_merged(run_dir: Path) -> list[dict[str, Any]]:
    """Write ``metrics.jsonl`` and ``summary.json`` of a peer run from its per-rank files; returns the rows."""
    rows = merge_rank_rows(read_rank_rows(run_dir))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done0 = json.loads((run_dir / "rank0.done.json").read_text()) if (run_dir / "rank0.done.json").is_file() else {}
    util = [r["utilisation_mean"] for r in rows[1:] if r.get("utilisation_mean") is not None]
    summary = {"method": "peer", "steps": done0.get("steps"), "stopped_early": done0.get("stopped_early"),
               "utilisation": sum(util) / len(util) if util else None, "bytes_sent": None,
               "failed_exchanges": sum(r.get("failed_exchanges") or 0 for r in rows),
               "config": done0.get("config"), "peer": done0.get("peer"), "torchft": done0.get("torchft"),
               "commits": done0.get("commits"), "cpu_per_train_second": _cpu_fraction(run_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return rows


def _cpu_fraction(run_dir: Path) -> float | None:
    """Mean over ranks of CPU seconds / training wall seconds (1.0 = one core busy all the time)."""
    v = []
    for p in run_dir.glob("rank*.done.json"):
        d = json.loads(p.read_text())
        if d.get("train_cpu_seconds") is not None and d.get("train_seconds"):
            v.append(d["train_cpu_seconds"] / d["train_seconds"])
    return sum(v) / len(v) if v else None
