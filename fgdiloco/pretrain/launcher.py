"""Starting a pretraining job on local worker processes, and everything around it that a person relies on.

* :func:`preflight`: what can be checked in the launching process before any worker starts, each failure a
  :class:`PreflightError` naming the command-line option: the output folder is writable, the data is UTF-8 text
  with enough tokens for one window of each split (the tokenizer is trained and cached here, so the workers only
  load it), and the workers fit in free memory (:func:`estimate_worker_bytes`); more workers than cores is a
  warning.
* :func:`choose_output`: a folder never receives a run while it holds another run's results: the default folder
  becomes a fresh numbered one (``runs/pretrain-2``, ...), an explicit one needs ``overwrite``.
* :func:`launch`: an elastic configuration (FG-DiLoCo, one stage, a gossip topology) runs on elastic workers
  (:func:`launch_elastic`: each worker its own ``torchrun`` job with restarts, on a gossip store this process
  serves; a dead worker is restarted from its checkpoint and rejoins; this process merges the workers' reports into
  ``metrics.jsonl``, ``summary.json`` and ``loss.png``); baselines and pipeline stages run as one torchelastic job
  (:func:`launch_group`: one death ends the job). The workers' output is in ``<out>/logs/``; a job that failed
  becomes one :class:`WorkerFailed` with the root cause (a SIGKILL: "killed by the system, probably out of
  memory") and the log file holding its traceback. ``on_row`` sees every ``metrics.jsonl`` row as it is written
  (the command's progress display).
* :func:`finish_interrupted`: after Ctrl-C, ``summary.json`` (``"interrupted": true``) and ``loss.png`` for the
  rounds done, from ``run.json`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..factor.lowrank import LowRank
from ..outer.wrapper import FGDiLoCo
from .config import TrainConfig
from .data import build_tokenizer, cache_dir_for, encode_corpus, load_text, split_tokens, tokenizer_is_cached
from .recipe import build_model
from .results import (
    OUTPUT_NAMES,
    checkpoint_path,
    holds_results,
    plot,
    read_rows,
    rows_path,
    stop_path,
    summarise,
    write_json,
)
from .worker import train_worker

__all__ = [
    "PreflightError",
    "WorkerFailed",
    "available_memory_bytes",
    "choose_output",
    "clear_outputs",
    "estimate_worker_bytes",
    "finish_interrupted",
    "launch",
    "preflight",
    "usable_cores",
]

#: Resident memory of a worker before its model: Python, torch, numpy, tokenizers, Gloo groups (the job's and the
#: pair groups it keeps for reuse).
WORKER_BASE_BYTES = 450 * 2**20
#: fp32 copies of the parameters a worker holds: weights, gradients, AdamW's two moments, FG-DiLoCo's
#: round-start snapshot, outer momentum, Mix1 / Mix2 buffers and the codec's error feedback, rounded up.
PARAM_COPIES = 12
#: Factor on the counted model, activation and token bytes for what the count misses (temporaries of the
#: backward pass, allocator slack). With it the estimate is 1-13 % above the peak ``ru_maxrss`` measured here
#: (torch 2.13 CPU, with the pipeline, mesh and heartbeat code loaded): 415 MiB for a 1-layer, 32-wide model
#: (estimate about 418 MiB); 719 MiB for the default 4-layer, 128-wide model with batch 16 x 128 (estimate
#: about 810 MiB). At a685d51 the default run peaked at 847 MiB (summary.json's peak_rss_bytes; the causes of the
#: growth were not separated, kept pair groups being one), so the base went from 410 to 450 MiB: about 884 MiB.
MODEL_SLACK = 2.0


class PreflightError(ValueError):
    """A problem found before any worker starts. ``option`` is the command-line option to change."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"{option} {message}")


class WorkerFailed(RuntimeError):
    """A worker process failed. ``reason``: the root cause in one line; ``rank``; ``log``: its stderr file."""

    def __init__(self, rank: int, reason: str, log: Path | None, traceback: bool = True):
        self.rank, self.reason, self.log = rank, reason, log
        where = "" if log is None else f" (traceback in {log})" if traceback else f" (its log: {log})"
        super().__init__(f"worker {rank}: {reason}{where}")


