"""What a pretraining run leaves in its output folder, and how it is read back.

Files (written by rank 0 of a one-group job; by the launching process for an elastic job, from the workers'
reports in ``workers/``, and for an interrupted run):

* ``run.json``: written once the data is loaded, before the first step: the run id, the configuration, the planned
  rounds and steps, model size, vocabulary, token counts, the unigram baseline and the plot title. With
  ``metrics.jsonl`` it is enough to summarise a run that never finished (:func:`summarise`).
* ``metrics.jsonl``: one JSON object per evaluation (:data:`ROW_FIELDS` describes every field).
* ``summary.json``: :func:`summarise` of the two above (:data:`SUMMARY_FIELDS`); ``"interrupted": true`` when the
  run was stopped before its last step.
* ``loss.png``: :func:`plot`.
* ``logs/``: each worker's stdout and stderr (and torchelastic's ``error.json`` of a failed worker).
* elastic runs: ``config.json`` (the configuration the workers read; ``--resume`` continues it), ``workers/``
  (each worker's reports, :func:`rows_path`, :data:`fgdiloco.pretrain.reports.EVENTS`), ``checkpoints/`` (each
  worker's newest checkpoint, :func:`checkpoint_path`).

Counting is the same everywhere: ``round`` and ``step`` count what is *done*. ``round`` k (1-based) is the k-th
outer round, ``round`` 0 the evaluation before training; the command's progress lines print the same numbers.
(``FGDiLoCo.last_round.round`` is the 0-based index of the round that just ended: ``round`` here is it plus one.)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .config import TrainConfig

__all__ = [
    "OUTPUT_NAMES",
    "ROW_FIELDS",
    "SUMMARY_FIELDS",
    "checkpoint_path",
    "format_round",
    "holds_results",
    "plot",
    "read_rows",
    "rows_path",
    "run_info",
    "stop_path",
    "summarise",
    "title",
    "write_json",
]

#: Files and folders of a run in its output folder; a folder holding any of them holds a run's results.
OUTPUT_NAMES = ("run.json", "metrics.jsonl", "summary.json", "loss.png", "logs", "config.json", "workers",
                "checkpoints")

#: The fields of a ``metrics.jsonl`` row. "this round": the outer round that just ended (None in round 0).
ROW_FIELDS: dict[str, str] = {
    "step": "inner steps done by each worker",
    "round": "outer rounds done (1-based count; 0: before training)",
    "tokens": "tokens trained on so far, all workers together: step x the tokens of one step of every worker (a "
              "worker that was down, or rejoined rounds ahead, trained fewer)",
    "wall_seconds": "seconds since training started (s), evaluation included",
    "train_seconds": "seconds since training started (s), evaluation excluded",
    "train_seconds_slowest": "train_seconds of the slowest worker (s): how long the job took to get here (the "
                             "others waited for it at this row's collective, which their clocks exclude)",
    "eval_loss": "held-out cross-entropy of rank 0's replica (replica 0; with --stages, evaluated through its "
                 "pipeline and read from its last stage) (nats/token)",
    "eval_loss_mean": "held-out cross-entropy, mean over the replicas (nats/token)",
    "train_loss": "replica 0's mean training loss over this round's steps (nats/token)",
    "train_loss_mean": "the same, mean over replicas (nats/token)",
    "utilisation": "rank 0: fraction of this round's wall time spent computing, not blocked in communication",
    "utilisation_mean": "the same, mean over workers",
    "bytes_sent": "bytes rank 0 sent this round (FG-DiLoCo: Mix1 + Mix2 frames; baselines: ring estimate)",
    "bytes_sent_mean": "bytes sent this round, mean over workers",
    "bytes_sent_per_worker_so_far": "bytes sent since the start, mean over workers",
    "utilisation_so_far": "utilisation since the start, mean over workers and rounds",
    "failed_exchanges_so_far": "failed gossip exchanges since the start, all workers together",
    "skipped_exchanges_so_far": "gossip exchanges not made since the start (the peer had left, was absent or in a "
                                "later round, or was in back-off; no timeout spent), all workers together",
    "mix2_seconds": "rank 0: seconds blocked in Mix2 this round (baselines: in the all-reduce / averaging)",
    "mix1_wait_seconds": "rank 0: seconds waited for Mix1 to finish this round",
    "mix1_seconds": "rank 0: seconds Mix1 took in the background this round",
    "round_seconds": "rank 0: wall seconds of this round (evaluation excluded)",
    "consensus_distance": "rank 0: disagreement with its Mix1 peer's round-start parameters, RMS per element of "
                          "theta_0 - theta_peer in fp32 as transmitted (size-independent; 0: identical replicas; "
                          "the peer changes every round; FGDiLoCo's RoundStats.consensus_distance)",
    "consensus_distance_mean": "the same, mean over workers that had a Mix1 peer",
    "failed_exchanges": "rank 0's failed gossip exchanges this round",
    "skipped_exchanges": "rank 0's gossip exchanges not made this round (see skipped_exchanges_so_far)",
    "activation_bytes_sent_per_worker_so_far": "--stages > 1 only: pipeline bytes each worker sent to its "
                                               "neighbouring stages since the start (forward activations + "
                                               "backward gradients, evaluation excluded), mean over workers",
    "workers_reporting": "elastic runs only: workers that reported this evaluation point (the means are over them; "
                         "a worker that was down, or rejoined at a later round, has no report); with --stages > 1 "
                         "pipeline replicas, each reporting its stages' means",
    "eval_worker": "elastic runs only: the slot whose values the unsuffixed fields are (the lowest reporting one; "
                   "'rank 0' above)",
    "rejoins_so_far": "elastic runs only: times a worker joined the job's live round (after a restart, or having "
                      "fallen behind) up to this round, all workers together",
    "restarts_so_far": "elastic runs only: torchrun restarts of the workers so far, all together",
    "pipeline_bubble_so_far": "--stages > 1 only: fraction of a training step a stage waited for its neighbours "
                              "(transfers included), mean over steps and workers (the first step after each "
                              "evaluation holds the schedule's shape exchange); None in round 0",
}

#: The fields of ``summary.json`` whose meaning is not obvious from the name (also written into the file).
SUMMARY_FIELDS: dict[str, str] = {
    "interrupted": "true: stopped (Ctrl-C) before the last step; everything below covers the rounds done",
    "rounds": "outer rounds done (rounds_planned: in the configuration)",
    "steps": "inner steps done by each worker (steps_planned: in the configuration)",
    "tokens": "tokens trained on, all workers together: steps x the tokens of one step of every worker (a worker "
              "that was down, or rejoined rounds ahead, trained fewer)",
    "final_eval_loss": "held-out loss of rank 0's replica at the last evaluation (nats/token)",
    "final_eval_loss_mean": "held-out loss at the last evaluation, mean over the workers' replicas (nats/token)",
    "unigram_loss": "held-out loss of a unigram model fit on the training split: the baseline to beat",
    "wall_seconds": "seconds from the first step to the last evaluation",
    "train_seconds": "wall_seconds without evaluation",
    "setup_seconds": "seconds a worker spent before its first step (data, model, process group)",
    "tokens_per_second": "tokens / train_seconds, all workers together",
    "replicas": "model replicas R = workers / stages: each one pipeline of `stages` workers; gossip mixes the R "
                "copies of each stage",
    "stages": "pipeline stages per replica S (1: each worker holds the whole model)",
    "activation_bytes_sent": "bytes each worker sent to its neighbouring pipeline stages over the run (forward "
                             "activations + backward gradients of the training steps), mean over workers; 0 with "
                             "one stage",
    "pipeline_bubble": "fraction of a training step a stage waits for its neighbours (transfers included), mean "
                       "over steps and workers; None with one stage",
    "utilisation": "fraction of round wall time spent computing, not blocked in communication; mean over "
                   "workers and rounds (DDP: blocked = backward's wait for the last gradient bucket)",
    "bytes_sent_per_worker": "bytes each worker sent over the run, mean over workers (FG-DiLoCo: Mix1 + Mix2 "
                             "frames; baselines: the ring all-reduce estimate 2(M-1)/M x the bytes reduced)",
    "bytes_sent_all_workers": "bytes sent over the run, all workers together",
    "failed_exchanges": "failed gossip exchanges over the run, all workers together",
    "skipped_exchanges": "gossip exchanges not made over the run (the peer had left, was absent or in a later "
                         "round, or was in back-off; no timeout spent), all workers together",
    "peak_rss_bytes": "largest peak resident memory of a worker process (bytes)",
    "restarts": "torchrun restarts of the workers, all together (elastic runs; 0 otherwise)",
    "rejoins": "times a worker joined the job's live round after a restart or having fallen behind (elastic runs)",
    "rejoin_events": "elastic runs: each rejoin: worker, life (its restart count), round joined, from_round (where "
                     "it was: its checkpoint's round or 0), step, time (unix s); loss.png marks them",
    "workers_lost": "elastic runs: workers whose torchrun job failed for good (restarts used up), with the cause",
}


def rows_path(out: str | os.PathLike[str], worker: int) -> Path:
    """``<out>/workers/worker<k>.jsonl``: what elastic worker ``k`` reports (every life appends)."""
    return Path(out) / "workers" / f"worker{worker}.jsonl"


def checkpoint_path(out: str | os.PathLike[str], worker: int, stage: int | None = None) -> Path:
    """``<out>/checkpoints/worker<k>.pt``: elastic worker ``k``'s newest complete checkpoint
    (``worker<k>.stage<s>.pt``: stage ``s`` of pipeline replica ``k``)."""
    return Path(out) / "checkpoints" / (f"worker{worker}.pt" if stage is None else f"worker{worker}.stage{stage}.pt")


def stop_path(out: str | os.PathLike[str]) -> Path:
    """``<out>/workers/stop``: written by the first elastic worker past ``max_seconds`` (``{"worker", "round"}``:
    its next evaluation point); every worker stops at that point, or at once when already past it (the workers
    share no collective to agree on it, and may have checked the first one's point before it was written)."""
    return Path(out) / "workers" / "stop"


def title(cfg: TrainConfig, *, method: str, label: str, workers: int, params: int, elastic: bool = False) -> str:
    """The title of ``loss.png``: the method, the run's shape and size."""
    shape = (f": {workers // cfg.stages} replicas x {cfg.stages} stages" if cfg.stages > 1
             else f": {workers} workers")
    sync = ("" if method == "ddp" else f", H={cfg.sync_every}" if method == "localsgd" else
            f", H={cfg.sync_every}, {cfg.topology}, codec {cfg.codec}")
    return (label + (" (elastic)" if elastic else "") + shape + f", {cfg.steps} steps" + sync
            + f", {params / 1e6:.2f}M params")


def run_info(cfg: TrainConfig, *, method: str, workers: int, replicas: int, tokens_per_step: int, params: int,
             vocab_size: int, train: torch.Tensor, val: torch.Tensor, unigram: float, cache_dir: Any,
             setup_seconds: float, title: str, **extra: Any) -> dict[str, Any]:
    """What ``run.json`` says about a run (and ``summary.json`` repeats): method, shape, plan, data, set-up time
    (seconds), the title of ``loss.png``, torch's version and the whole configuration; ``extra`` is added."""
    import torch

    return {
        "run_id": cfg.run_id or uuid.uuid4().hex[:12],
        "method": method,
        **extra,
        "workers": workers,
        "replicas": replicas,
        "stages": cfg.stages,
        "rounds_planned": cfg.rounds,
        "steps_planned": cfg.steps,
        "tokens_per_step": tokens_per_step,
        "params": params,
        "vocab_size": vocab_size,
        "train_tokens": int(train.numel()),
        "val_tokens": int(val.numel()),
        "unigram_loss": unigram,
        "data": cfg.data if cfg.data is not None else "bundled corpus (fgdiloco/pretrain/corpus)",
        "cache_dir": cache_dir,
        "setup_seconds": setup_seconds,
        "title": title,
        "torch": torch.__version__,
        "config": cfg.as_dict(),
    }


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON atomically (temporary file, then ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def holds_results(folder: Path, names: tuple[str, ...] = OUTPUT_NAMES) -> list[str]:
    """The ``names`` (default :data:`OUTPUT_NAMES`) present in ``folder`` (empty: no run's results there)."""
    return [n for n in names if (folder / n).exists()] if folder.is_dir() else []


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``; a last line cut short (the writer was killed mid-line) is skipped."""
    rows = []
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def summarise(info: dict[str, Any], rows: list[dict[str, Any]], *, interrupted: bool = False,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run summary (``summary.json``) from ``run.json``'s ``info`` and the ``metrics.jsonl`` rows.

    Totals are the last row's "so far" fields, so a run stopped after any evaluation is summarised exactly up to
    that evaluation. ``extra`` (the worker's own timings, peak memory) overrides the row-derived values.
    """
    last = rows[-1] if rows else {}
    tokens = int(last.get("tokens", 0))
    train_s = float(last.get("train_seconds", 0.0))
    bytes_w = float(last.get("bytes_sent_per_worker_so_far") or 0.0)
    workers = int(info["workers"])
    stages = int(info.get("stages", 1))
    summary: dict[str, Any] = {
        "run_id": info.get("run_id"),
        "method": info["method"],
        "interrupted": interrupted,
        "workers": workers,
        "replicas": int(info.get("replicas", workers // stages)),
        "stages": stages,
        "rounds": int(last.get("round", 0)),
        "rounds_planned": info["rounds_planned"],
        "steps": int(last.get("step", 0)),
        "steps_planned": info["steps_planned"],
        "tokens": tokens,
        "initial_eval_loss": rows[0]["eval_loss"] if rows else None,
        "final_eval_loss": last.get("eval_loss"),
        "final_eval_loss_mean": last.get("eval_loss_mean"),
        "best_eval_loss": min((r["eval_loss"] for r in rows), default=None),
        "unigram_loss": info["unigram_loss"],
        "wall_seconds": float(last.get("wall_seconds", 0.0)),
        "train_seconds": train_s,
        "eval_seconds": float(last.get("wall_seconds", 0.0)) - train_s,
        "setup_seconds": info.get("setup_seconds"),
        "tokens_per_second": tokens / train_s if train_s > 0 else None,
        "utilisation": last.get("utilisation_so_far"),
        "bytes_sent_per_worker": bytes_w,
        "bytes_sent_all_workers": bytes_w * workers,
        "failed_exchanges": int(last.get("failed_exchanges_so_far") or 0),
        "skipped_exchanges": int(last.get("skipped_exchanges_so_far") or 0),
        "activation_bytes_sent": float(last.get("activation_bytes_sent_per_worker_so_far") or 0.0),
        "pipeline_bubble": last.get("pipeline_bubble_so_far"),
        "restarts": int(last.get("restarts_so_far") or 0),
        "rejoins": int(last.get("rejoins_so_far") or 0),
        "rejoin_events": [],
        "workers_lost": [],
        "stopped_early": int(last.get("step", 0)) < info["steps_planned"],
        "params": info["params"],
        "vocab_size": info["vocab_size"],
        "train_tokens": info["train_tokens"],
        "val_tokens": info["val_tokens"],
        "data": info["data"],
        "cache_dir": info.get("cache_dir"),
        "torch": info.get("torch"),
        "config": info["config"],
    }
    summary.update(extra or {})
    summary["fields"] = SUMMARY_FIELDS
    return summary


def plot(out: Path, rows: list[dict[str, Any]], unigram: float, title: str,
         rejoins: list[dict[str, Any]] | None = None) -> Path:
    """``loss.png`` in ``out``: held-out loss against tokens and against training seconds; returns its path.

    ``rejoins`` (an elastic run's ``rejoin_events``) are marked by a dotted vertical line each, at the step of
    the round the worker joined (and at that round's training seconds)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    tokens = [r["tokens"] / 1e6 for r in rows]
    secs = [r["train_seconds"] for r in rows]
    for ax, xs, label in ((axes[0], tokens, "tokens seen by all workers (millions)"),
                          (axes[1], secs, "wall seconds (training; evaluation excluded)")):
        ax.plot(xs, [r["eval_loss"] for r in rows], "o-", ms=3, label="held-out loss, rank 0")
        ax.plot(xs, [r["eval_loss_mean"] for r in rows], "-", lw=1, alpha=0.7, label="mean over workers")
        ax.axhline(unigram, ls="--", color="grey", label=f"unigram baseline {unigram:.2f}")
        for i, (tok_x, sec_x, worker) in enumerate(rejoin_marks(rows, rejoins or [])):
            ax.axvline(tok_x if ax is axes[0] else sec_x, ls=":", color="tab:red", lw=1.2,
                       label="a worker rejoined" if i == 0 else None)
            ax.annotate(f"w{worker}", (tok_x if ax is axes[0] else sec_x, 1.0), xycoords=("data", "axes fraction"),
                        fontsize=7, color="tab:red", ha="left", va="top")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats / token)")
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = out / ".loss.png.tmp"
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    target = out / "loss.png"
    os.replace(tmp, target)
    return target


def rejoin_marks(rows: list[dict[str, Any]], rejoins: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """Where :func:`plot` marks each rejoin: ``(millions of tokens, training seconds, worker)``: the step of the
    round joined, and the training seconds of the first row at or after that round (interpolated from the rows
    around it)."""
    if not rows:
        return []
    per_step = rows[-1]["tokens"] / rows[-1]["step"] if rows[-1]["step"] else 0.0
    marks = []
    for ev in rejoins:
        later = [r for r in rows if r["round"] >= ev["round"]]
        sec = later[0]["train_seconds"] if later else rows[-1]["train_seconds"]
        marks.append((ev["step"] * per_step / 1e6, sec, int(ev["worker"])))
    return marks


# ---------------------------------------------------------------------------------------------------- progress
def fmt_bytes(n: float | None) -> str:
    """``n`` bytes with a decimal unit (B, kB, MB, GB)."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover - the loop returns


def fmt_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(int(round(seconds)), 0)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def format_round(row: dict[str, Any], rounds: int, steps: int) -> str:
    """One progress line for a ``metrics.jsonl`` row: the round, held-out and training loss (nats/token),
    throughput, utilisation, bytes sent, distance to the Mix1 peer, and the time left at the pace so far."""
    rnd = row["round"]
    parts = [f"round {rnd:>{len(str(rounds))}}/{rounds}", f"step {row['step']:>{len(str(steps))}}/{steps}",
             f"eval {row['eval_loss']:.3f}"]
    if row.get("train_loss_mean") is not None:
        parts.append(f"train {row['train_loss_mean']:.3f}")
    if rnd > 0 and row.get("train_seconds"):
        parts.append(f"{row['tokens'] / row['train_seconds']:,.0f} tok/s")
    if row.get("utilisation_mean") is not None:
        parts.append(f"util {100 * row['utilisation_mean']:.0f}%")
    if row.get("bytes_sent_mean") is not None:
        parts.append(f"sent {fmt_bytes(row['bytes_sent_mean'])}/worker")
    if row.get("consensus_distance_mean") is not None:
        parts.append(f"peer dist {row['consensus_distance_mean']:.3g}")
    if row.get("failed_exchanges"):
        parts.append(f"failed {row['failed_exchanges']}")
    if row.get("skipped_exchanges"):
        parts.append(f"skipped {row['skipped_exchanges']}")
    if rnd > 0:
        left = row["wall_seconds"] / rnd * (rounds - rnd)
        parts.append(f"{fmt_duration(row['wall_seconds'])} elapsed, ETA {fmt_duration(left)}")
    return "  ".join(parts)


def describe_row_fields(names: Iterable[str] | None = None) -> str:
    """``name: meaning`` lines for :data:`ROW_FIELDS` (or the given subset)."""
    return "\n".join(f"{k}: {ROW_FIELDS[k]}" for k in (names or ROW_FIELDS))
