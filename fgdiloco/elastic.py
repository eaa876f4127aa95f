"""Elastic jobs: workers that die, hang, come back and join without stopping anyone (docs/faults.md).

torchelastic (``torchrun``) restarts or fails its workers as one group: when one local worker dies, the agent stops
the others. Gossip needs no group, so in an elastic job **each worker is its own torchrun job** (with
``--max-restarts``), and the workers meet on a **gossip store that no worker hosts**: a ``TCPStore`` served by
``fgdiloco store`` (or by ``fgdiloco launch``, which starts the workers too). torchft does the same for DiLoCo (one
torchrun job per replica group and a Lighthouse); fgdiloco needs no quorum, only membership on the store:

* **slots**: the job has ``FGDILOCO_WORKERS`` worker slots; worker ``FGDILOCO_WORKER`` takes one. The gossip schedule
  is the same random matching over the slots on every worker (:class:`~fgdiloco.gossip.Topology`), so it stays
  doubly stochastic over whoever is live: a worker whose partner slot is empty (never joined, or departed with a
  notice) skips that gossip round at once; a partner that died costs one liveness timeout (5 s) and then back-off.
* **incarnations**: each process that takes a slot is a new incarnation (a counter in the store). Exchange keys name
  both sides' incarnations, so a restarted worker never meets what its dead predecessor left behind, and its peers
  reset their back-off for it as soon as they see the new incarnation.
* **the live round**: every worker publishes the outer round it starts. A restarted worker (from its own checkpoint,
  or fresh) or one that hung and came back joins the job at the newest round a peer has started
  (:meth:`fgdiloco.FGDiLoCo.rejoin`), and is mixed with again at once.

A worker's script needs one change: ``FGDiLoCo(..., elastic=True)`` (settings come from the environment the
launcher sets). Launch on one machine::

    fgdiloco launch --workers 4 --max-restarts 3 train.py --my-args

or by hand, on several machines::

    fgdiloco store --port 29400                                   # on one machine (no worker)
    FGDILOCO_STORE=host:29400 FGDILOCO_WORKERS=8 FGDILOCO_WORKER=k torchrun --standalone --nproc-per-node 1 \\
        --max-restarts 3 train.py                                 # once per worker k = 0..7, anywhere
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch.distributed as dist

from .gossip.transport import DistributedTransport

__all__ = ["STORE_ENV", "WORKER_ENV", "WORKERS_ENV", "JOB_ENV", "MIN_WORKERS_ENV", "GossipStore", "connect",
           "launch", "settings"]

log = logging.getLogger("fgdiloco")

STORE_ENV = "FGDILOCO_STORE"  # host:port of the gossip store
WORKER_ENV = "FGDILOCO_WORKER"  # this worker's slot, 0 .. workers - 1
WORKERS_ENV = "FGDILOCO_WORKERS"  # the job's worker slots
JOB_ENV = "FGDILOCO_JOB"  # the job's name on the store (several jobs may share one store); default "default"
MIN_WORKERS_ENV = "FGDILOCO_MIN_WORKERS"  # slots that must have joined before the first round (default: all)


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


class GossipStore:
    """The job's gossip store: a ``torch.distributed.TCPStore`` served by this process, which is not a worker,
    so no worker's death takes it down. ``fgdiloco store`` runs one until it is stopped; ``fgdiloco launch`` and
    ``fgdiloco pretrain`` run one for their workers.

    Args:
        host: interface to listen on (``"0.0.0.0"``: all, for workers on other machines).
        port: TCP port (0: one the OS picks; see :attr:`port`).
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in [0, 65536), got {port!r}")
        self.host = host
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60), use_libuv=True)
        self.port: int = self.store.port

    @property
    def address(self) -> str:
        """``HOST:PORT`` for workers on this machine (``FGDILOCO_STORE``)."""
        return f"{'localhost' if self.host in ('0.0.0.0', '::', '') else self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving (workers still connected see their next store operation fail)."""
        del self.store