# ---------------------------------------------------------------------------------------------------- output folder
def choose_output(out: str | os.PathLike[str], *, explicit: bool, overwrite: bool,
                  names: tuple[str, ...] = OUTPUT_NAMES) -> tuple[Path, str | None]:
    """The folder this run writes to, and a sentence for the user when it is not ``out`` as given.

    ``out`` holding another run's results (any of ``names``, by default
    :data:`~fgdiloco.pretrain.results.OUTPUT_NAMES`): with ``overwrite`` it is used as it is (call
    :func:`clear_outputs` once the checks passed, so a refused run removes nothing); else the default folder
    (``explicit=False``) becomes the first free ``out-2``, ``out-3``, ...; an explicit one raises.

    Raises:
        PreflightError: an explicit ``out`` holds results and ``overwrite`` is False, or ``out`` is a file.
    """
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise PreflightError("--out", f"{str(path)!r} is a file; give a folder (it is created if missing)")
    found = holds_results(path, names)
    if not found:
        return path, None
    if overwrite:
        return path, f"--overwrite: replacing the earlier run's {', '.join(found)} in {path}"
    if explicit:
        raise PreflightError("--out", f"{str(path)!r} holds another run's results ({', '.join(found)}); pass "
                                      "--overwrite to replace them, or choose another folder")
    k = 2
    while holds_results(path.with_name(f"{path.name}-{k}"), names) or path.with_name(f"{path.name}-{k}").is_file():
        k += 1
    fresh = path.with_name(f"{path.name}-{k}")
    return fresh, f"{path} holds an earlier run: writing this one to {fresh} (--out DIR picks the folder)"


def clear_outputs(folder: str | os.PathLike[str], names: tuple[str, ...] = OUTPUT_NAMES) -> list[str]:
    """Remove an earlier run's ``names`` from ``folder`` (``--overwrite``); returns what was removed."""
    path = Path(folder)
    found = holds_results(path, names)
    for name in found:
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    return found


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".fgdiloco-write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PreflightError("--out", f"{str(path)!r} is not writable ({e.strerror or e})") from None


# ---------------------------------------------------------------------------------------------------- resources
def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def available_memory_bytes() -> int | None:
    """Memory that can be allocated without swapping: ``MemAvailable`` of ``/proc/meminfo``, lowered to the
    cgroup's remaining limit (``memory.max - memory.current``) when one is set; None where neither is readable."""
    avail = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = left if avail is None else min(avail, left)
    return avail


def estimate_worker_bytes(cfg: TrainConfig, vocab_size: int, n_tokens: int) -> int:
    """Resident memory one worker needs at its peak (bytes), an estimate from the configuration.

    ``WORKER_BASE_BYTES`` + ``MODEL_SLACK`` x (``PARAM_COPIES`` fp32 copies of the parameters + the activations
    of one step, forward and backward + the token ids: int32 broadcast buffer and int64 copy).
    """
    d, n_layer, b, t = cfg.n_embd, cfg.n_layer, cfg.batch_size, cfg.block_size
    params = vocab_size * d + t * d + n_layer * 12 * d * d
    per_layer = b * t * (16 * d + 2 * cfg.n_head * t)  # residual, attention, MLP (4x) and their gradients
    logits = 3 * b * t * vocab_size  # logits, softmax, their gradient
    activations = 4 * (n_layer * per_layer + logits)
    return int(WORKER_BASE_BYTES + MODEL_SLACK * (4 * PARAM_COPIES * params + activations + 12 * n_tokens))


# ---------------------------------------------------------------------------------------------------- preflight
def _rank_note(cfg: TrainConfig, vocab_size: int) -> str | None:
    """The low-rank codec's word on a ``--codec-rank`` at which no matrix of the job's model is factored (each
    worker's wrapper warns too, but into its log): the model's shapes from a copy on the meta device (no memory)."""
    if cfg.codec_rank is None:
        return None
    codec = FGDiLoCo.resolve_codecs(cfg.fgdiloco_config())[0]
    if not isinstance(codec, LowRank):
        return None
    with torch.device("meta"):
        model = build_model(cfg, vocab_size)
    return codec.factors_none_of([p for p in model.parameters() if p.requires_grad])


def _setting_notes(cfg: TrainConfig, vocab_size: int) -> list[str]:
    """What the workers' wrappers would warn about into their logs, said once before they start: an Adam-type
    outer optimizer with SGD's ``--outer-lr``, a ``--codec-rank`` that factors no matrix."""
    notes = [("--outer-lr", cfg.fgdiloco_config().outer_lr_note()), ("--codec-rank", _rank_note(cfg, vocab_size))]
    return [f"{flag}: {note}" for flag, note in notes if note]


