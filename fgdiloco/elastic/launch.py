"""Starting an elastic job: its settings from the environment, a worker's :func:`connect` to the gossip store,
and :func:`launch` of local workers, each its own ``torchrun`` job (see :mod:`fgdiloco.elastic`)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config import FGDiLoCoConfig
from ..gossip.membership import server_accepts
from ..gossip.transport import DistributedTransport
from .membership import ElasticMembership, StoreNotReached
from .store import SupervisedStore

__all__ = ["STORE_ENV", "WORKER_ENV", "WORKERS_ENV", "JOB_ENV", "MIN_WORKERS_ENV", "connect", "launch", "settings",
           "torchrun_command"]

log = logging.getLogger("fgdiloco")

STORE_ENV = "FGDILOCO_STORE"  # host:port of the gossip store
WORKER_ENV = "FGDILOCO_WORKER"  # this worker's slot, 0 .. workers - 1
WORKERS_ENV = "FGDILOCO_WORKERS"  # the job's worker slots
JOB_ENV = "FGDILOCO_JOB"  # the job's name on the store (several jobs may share one store); default "default"
MIN_WORKERS_ENV = "FGDILOCO_MIN_WORKERS"  # slots that must have joined before the first round (default: all)
RESUME_ENV = "FGDILOCO_RESUME"  # "1": continue from the worker's own checkpoints (fgdiloco launch --resume)
LIVES_ENV = "FGDILOCO_LIVES_FILE"  # where fgdiloco.elastic.life counts a worker's lives


def _parse_address(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT (e.g. localhost:29400), got {address!r}")
    return host, int(port)


def _int_setting(value: int | str | None, name: str, env: str, minimum: int) -> int:
    if value is None:
        raise ValueError(f"{name} is not set: pass {name}= or set ${env} (fgdiloco launch sets it)")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name} (${env}) must be an int >= {minimum}, got {value!r}") from None
    if n < minimum:
        raise ValueError(f"{name} (${env}) must be an int >= {minimum}, got {n}")
    return n


def settings(address: str | None = None, worker: int | None = None, workers: int | None = None, *,
             job: str | None = None, min_workers: int | None = None,
             environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The elastic job's settings: each argument, else its environment variable (``FGDILOCO_STORE``,
    ``FGDILOCO_WORKER``, ``FGDILOCO_WORKERS``, ``FGDILOCO_JOB``, ``FGDILOCO_MIN_WORKERS``). Nothing is contacted.

    Returns ``{"host", "port", "worker", "workers", "job", "min_workers"}``.

    Raises:
        ValueError: a setting missing or out of range (the message names the argument and its variable).
        TypeError: a setting of the wrong type.
    """
    env = os.environ if environ is None else environ
    address = address if address is not None else env.get(STORE_ENV)
    if not address:
        raise ValueError(f"address is not set: pass address= or set ${STORE_ENV}=HOST:PORT (the gossip store: "
                         "fgdiloco store, or fgdiloco launch)")
    host, port = _parse_address(address, f"address (${STORE_ENV})")
    n = _int_setting(workers if workers is not None else env.get(WORKERS_ENV), "workers", WORKERS_ENV, 1)
    k = _int_setting(worker if worker is not None else env.get(WORKER_ENV), "worker", WORKER_ENV, 0)
    if k >= n:
        raise ValueError(f"worker (${WORKER_ENV}) must be in [0, workers={n}), got {k}")
    m_raw = min_workers if min_workers is not None else env.get(MIN_WORKERS_ENV)
    m = n if m_raw in (None, "") else _int_setting(m_raw, "min_workers", MIN_WORKERS_ENV, 0)
    if m > n:
        raise ValueError(f"min_workers (${MIN_WORKERS_ENV}) must be in [0, workers={n}], got {m}")
    name = job if job is not None else env.get(JOB_ENV, "default")
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"job (${JOB_ENV}) must be a non-empty name without '/', got {name!r}")
    return {"host": host, "port": port, "worker": k, "workers": n, "job": name, "min_workers": m}