def connect(address: str | None = None, worker: int | None = None, workers: int | None = None, *,
            job: str | None = None, min_workers: int | None = None, timeout: float = 60.0,
            wait: float = 600.0) -> DistributedTransport:
    """Join the elastic job on its gossip store; returns this worker's transport
    (:meth:`DistributedTransport.over_store`; ``FGDiLoCo(elastic=True)`` calls it with its ``timeout``).

    Arguments default to the environment (:func:`settings`). The first workers wait (at most ``wait`` seconds)
    until ``min_workers`` slots (default: all) have joined, so that no one spends round 0 with an empty partner
    slot; a worker that restarts or joins later finds them there and goes on at once.

    Raises:
        ValueError / TypeError: a setting missing or out of range (see :func:`settings`), or a slot count other
            than the job's (the first worker's).
        TimeoutError: the store cannot be reached within ``timeout`` seconds, or the first ``min_workers`` did not
            all join within ``wait`` seconds (the message names the missing slots).
    """
    s = settings(address, worker, workers, job=job, min_workers=min_workers)
    try:
        store = dist.TCPStore(str(s["host"]), int(s["port"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout), use_libuv=True)
    except Exception as e:  # noqa: BLE001 - c10d raises RuntimeError/DistStoreError for every failure to connect
        raise TimeoutError(f"cannot reach the gossip store at {s['host']}:{s['port']} (${STORE_ENV}) within "
                           f"{timeout:g} s: {type(e).__name__}: {e}") from e
    slots_key, mine = f"fgdiloco/{s['job']}/slots", str(s["workers"]).encode()
    agreed = store.compare_set(slots_key, "", mine)  # the first worker of the job sets it
    if agreed != mine:
        raise ValueError(f"workers (${WORKERS_ENV}) is {s['workers']} here but the job {s['job']!r} on this store "
                         f"has {agreed.decode()} slots: every worker of a job must use the same")
    transport = DistributedTransport.over_store(store, int(s["worker"]), int(s["workers"]), namespace=str(s["job"]),
                                                timeout=timeout)
    key = f"{transport.namespace}/incarnation/"
    t0, want = time.monotonic(), int(s["min_workers"])
    while True:
        joined = [r for r in range(int(s["workers"])) if store.add(f"{key}{r}", 0) > 0]
        if len(joined) >= want:
            break
        if time.monotonic() - t0 > wait:
            missing = sorted(set(range(int(s["workers"]))) - set(joined))
            transport.close()
            raise TimeoutError(f"only {len(joined)} of the {want} first workers joined within {wait:g} s "
                               f"(missing slots: {missing[:10]})")
        time.sleep(0.1)
    log.info("fgdiloco: worker %d of %d joined job %r on %s:%d (incarnation %d)", transport.rank,
             transport.world_size, s["job"], s["host"], s["port"], transport.incarnation)
    return transport


def torchrun_command(script: Sequence[str], *, max_restarts: int, monitor_interval: float = 0.5) -> list[str]:
    """The command that runs one worker as its own single-process ``torchrun`` job (``--standalone``: a private
    rendezvous on a free port, so the jobs never meet each other's agents)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1",
            f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval}", *script]


def launch(script: Sequence[str], workers: int, *, max_restarts: int = 3, store: str | None = None,
           slots: int | None = None, first_worker: int = 0, job: str | None = None,
           log_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run ``workers`` workers of ``script`` (``["train.py", "--arg", ...]`` or ``["-m", "pkg.mod", ...]``), each
    as its own ``torchrun`` job with ``max_restarts`` restarts, until every one has ended; returns the number of
    workers that failed for good (0: all finished).

    Args:
        store: ``HOST:PORT`` of a running gossip store (``fgdiloco store``); None: serve one here.
        slots: the job's worker slots (default ``first_worker + workers``); more than are started leaves room for
            workers that join later.
        first_worker: slot of the first worker started here (several machines: give each its own range).
        job: the job's name on the store.
        log_dir: each worker's output goes to ``<log_dir>/worker<k>.log`` (None: the terminal).
        env: extra environment for the workers (``OMP_NUM_THREADS`` defaults to 1).

    Raises:
        ValueError: an argument out of range (named), or a script that is not a file.
    """
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
    served = GossipStore() if store is None else None
    address = served.address if served is not None else store
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")
    base.update(env or {})
    base.update({STORE_ENV: address, WORKERS_ENV: str(slots)})
    if store is None:  # the workers started here are the first ones (slots beyond them are for later joiners)
        base.setdefault(MIN_WORKERS_ENV, str(first_worker + workers))
    if job is not None:
        base[JOB_ENV] = job
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    print(f"[fgdiloco] launch: workers {first_worker}..{first_worker + workers - 1} of {slots} slots on the gossip "
          f"store {address}, each its own torchrun job (max {max_restarts} restarts)"
          + (f"; their output goes to {logs}/worker<k>.log" if logs is not None else ""), file=sys.stderr, flush=True)
    procs: list[subprocess.Popen[bytes]] = []
    files = []
    try:
        for k in range(first_worker, first_worker + workers):
            out = open(logs / f"worker{k}.log", "ab") if logs is not None else None  # noqa: SIM115 - closed below
            files.append(out)
            procs.append(subprocess.Popen(torchrun_command(script, max_restarts=max_restarts),
                                          env={**base, WORKER_ENV: str(k)}, stdout=out,
                                          stderr=subprocess.STDOUT if out is not None else None))
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:  # the terminal sent SIGINT to the whole group; make sure every agent hears it
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    finally:
        for f in files:
            if f is not None:
                f.close()
        if served is not None:
            served.close()
    failed = [first_worker + i for i, c in enumerate(codes) if c != 0]
    print(f"[fgdiloco] launch: {workers - len(failed)} of {workers} workers finished"
          + (f"; workers {failed} failed for good (after {max_restarts} restarts each)" if failed else ""),
          file=sys.stderr, flush=True)
    return len(failed)