def preflight(cfg: TrainConfig, status: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Check everything a run needs before a worker starts; returns what was found.

    Trains (or loads from its cache) the tokenizer and encodes the text, so the workers find both in the cache.
    ``status(text)`` is told what is going on (the command shows it as a spinner); it returns a context manager
    or None.

    Returns:
        ``{"chars", "tokens", "train_tokens", "val_tokens", "vocab_size", "cache_dir", "worker_bytes",
        "available_bytes", "cores", "warnings"}``.

    Raises:
        PreflightError: naming the option: ``--out`` not writable, ``--data`` unreadable or too short for
            ``--block-size``, ``--workers`` more than free memory holds.
    """
    try:
        cfg.validate()
    except FileNotFoundError as e:
        raise PreflightError("--data", str(e).removeprefix("--data ")) from None
    _check_writable(Path(cfg.out))

    def stage(text: str) -> Any:
        cm = status(text) if status is not None else None
        return cm if cm is not None else contextlib.nullcontext()

    label = repr(cfg.data) if cfg.data is not None else "the bundled corpus"
    try:
        text = load_text(cfg.data)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise PreflightError("--data", f"{label}: {e}") from None
    # memory first (seconds, not the tokenizer's minute): a token is at least one byte, so the text's UTF-8 length
    # bounds the token count and the vocabulary asked for bounds the real one
    bound = len(text.encode("utf-8"))
    per_worker = estimate_worker_bytes(cfg, cfg.vocab_size if cfg.tokenizer == "bpe" else 256, bound)
    avail = available_memory_bytes()
    if avail is not None and cfg.workers * per_worker > avail:
        fit = max(avail // per_worker, 0)
        advice = (f"use --workers {fit} or fewer, or a smaller model" if fit else
                  "not even one worker fits: use a smaller model (--n-layer, --n-embd, --block-size, --batch-size "
                  "or --vocab-size)")
        raise PreflightError("--workers", f"{cfg.workers} need about {cfg.workers} x {per_worker / 2**20:.0f} MiB "
                                          f"= {cfg.workers * per_worker / 2**30:.1f} GiB of memory, but "
                                          f"{avail / 2**30:.1f} GiB is free; {advice}")
    cache = cache_dir_for(cfg.data, cfg.cache_dir)
    if cfg.tokenizer == "bytes":
        what = f"encoding the text as bytes (cached in {cache})"
    elif tokenizer_is_cached(text, cfg.vocab_size, cache):
        what = f"loading the cached byte-level BPE tokenizer (vocabulary {cfg.vocab_size}) from {cache}"
    else:
        what = (f"training a byte-level BPE tokenizer (vocabulary {cfg.vocab_size}) on {len(text) / 1e6:.1f} M "
                f"characters (cached in {cache})")
    with stage(what):
        tok = build_tokenizer(text, cfg.tokenizer, cfg.vocab_size, cache_dir=cache)
        tokens = encode_corpus(text, tok, cache_dir=cache)
    need = cfg.block_size + 1
    try:
        train, val = split_tokens(tokens, cfg.val_fraction)
    except ValueError:
        train = val = tokens[:0]
    if min(train.numel(), val.numel()) < need:
        raise PreflightError("--data", f"{label} gives {tokens.numel()} tokens: {train.numel()} for training and "
                                       f"{val.numel()} held out (--val-fraction {cfg.val_fraction}), but each "
                                       f"needs at least --block-size + 1 = {need}; give more text or a smaller "
                                       "--block-size")
    cores = usable_cores()
    warnings = []
    if cfg.workers > cores:
        warnings.append(f"{cfg.workers} workers share {cores} CPU core{'s' if cores > 1 else ''} (one thread "
                        f"each): every step takes about {cfg.workers / cores:.1f}x longer than with a core each")
    if cfg.steps < cfg.round_steps:
        warnings.append(f"--steps {cfg.steps} is fewer than the {cfg.round_steps} inner steps of an outer round "
                        f"(--sync-every {cfg.sync_every}): the run is one outer round of {cfg.steps} steps")
    warnings += _setting_notes(cfg, tok.vocab_size)
    return {"chars": len(text), "tokens": int(tokens.numel()), "train_tokens": int(train.numel()),
            "val_tokens": int(val.numel()), "vocab_size": tok.vocab_size, "cache_dir": str(cache),
            "worker_bytes": per_worker, "available_bytes": avail, "cores": cores, "warnings": warnings}


# ---------------------------------------------------------------------------------------------------- launch
class _Follower:
    """Calls ``on_row`` for every complete line appended to ``path``: read every 0.2 s by a
    :class:`fgdiloco.runtime.Service` (the one owner of threads), and once more by :meth:`stop`."""

    def __init__(self, path: Path, on_row: Callable[[dict[str, Any]], Any]):
        from ..runtime import Service

        self.path, self.on_row = path, on_row
        self._file: Any = None
        self._buf = ""
        self._lock = threading.Lock()
        self._service = Service(self.read, 0.2, "metrics-follower")

    def read(self) -> None:
        """Take in what was appended since the last call."""
        import json

        with self._lock:
            if self._file is None and self.path.exists():
                self._file = open(self.path, encoding="utf-8")  # noqa: SIM115 - closed in stop()
            if self._file is None:
                return
            self._buf += self._file.read()
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                with contextlib.suppress(ValueError):
                    self.on_row(json.loads(line))

    def stop(self) -> None:
        """Stop following, after reading what is left."""
        self._service.stop()
        self.read()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _root_cause(err: Any, log_root: Path) -> WorkerFailed:
    """The one failure of a ``ChildFailedError`` that explains the others, as a :class:`WorkerFailed`."""
    failures = dict(err.failures)

    def log_of(rank: int, f: Any) -> Path | None:
        if f.error_file and os.path.isfile(f.error_file):
            p = Path(f.error_file).parent / "stderr.log"
            if p.is_file():
                return p
        hits = sorted(log_root.glob(f"*/attempt_*/{f.local_rank}/stderr.log"))
        return hits[-1] if hits else None

    def reason(f: Any) -> str:
        if f.exitcode == -signal.SIGKILL:
            return "killed by the system (SIGKILL), probably out of memory"
        if f.exitcode < 0:
            return f"stopped by signal {f.signal_name()}"
        msg = f.message
        if isinstance(msg, dict):
            msg = msg.get("message", "")
        msg = str(msg or "").strip()
        if not msg or msg.startswith("To enable traceback"):
            return f"exited with status {f.exitcode}"
        return msg.splitlines()[-1] if "\n" in msg else msg

    killed = [(r, f) for r, f in failures.items() if f.exitcode == -signal.SIGKILL]
    raised = sorted(((r, f) for r, f in failures.items() if f.exitcode > 0 and f.error_file_data.get("message")),
                    key=lambda rf: rf[1].timestamp)
    rank, f = (killed or raised or sorted(failures.items(), key=lambda rf: rf[1].timestamp))[0]
    return WorkerFailed(int(rank), reason(f), log_of(int(rank), f), traceback=f.exitcode > 0)


def _launched_worker(cfg: TrainConfig) -> dict[str, Any]:
    """A worker started by :func:`launch`: :func:`~fgdiloco.pretrain.worker.train_worker` with its stdout and
    stderr kept in its log files until the process ends.

    torchelastic points file descriptors 1 and 2 at the worker's log files only around the function; what runs at
    interpreter exit (``FGDiLoCo``'s ``atexit`` drain of an interrupted exchange, say) would write to the
    terminal. An ``atexit`` handler registered after ``fgdiloco.outer``'s (so run before it) points them back
    at the log files.
    """
    import atexit
    import sys

    import fgdiloco.outer.wrapper  # noqa: F401 - its atexit handler must be registered before ours

    saved = {fd: os.dup(fd) for fd in (1, 2)}

    def keep_in_log() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, log_fd in saved.items():
            with contextlib.suppress(OSError):
                os.dup2(log_fd, fd)

    atexit.register(keep_in_log)
    signal.signal(signal.SIGINT, _interrupt_once)
    return train_worker(cfg)


def _interrupt_once(signum: int, frame: Any) -> None:
    """A worker's SIGINT handler: the first SIGINT (Ctrl-C reaches the whole process group) stops training with
    KeyboardInterrupt; later ones are ignored. The worker is already stopping by then, and a second SIGINT can
    come after its function has returned and torchelastic has pointed stderr back at the terminal (the spawn
    wrapper's parent-death signal is SIGINT), where it would print a bare ``KeyboardInterrupt`` traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def launch(cfg: TrainConfig, *, on_row: Callable[[dict[str, Any]], Any] | None = None,
           on_start: Callable[[], Any] | None = None, resume: bool = False) -> dict[str, Any]:
    """Run the job on ``cfg.workers`` local worker processes and return its summary.

    An elastic configuration (:attr:`TrainConfig.elastic`: FG-DiLoCo with a gossip topology) runs on elastic
    workers (:func:`launch_elastic`: each worker, or each pipeline replica, its own ``torchrun`` job with
    ``cfg.max_restarts`` restarts; a dead worker never ends the job; ``resume``: continue from every worker's
    checkpoint). Any other (baselines, ``"allreduce"``) runs as one torchelastic job (:func:`launch_group`), where
    one worker's death ends the job.
    """
    if cfg.elastic:
        return launch_elastic(cfg, on_row=on_row, on_start=on_start, resume=resume)
    if resume:
        raise ValueError("resume needs an elastic run (FG-DiLoCo with a gossip topology); "
                         f"baseline={cfg.baseline!r}, topology={cfg.topology!r} has no checkpoints")
    return launch_group(cfg, on_row=on_row, on_start=on_start)


def launch_group(cfg: TrainConfig, *, on_row: Callable[[dict[str, Any]], Any] | None = None,
                 on_start: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Start ``cfg.workers`` local worker processes as ONE torchelastic job (``torchrun --standalone``'s engine,
    no restarts: one worker's death ends the job) and return rank 0's summary.

    Each worker runs :func:`~fgdiloco.pretrain.worker.train_worker` with ``OMP_NUM_THREADS=1``; its stdout and
    stderr go to ``<cfg.out>/logs/<run>/attempt_0/<rank>/``. Rendezvous is ``c10d`` on ``localhost`` on a port the
    OS picks, so concurrent jobs never collide. ``on_row`` is called (from a helper thread) with every
    ``metrics.jsonl`` row; ``on_start`` once the workers are being started. Torchelastic's own log lines go to
    ``<cfg.out>/logs/launcher.log``.

    Raises:
        ValueError / FileNotFoundError: an invalid configuration (checked before anything starts).
        WorkerFailed: a worker failed; the others were stopped.
        KeyboardInterrupt or ``torch.distributed.elastic.multiprocessing.api.SignalException``: SIGINT / SIGTERM
            reached this process; the workers were stopped (:func:`finish_interrupted` summarises what is done).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg = dataclasses.replace(cfg, run_id=cfg.run_id or uuid.uuid4().hex[:12], quiet=True)
    cfg.validate()
    out = Path(cfg.out)
    log_root = out / "logs"
    log_root.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.workers,
        run_id=f"fgdiloco-{cfg.run_id}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": 300},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_root), redirects=Std.ALL),
    )
    with _process_state(), _torchelastic_log(log_root / "launcher.log"):
        follower = _Follower(out / "metrics.jsonl", on_row) if on_row is not None else None
        try:
            if on_start is not None:
                on_start()
            results = elastic_launch(config, _launched_worker)(cfg)
        except ChildFailedError as e:
            raise _root_cause(e, log_root) from None
        finally:
            if follower is not None:
                follower.stop()
    return results[0]