def connect(address: str | None = None, worker: int | None = None, workers: int | None = None, *,
            job: str | None = None, min_workers: int | None = None, timeout: float = FGDiLoCoConfig.join_timeout,
            liveness: float = FGDiLoCoConfig.liveness, store_timeout: float = FGDiLoCoConfig.store_timeout,
            wait: float | None = None, fingerprint: bytes | None = None, secret: bytes | None = None,
            sibling_jobs: Sequence[str] = ()) -> DistributedTransport:
    """Join the elastic job on its gossip store; returns this worker's transport, over an
    :class:`~fgdiloco.elastic.ElasticMembership` of its slot (``FGDiLoCo(elastic=True)`` calls it with its
    settings and its model's layout fingerprint). ``timeout``: seconds to reach the store and for each exchange's
    peer to arrive.

    Arguments default to the environment (:func:`settings`). Admission: every worker of a job must have the same slot
    count, model layout (``fingerprint``) and job secret (``secret``: only an HMAC of it goes to the store); the
    first worker's are the job's. The job's first workers (those that register before any worker has passed this
    start barrier: joined from then on, whatever round they start at, e.g. a resumed job's checkpoint round) wait
    (at most ``wait`` seconds, default ``timeout``) until ``min_workers`` slots (default: all) have joined, so that
    no one spends its first round with an empty partner slot (a restart or a late joiner does not wait, nor does a
    worker that finds the job past round 0: after a restart of the store the slots of workers that finished, left
    or are down meanwhile never count as joined again); after
    that they start without the missing slots (a warning names them; those slots join later, or never: their
    exchanges are skipped at once). ``sibling_jobs``: for a stage of an elastic pipeline replica (each stage
    gossips in a job of its own, ``<job>.stage<s>``), the jobs of its replica's other stages, whose heartbeats
    count for a peer's liveness (a hung stage holds its whole replica).

    Raises:
        ValueError / TypeError: a setting missing or out of range (see :func:`settings`).
        AdmissionError: a slot count, model layout or job secret other than the job's (the first worker's).
        SlotTaken: another live process holds this worker's slot.
        StoreNotReached: the store cannot be reached within ``timeout`` seconds (a ``TimeoutError`` and a
            :class:`~fgdiloco.elastic.StoreUnreachable`: under ``fgdiloco launch`` the worker stops for good with
            one line naming the store, and the launcher exits non-zero saying so, instead of torchrun restarting it
            to wait again).
    """
    s = settings(address, worker, workers, job=job, min_workers=min_workers)
    host, port = str(s["host"]), int(s["port"])
    _await_store(host, port, timeout)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout),
                              use_libuv=True)
    except Exception as e:  # noqa: BLE001 - c10d raises RuntimeError/DistStoreError for every failure to connect
        raise StoreNotReached(f"cannot reach the gossip store at {host}:{port} (${STORE_ENV}) within "
                           f"{timeout:g} s: {type(e).__name__}: {e}") from e
    keys = _admit(store, str(s["job"]), int(s["workers"]), fingerprint, secret)
    membership = ElasticMembership(store, int(s["worker"]), int(s["workers"]), f"fgdiloco/{s['job']}",
                                   liveness=liveness, address=(host, port), store_timeout=store_timeout,
                                   job_keys=keys, siblings=[f"fgdiloco/{j}" for j in sibling_jobs],
                                   first=True)
    transport = DistributedTransport(membership=membership, join_timeout=timeout, liveness=liveness)
    t0, want, wait = time.monotonic(), int(s["min_workers"]), timeout if wait is None else wait
    while True:
        joined, live = membership.joined(), membership.live_round() or 0
        if not membership.first or len(joined) >= want or live > 0:
            break  # enough slots joined, or the job has begun: a restart or a late joiner waits for no one
        if time.monotonic() - t0 > wait:
            missing = sorted(set(range(int(s["workers"]))) - set(joined))
            log.warning("fgdiloco: worker %d starts without slot(s) %s: only %d of the %d first workers joined "
                        "within %g s (they join later, or their exchanges are skipped)", membership.rank,
                        missing[:10], len(joined), want, wait)
            break
        time.sleep(0.1)
    if live == 0 and not membership.first:  # a late joiner while the job is still at round 0: waited for there,
        membership.mark_joined()  # joined from now on (first workers are from their registration)
    membership.begin()  # from now on a worker that registers is a restart or a late joiner
    log.info("fgdiloco: worker %d of %d joined job %r on %s:%d (incarnation %d)", transport.rank,
             transport.world_size, s["job"], host, port, membership.incarnation)
    return transport


class AdmissionError(ValueError):
    """A worker whose slot count, model layout or job secret differs from its job's (the first worker's)."""


def _admit(store: dist.Store, job: str, workers: int, fingerprint: bytes | None,
           secret: bytes | None) -> dict[str, bytes]:
    """Check this worker against the job's slot count, model layout and secret (the first worker's); returns the
    job keys (re-published to a restarted store).

    Raises:
        AdmissionError: one of them differs (the message says which and what to do).
    """
    tag = b"none" if secret is None else hmac.new(secret, b"fgdiloco job secret", hashlib.sha256).hexdigest().encode()
    checks = [("slots", str(workers).encode(), lambda theirs: f"workers (${WORKERS_ENV}) is {workers} here but the job "
                                                              f"{job!r} on this store has {theirs} slots: every worker "
                                                              "of a job must use the same")]
    if fingerprint is not None:
        checks.append(("fingerprint", fingerprint.hex().encode(), lambda theirs: "this worker's model has another "
                       f"parameter layout (fingerprint {fingerprint.hex()}) than the job {job!r} ({theirs}): every "
                       "worker must build the same model"))
    checks.append(("secret", tag, lambda theirs: f"this worker's job secret differs from the job {job!r}'s "
                   "(FGDILOCO_SECRET / FGDILOCO_SECRET_FILE): every worker must use the same, or none"))
    keys = {}
    for name, mine, message in checks:
        key = f"fgdiloco/{job}/{name}"
        agreed = store.compare_set(key, "", mine)  # the first worker of the job sets it
        if agreed != mine:
            raise AdmissionError(message(agreed.decode()))
        keys[key] = mine
    return keys