@contextlib.contextmanager
def _process_state() -> Iterator[None]:
    """One thread per worker (``OMP_NUM_THREADS=1``, no tokenizer threads) inside; the environment and the SIGINT /
    SIGTERM handlers are restored after (torchelastic installs its own)."""
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        for s, h in saved_signals.items():
            signal.signal(s, h)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _torchelastic_log(path: Path) -> Iterator[None]:
    """Inside, torchelastic's own log lines (closing signals, failures) go to ``path``, not the terminal."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    saved = [(lg.propagate, lg.level, list(lg.handlers)) for lg in loggers]
    for lg in loggers:
        lg.handlers, lg.propagate = [handler], False
        lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        for lg, (propagate, level, handlers) in zip(loggers, saved):
            lg.handlers, lg.propagate = handlers, propagate
            lg.setLevel(level)
        handler.close()


# ---------------------------------------------------------------------------------------------------- elastic
def eval_points(cfg: TrainConfig) -> list[int]:
    """The rounds done at which a run evaluates: 0, every ``eval_every``-th, and the last."""
    return [0] + [r for r in range(1, cfg.rounds + 1) if r % cfg.eval_every == 0 or r == cfg.rounds]


def _failure_reason(log: Path, code: int) -> str:
    """One line on why a worker's torchrun job failed for good, from its log (torchrun's failure report, or the
    worker's last exception)."""
    import re

    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    exits = re.findall(r"exitcode\s*:\s*(-?\d+)", text)
    last = int(exits[-1]) if exits else code
    if not exits and code == -signal.SIGKILL:  # torchrun's agent itself, with no failure report of its worker
        return ("its torchrun agent was killed (SIGKILL), by the system (out of memory?) or by hand; the worker it "
                "ran may have gone on without it")
    if last == -signal.SIGKILL:
        return "killed by the system (SIGKILL), probably out of memory"
    if last < 0:
        with contextlib.suppress(ValueError):
            return f"stopped by signal {signal.Signals(-last).name}"
    errors = [m for m in re.findall(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$", text, re.M)
              if "ChildFailedError" not in m]
    return errors[-1].strip() if errors else f"exited with status {last}"


def _prepare_resume(out: Path, workers: int, stages: int = 1) -> tuple[int, int]:
    """Cut every worker's report file back to its checkpoint's round (a resumed worker continues from there);
    returns the lowest and the highest checkpoint round. ``stages > 1``: ``workers`` pipeline replicas, a checkpoint
    per stage (the replica's report follows its last stage's).

    Raises:
        PreflightError: a worker (or a stage of one) has no checkpoint (``--resume`` names the folder).
    """
    import json

    import torch

    def ckpt(k: int) -> Path:
        return checkpoint_path(out, k, None if stages == 1 else stages - 1)

    missing = [k for k in range(workers) if not all(checkpoint_path(out, k, None if stages == 1 else s).is_file()
                                                    for s in range(stages))]
    if missing:
        raise PreflightError("--resume", f"needs a checkpoint of every worker in {out / 'checkpoints'}, but "
                                         f"worker{'s' if len(missing) > 1 else ''} {missing} "
                                         f"{'have' if len(missing) > 1 else 'has'} none (a run writes them every "
                                         "--checkpoint-every rounds)")
    rounds = []
    for k in range(workers):
        rnd = int(torch.load(ckpt(k), map_location="cpu", weights_only=False)["round"])
        rounds.append(rnd)
        path = rows_path(out, k)
        kept = []
        with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    kind = ev.get("event")
                    if kind == "start" or (kind in ("row", "rejoin") and int(ev["round"]) <= rnd):  # "end": not now
                        kept.append(json.dumps(ev) + "\n")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return min(rounds), max(rounds)


def launch_elastic(cfg: TrainConfig, *, on_row: Callable[[dict[str, Any]], Any] | None = None,
                   on_start: Callable[[], Any] | None = None, resume: bool = False) -> dict[str, Any]:
    """Run ``cfg.workers`` elastic workers (docs/faults.md) and return the run's summary.

    This process serves the gossip store (:class:`fgdiloco.elastic.SupervisedStore`: restarted when it dies) and
    starts every worker slot (every pipeline replica with ``cfg.stages > 1``: its stages fail and restart
    together) as its own ``torchrun`` job (:func:`fgdiloco.elastic.torchrun_command`, ``--max-restarts
    cfg.max_restarts``) running :mod:`fgdiloco.pretrain.elastic_worker` on ``<out>/config.json``; worker k's
    output (its agent's too) goes to ``<out>/logs/worker<k>.log``. A worker that dies is restarted by its agent,
    continues from its checkpoint (or the seeded init) and rejoins at the live round; the others never stop for
    it. Meanwhile this process merges the workers' reports into ``metrics.jsonl`` (``on_row`` sees each row) and
    at the end writes ``summary.json`` (with ``restarts`` and ``rejoins``) and ``loss.png`` (rejoins marked).

    ``resume``: continue a stopped run in ``cfg.out`` from every worker's checkpoint (same ``run_id``).

    Raises:
        ValueError: an invalid or non-elastic configuration.
        PreflightError: ``resume`` without a checkpoint of every worker.
        WorkerFailed: every worker failed for good (the lowest slot's cause and log).
        KeyboardInterrupt or ``SignalException``: SIGINT / SIGTERM reached this process; the workers were
            stopped, the complete rows written (:func:`finish_interrupted` summarises them).
    """
    if not cfg.elastic:
        raise ValueError("launch_elastic runs FG-DiLoCo with a gossip topology; use launch_group")
    cfg = dataclasses.replace(cfg, run_id=cfg.run_id or uuid.uuid4().hex[:12], quiet=True)
    cfg.validate()
    quiet_until, start_round = _prepare_elastic_folder(cfg, resume)
    run = _ElasticRun(cfg, on_row, quiet_until)
    try:
        codes = run.run(on_start, start_round)
    finally:
        run.close()
    return _elastic_summary(cfg, run.merger, codes, resume)


def _prepare_elastic_folder(cfg: TrainConfig, resume: bool) -> tuple[int, int]:
    """Make ``cfg.out`` ready for the workers: ``logs/``, ``workers/``, ``config.json``; what is rebuilt from the
    workers' reports removed (their reports too, unless resuming: then cut back to the checkpoints). Returns the
    last round already shown (-1: none) and the round every worker starts at.

    Raises:
        PreflightError: ``resume`` without a checkpoint of every worker.
    """
    out = Path(cfg.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "workers").mkdir(parents=True, exist_ok=True)
    quiet_until, start_round = _prepare_resume(out, cfg.replicas, cfg.stages) if resume else (-1, 0)
    stale = [out / "summary.json", out / "loss.png", out / "metrics.jsonl", stop_path(out)]  # rebuilt from reports
    if not resume:
        stale += [rows_path(out, k) for k in range(cfg.replicas)]
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    write_json(out / "config.json", cfg.as_dict())
    return quiet_until, start_round


class _ElasticRun:
    """The launching process's side of an elastic job: the gossip store, one torchrun job per worker slot, and
    the merge of their reports into ``metrics.jsonl`` (and ``run.json``, from the first worker's start)."""

    def __init__(self, cfg: TrainConfig, on_row: Callable[[dict[str, Any]], Any] | None, quiet_until: int):
        from ..elastic import SupervisedStore
        from .merge import Merger

        self.cfg, self.out, self.on_row, self.quiet_until = cfg, Path(cfg.out), on_row, quiet_until
        self.merger = Merger(self.out / "workers", cfg.replicas, eval_points(cfg), sync_every=cfg.round_steps,
                             steps=cfg.steps)
        self.metrics = open(self.out / "metrics.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.wrote_info = False
        self.store = SupervisedStore("127.0.0.1", 0)  # restarted on the same port when it dies
        self.procs: list[Any] = []
        self.logs: list[Any] = []
        self.saved_term = signal.getsignal(signal.SIGTERM)

    def pump(self, gone: set[int]) -> None:
        """Merge what the workers reported since the last call (``gone``: the slots whose job has ended)."""
        import json

        self.merger.read()
        if self.merger.info is not None and not self.wrote_info:
            write_json(self.out / "run.json", {k: v for k, v in self.merger.info.items() if k != "_worker"})
            self.wrote_info = True
        for row in self.merger.ready(gone):
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
            if self.on_row is not None and row["round"] > self.quiet_until:
                self.on_row(row)

    def run(self, on_start: Callable[[], Any] | None, start_round: int) -> list[int]:
        """Start every worker and merge until all have ended; returns their exit codes. On SIGINT / SIGTERM (or any
        error) the workers are stopped and what they reported is merged before it is raised again."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        def on_term(signum: int, frame: Any) -> None:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

        signal.signal(signal.SIGTERM, on_term)
        try:
            if on_start is not None:
                on_start()
            self._start_workers(start_round)
            self.store.ready()  # its child imported torch beside the workers' agents
            while True:
                gone = {k for k, p in enumerate(self.procs) if p.poll() is not None}
                self.pump(gone)
                if len(gone) == len(self.procs):
                    return [p.returncode for p in self.procs]
                time.sleep(0.2)
        except BaseException as e:
            self._stop_workers(signal.SIGTERM if isinstance(e, SignalException) else signal.SIGINT)
            raise

    def _start_workers(self, start_round: int) -> None:
        import subprocess

        from ..elastic import (
            JOB_ENV,
            LIVES_ENV,
            MIN_WORKERS_ENV,
            STORE_ENV,
            WORKER_ENV,
            WORKERS_ENV,
            torchrun_command,
        )
        from .elastic_worker import START_ROUND_ENV

        cfg = self.cfg
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", STORE_ENV: self.store.address,
                    WORKERS_ENV: str(cfg.replicas), MIN_WORKERS_ENV: str(cfg.replicas), JOB_ENV: "pretrain"})
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        env[START_ROUND_ENV] = str(start_round)  # resumed workers all start there (their checkpoints may differ)
        cmd = torchrun_command(["-m", "fgdiloco.pretrain.elastic_worker", str(self.out / "config.json")],
                               max_restarts=cfg.max_restarts, nproc=cfg.stages)  # a replica's stages: one job
        for k in range(cfg.replicas):
            lives = self.out / "logs" / f"worker{k}.lives"
            lives.unlink(missing_ok=True)  # this launch's lives
            f = open(self.out / "logs" / f"worker{k}.log", "ab")  # noqa: SIM115 - closed in close()
            self.logs.append(f)
            self.procs.append(subprocess.Popen(cmd, env={**env, WORKER_ENV: str(k), LIVES_ENV: str(lives)},
                                               stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def _stop_workers(self, sig: int) -> None:
        import subprocess

        for p in self.procs:  # a terminal's Ctrl-C reached the whole group already; make sure every agent hears it
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.send_signal(sig)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with contextlib.suppress(Exception):
            self.pump(set(range(len(self.procs))))

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.saved_term)
        self.metrics.close()
        for f in self.logs:
            f.close()
        self.store.close()


def _elastic_summary(cfg: TrainConfig, merger: Any, codes: list[int], resume: bool) -> dict[str, Any]:
    """``summary.json`` and ``loss.png`` of a finished elastic job, from the merged rows.

    Raises:
        WorkerFailed: every worker failed for good, or none reported anything (the lowest slot's cause and log).
    """
    from ..elastic.launch import lives

    out = Path(cfg.out)
    logs = out / "logs"
    lost = [k for k, c in enumerate(codes) if c != 0]
    per = [lives(logs / f"worker{k}.lives") for k in range(len(codes))]
    store_gone = [k for k, (_, stop) in enumerate(per) if stop is not None and stop.get("kind") == "store"]
    if store_gone:
        raise WorkerFailed(store_gone[0], f"the gossip store was out of reach for more than {cfg.store_timeout:g} s "
                                          f"(store_timeout): workers {store_gone} stopped with their checkpoints; "
                                          f"continue with fgdiloco pretrain --resume --out {out}",
                           logs / f"worker{store_gone[0]}.log", traceback=False)
    if len(lost) == len(codes) or not merger.merged:
        k = lost[0] if lost else 0
        reason = _failure_reason(logs / f"worker{k}.log", codes[k])
        signalled = reason.startswith(("killed", "stopped", "its torchrun agent"))
        raise WorkerFailed(k, reason, logs / f"worker{k}.log", traceback=not signalled)
    info = {k: v for k, v in (merger.info or {}).items() if k != "_worker"}
    rows = merger.merged
    last = rows[-1]
    summary = summarise(info, rows, extra={
        "rank": 0,
        "wall_seconds": last["wall_seconds"],
        "train_seconds": last["train_seconds"],
        "eval_seconds": last["wall_seconds"] - last["train_seconds"],
        "peak_rss_bytes": merger.peak_rss_bytes,
        "restarts": max(merger.restarts, sum(max(n - 1, 0) for n, _ in per)),  # every life torchrun started
        "rejoins": len(merger.rejoin_events),
        "rejoin_events": merger.rejoin_events,
        "workers_lost": [{"worker": k, "reason": _failure_reason(logs / f"worker{k}.log", codes[k]),
                          "log": str(logs / f"worker{k}.log")} for k in lost],
        "resumed": resume,
    })
    write_json(out / "summary.json", summary)
    plot(out, rows, info["unigram_loss"], info["title"], rejoins=merger.rejoin_events)
    summary.update(metrics_path=str(out / "metrics.jsonl"), plot_path=str(out / "loss.png"),
                   summary_path=str(out / "summary.json"))
    return summary


# ---------------------------------------------------------------------------------------------------- interrupted
def finish_interrupted(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Summarise a run that was stopped: ``summary.json`` marked ``"interrupted": true`` and ``loss.png`` for the
    evaluations in ``metrics.jsonl``. A complete ``summary.json`` of the same run (it finished just before the
    signal) is kept as it is. Returns the summary, or None when the workers had not written ``run.json`` yet
    (nothing to summarise; nothing is written)."""
    import json

    folder = Path(out)
    try:
        info = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    with contextlib.suppress(OSError, ValueError):
        done = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        if done.get("run_id") == info.get("run_id") and not done.get("interrupted"):
            return done
    rows = read_rows(folder / "metrics.jsonl")
    extra, rejoins = None, None
    if info.get("elastic") and (folder / "workers").is_dir():  # restarts and rejoins from the workers' reports
        from .merge import Merger

        m = Merger(folder / "workers", int(info["workers"]), [], sync_every=1, steps=0)
        m.read()
        rejoins = m.rejoin_events
        extra = {"restarts": m.restarts, "rejoins": len(rejoins), "rejoin_events": rejoins,
                 "peak_rss_bytes": m.peak_rss_bytes}
    summary = summarise(info, rows, interrupted=True, extra=extra)
    write_json(folder / "summary.json", summary)
    if rows:
        plot(folder, rows, info["unigram_loss"], info["title"] + f" (interrupted after round {rows[-1]['round']})",
             rejoins=rejoins)
    return summary