def _await_store(host: str, port: int, timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) until something accepts connections at ``host:port``, saying once that it
    does not yet. A TCPStore client would retry on its own, but with a back-off that outlasts its timeout (a wrong
    address was silent for 60 s, then slept 64 s more) and a c10d warning per attempt.

    Raises:
        StoreNotReached: nothing accepted within ``timeout``.
    """
    t0, said = time.monotonic(), False
    while not server_accepts(host, port):
        waited = time.monotonic() - t0
        if waited >= timeout:
            raise StoreNotReached(f"cannot reach the gossip store at {host}:{port} (${STORE_ENV}) within "
                                  f"{timeout:g} s: nothing accepts connections there")
        if not said:
            log.warning("fgdiloco: nothing accepts connections at the gossip store's address %s:%d yet; trying for "
                        "%g s", host, port, timeout)
            said = True
        time.sleep(min(0.5, timeout - waited))


def torchrun_command(script: Sequence[str], *, max_restarts: int, monitor_interval: float = 0.1,
                     life: bool = True, nproc: int = 1) -> list[str]:
    """The command that runs one worker as its own ``torchrun`` job (``--standalone``: a private rendezvous on a
    free port, so the jobs never meet each other's agents) of ``nproc`` processes (a pipeline replica: its stages,
    which fail and restart together). ``life``: through :mod:`fgdiloco.elastic.life`, which counts every life
    torchrun starts and ends a worker that must stop for good without a restart. ``monitor_interval``: how often
    (seconds) the agent looks at its processes, so how soon a death is restarted and an end is seen (torchrun's
    default)."""
    shim = ["-m", "fgdiloco.elastic.life"] if life else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval}", *shim, *script]


def _check_launch(script: Sequence[str], workers: Any, max_restarts: Any, store: str | None, slots: Any,
                  first_worker: Any) -> int:
    """Check :func:`launch`'s arguments before anything starts; returns the slot count."""
    for name, v, low in (("workers", workers, 1), ("max_restarts", max_restarts, 0), ("first_worker", first_worker, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    slots = first_worker + workers if slots is None else slots
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < first_worker + workers:
        raise ValueError(f"slots must be an int >= first_worker + workers = {first_worker + workers}, got {slots!r}")
    if not script:
        raise ValueError("script must name the worker's script (train.py ...) or module (-m pkg.mod ...)")
    if store is not None:
        _parse_address(store, "store")
    if script[0] != "-m" and not Path(script[0]).is_file():  # else every worker fails and restarts for nothing
        raise ValueError(f"script {script[0]!r} is not a file (give the worker's script, or -m pkg.mod)")
    return slots


def _run_workers(script: Sequence[str], slots: range, base: Mapping[str, str], max_restarts: int,
                 logs: Path | None, lives_dir: Path, stages: int = 1,
                 started: Callable[[], Any] | None = None) -> list[int]:
    """Start one torchrun job per slot (then call ``started``) and wait for all of them; their exit codes. A worker
    that fails for good while others run is named at once. Ctrl-C (or an error of ``started``) reaches every
    agent; so does SIGTERM (raised here as torchelastic's ``SignalException``, as ``fgdiloco pretrain`` does),
    which the agents get as SIGTERM."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def on_term(signum: int, _frame: Any) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    procs: list[subprocess.Popen[bytes]] = []
    files = []
    main_thread = threading.current_thread() is threading.main_thread()
    saved_term = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    try:
        for k in slots:
            out = open(logs / f"worker{k}.log", "ab") if logs is not None else None  # noqa: SIM115 - closed below
            files.append(out)
            env = {**base, WORKER_ENV: str(k), LIVES_ENV: str(lives_dir / f"worker{k}.lives")}  # elastic.life's
            cmd = torchrun_command(script, max_restarts=max_restarts, nproc=stages)
            procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                          stderr=subprocess.STDOUT if out is not None else None))
        if started is not None:
            started()
        told: set[int] = set()
        while len(told) < len(procs):
            for k, p in zip(slots, procs):
                if k not in told and p.poll() is not None:
                    told.add(k)
                    if p.returncode != 0 and len(told) < len(procs):
                        where = f"; its output: {logs / f'worker{k}.log'}" if logs is not None else ""
                        print(f"[fgdiloco] launch: worker {k} failed for good (exit {p.returncode}, after "
                              f"{max_restarts} restarts); the others go on without its slot{where}",
                              file=sys.stderr, flush=True)
            time.sleep(0.2)
        return [p.returncode for p in procs]
    except BaseException as e:
        # Ctrl-C: the terminal sent SIGINT to the whole group; make sure every agent hears it. SIGTERM (a process
        # manager stopping this command alone) goes on as SIGTERM: the agents would otherwise train on, orphaned
        _stop(procs, signal.SIGTERM if isinstance(e, SignalException) else signal.SIGINT)
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, saved_term if saved_term is not None else signal.SIG_DFL)
        for f in files:
            if f is not None:
                f.close()


def _stop(procs: Sequence[subprocess.Popen[bytes]], sig: int) -> None:
    """Send ``sig`` to every agent still running and wait for each (30 s, then kill it)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def lives(path: Path) -> tuple[int, dict[str, Any] | None]:
    """What a worker's lives file (:mod:`fgdiloco.elastic.life`) says: the lives torchrun started, and the
    ``stop`` record of a worker that stopped for good (None: it did not)."""
    return _lives_of(_records(path))


def _lives_of(records: list[dict[str, Any]]) -> tuple[int, dict[str, Any] | None]:
    stops = [r for r in records if r.get("event") == "stop"]
    # one line per process of a life (a pipeline replica's stages share one): count torchrun's restart numbers
    return len({r.get("restart", 0) for r in records if r.get("event") == "start"}), (stops[-1] if stops else None)


def _report(slots: range, codes: list[int], logs: Path, max_restarts: int, address: str) -> int:
    """Print the launch's last line; returns the number of workers that did not finish."""
    records = {k: _records(logs / f"worker{k}.lives") for k in slots}
    per = {k: _lives_of(r) for k, r in records.items()}
    restarts = {k: max(n - 1, 0) for k, (n, _) in per.items()}
    failed = [k for k, c in zip(slots, codes) if c != 0]
    stopped = {k: stop for k, (_, stop) in per.items() if stop is not None and k not in failed}
    done = len(codes) - len(failed) - len(stopped)
    parts = [f"{done} of {len(codes)} workers finished, {sum(restarts.values())} restart(s)"
             + (f" ({', '.join(f'worker {k}: {n}' for k, n in restarts.items() if n)})" if any(restarts.values())
                else "")]
    if failed:
        parts.append(f"workers {failed} failed for good (after {max_restarts} restarts each; see their logs)")
    gone = sorted(k for k, st in stopped.items() if st.get("kind") == "store" and st.get("reached", True))
    if gone:
        parts.append(f"workers {gone} stopped: the gossip store at {address} was out of reach for too long "
                     "(continue with --resume)")
    unreached = sorted(k for k, st in stopped.items() if st.get("kind") == "store" and not st.get("reached", True))
    if unreached:
        parts.append(f"workers {unreached} stopped: they could not reach the gossip store at {address} (is it "
                     "running there? see --store; a job that had begun continues with --resume)")
    for k, st in sorted(stopped.items()):
        if st.get("kind") != "store":
            parts.append(f"worker {k} was refused: {st.get('reason')}")
    # a worker whose first life joined after every other worker had left trained nothing (noted by rejoin._enter); a
    # restart that arrives at the end of a job its earlier lives trained in is not named
    ended = {k: r[-1]["round"] for k, r in records.items()
             if r and r[-1].get("event") == "ended" and restarts[k] == 0 and k not in failed and k not in stopped}
    if ended:
        parts.append(f"workers {sorted(ended)} joined after every other worker had left, at the job's last round "
                     f"({max(ended.values())}), and trained nothing: a new job on a store that served one needs its "
                     "own --job NAME")
    print("[fgdiloco] launch: " + "; ".join(parts), file=sys.stderr, flush=True)
    return len(failed) + len(stopped)


def launch(script: Sequence[str], workers: int, *, max_restarts: int = 3, store: str | None = None,
           slots: int | None = None, first_worker: int = 0, job: str | None = None,
           log_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
           resume: bool = False, stages: int = 1) -> int:
    """Run ``workers`` workers of ``script`` (``["train.py", "--arg", ...]`` or ``["-m", "pkg.mod", ...]``), each
    as its own ``torchrun`` job with ``max_restarts`` restarts, until every one has ended; returns the number of
    workers that did not finish (failed for good, refused, or stopped because the gossip store was out of reach;
    0: all finished). The last line counts the restarts (every life torchrun started, :mod:`fgdiloco.elastic.life`)
    and names every worker that did not finish and why.

    The gossip store served here (``store=None``) runs in a child process that is restarted when it dies
    (:class:`~fgdiloco.elastic.SupervisedStore`); the workers reconnect and re-publish their state.

    Args:
        store: ``HOST:PORT`` of a running gossip store (``fgdiloco store``); None: serve one here.
        slots: the job's worker slots (default ``first_worker + workers``); more than are started leaves room for
            workers that join later.
        first_worker: slot of the first worker started here (several machines: give each its own range).
        job: the job's name on the store.
        log_dir: each worker's output goes to ``<log_dir>/worker<k>.log`` (None: the terminal).
        env: extra environment for the workers (``OMP_NUM_THREADS`` defaults to 1).
        resume: set ``FGDILOCO_RESUME=1`` for the workers: a script that keeps checkpoints continues from them
            (after a stop for the store, for instance).
        stages: processes per worker slot: an elastic pipeline replica's stages, one torchrun job that fails and
            restarts together (the script calls :func:`~fgdiloco.elastic.init_replica_group` and builds
            ``FGDiLoCo(..., mesh=ReplicaMesh(1, stages), elastic=True)``).

    Raises:
        ValueError: an argument out of range (named), or a script that is not a file.
        RuntimeError: the gossip store served here could not start (the workers started were stopped).
    """
    slots = _check_launch(script, workers, max_restarts, store, slots, first_worker)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if job is not None and (not isinstance(job, str) or not job or "/" in job):
        raise ValueError(f"job must be a non-empty name without '/', got {job!r}")  # else every worker fails
    if log_dir is not None:
        try:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"log_dir {str(log_dir)!r} cannot be created: {e.strerror}") from None
        if not os.access(log_dir, os.W_OK):
            raise ValueError(f"log_dir {str(log_dir)!r} is not writable")
    served = SupervisedStore() if store is None else None
    address = served.address if served is not None else store
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")
    base.update(env or {})
    base.update({STORE_ENV: address, WORKERS_ENV: str(slots)})
    if store is None:  # the workers started here are the first ones (slots beyond them are for later joiners)
        base.setdefault(MIN_WORKERS_ENV, str(first_worker + workers))
    if job is not None:
        base[JOB_ENV] = job
    if resume:
        base[RESUME_ENV] = "1"
    with tempfile.TemporaryDirectory(prefix="fgdiloco-launch-") as tmp:
        logs = Path(log_dir) if log_dir is not None else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for k in range(first_worker, first_worker + workers):  # this launch's lives only
            (logs / f"worker{k}.lives").unlink(missing_ok=True)
        print(f"[fgdiloco] launch: workers {first_worker}..{first_worker + workers - 1} of {slots} slots on the "
              f"gossip store {address}, each its own torchrun job (max {max_restarts} restarts)"
              + (f"; their output goes to {logs}/worker<k>.log" if log_dir is not None else ""), file=sys.stderr,
              flush=True)
        workers_range = range(first_worker, first_worker + workers)
        try:
            codes = _run_workers(script, workers_range, base, max_restarts, logs if log_dir is not None else None,
                                 logs, stages, started=served.ready if served is not None else None)
        finally:
            if served is not None:
                served.close()
        return _report(workers_range, codes, logs, max_restarts, address)
