"""A harness for multi-process tests and benchmarks: run a function on M real ``torch.distributed`` Gloo ranks.

Fork + FileStore starts 8 ranks in about 0.2 s on CPU (spawning them takes 6-7 s: every child re-imports torch), so
tests of real process groups stay fast. Shared by the test suite and the benchmarks (and usable for tests of your
own code around :class:`fgdiloco.FGDiLoCo`).

``run_ranks(fn, world_size, tmp_path, *args)`` forks ``world_size`` children; child ``r`` initialises a Gloo
process group on a FileStore, calls ``fn(rank, world_size, *args)`` and sends its (picklable) return value back
through a pipe. The parent returns the list of results indexed by rank; a child that raised re-raises here with
its traceback, a child that died (``os._exit``) or is still running after ``timeout`` seconds gives ``None``
(``allow_missing``) or fails the test. ``store="tcp"`` uses a TCPStore hosted by rank 0 instead of a FileStore;
rank 0's process then stays alive, serving the store, until every rank has answered or timed out (as torchrun's
agent store outlives the workers), so a rank still finishing never talks to a dead store.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "run_workers_on_store"]


def _init(rank: int, world: int, store_path: str, store: str) -> None:
    if store == "none":  # no process group (elastic workers meet on a gossip store of their own)
        return
    if store == "file":
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    else:
        _init_on_tcp_store(rank, world, store_path)
    # Gloo's mesh is up on every rank before any rank's function runs: a rank whose function returns at once (and
    # exits) while another is still in init_process_group's connectFullMesh failed that one's set-up ("connection
    # closed by peer"; tests/test_launch.py's non-member rank, 1 run in 6)
    dist.barrier()


def _init_on_tcp_store(rank: int, world: int, store_path: str) -> None:
    # TCPStore hosted by rank 0 (port 0: the OS picks a free one, published through a file). Used by fault tests:
    # a SIGSTOPped rank could freeze while holding a FileStore's file lock; a TCPStore client holds no lock.
    port_file = store_path + ".port"
    if rank == 0:
        tcp = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(tcp.port))
        os.replace(port_file + ".tmp", port_file)
    else:
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 did not publish its TCPStore port")
            time.sleep(0.005)
        with open(port_file) as f:
            tcp = dist.TCPStore("127.0.0.1", int(f.read()), world, is_master=False)
    dist.init_process_group("gloo", store=tcp, rank=rank, world_size=world)


def _child(fn: Callable[..., Any], rank: int, world: int, store_path: str, store: str, wfd: int,
           args: tuple, release: int | None = None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    code = 0
    try:
        _init(rank, world, store_path, store)
        out = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - sent to the parent
        out = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    data = pickle.dumps(out)
    with os.fdopen(wfd, "wb") as w:
        w.write(data)
    if release is not None:  # the TCPStore's host outlives every other rank (as torchrun's agent store does): a
        os.read(release, 1)  # rank still finishing its last round under load hung on the dead store till the timeout
    os._exit(code)  # no atexit, no process-group teardown that could wait on dead peers


def _fork_ranks(fn: Callable[..., Any], world_size: int, store_path: str, store: str,
                args: tuple) -> tuple[list[tuple[int, int]], int | None]:
    """Fork one child per rank; ``([(pid, read end of its result pipe)], write end of rank 0's release pipe)``.
    With ``store="tcp"`` rank 0 hosts the store: it exits only when the release pipe's write end closes (EOF)."""
    children = []
    release_r, release_w = os.pipe() if store == "tcp" else (None, None)
    for rank in range(world_size):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            for fd in [release_w] + ([release_r] if rank != 0 else []):
                if fd is not None:
                    os.close(fd)
            _child(fn, rank, world_size, store_path, store, w, args, release_r if rank == 0 else None)
        os.close(w)
        children.append((pid, r))
    if release_r is not None:
        os.close(release_r)
    return children, release_w


def _collect(children: list[tuple[int, int]], allow: set[int], timeout: float) -> dict[int, list[bytes]]:
    """What each rank wrote to its result pipe, until every required rank has answered (then optional ranks get a
    1 s grace period) or ``timeout`` passes."""
    buffers: dict[int, list[bytes]] = {rank: [] for rank in range(len(children))}
    open_fds = {r: rank for rank, (_, r) in enumerate(children)}
    deadline = time.monotonic() + timeout
    grace_end = None
    while open_fds and time.monotonic() < deadline and (grace_end is None or time.monotonic() < grace_end):
        ready, _, _ = select.select(list(open_fds), [], [], 0.05)
        for fd in ready:
            chunk = os.read(fd, 1 << 20)
            if chunk:
                buffers[open_fds[fd]].append(chunk)
            else:
                os.close(fd)
                del open_fds[fd]
        if grace_end is None and all(rank in allow for rank in open_fds.values()):
            grace_end = time.monotonic() + 1.0
    for fd in open_fds:
        os.close(fd)
    return buffers


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Any, *args: Any, timeout: float = 120.0,
              allow_missing: Iterable[int] = (), store: str = "file") -> list[Any]:
    store_path = os.path.join(str(tmp_path), f"store-{time.monotonic_ns()}")
    children, release_w = _fork_ranks(fn, world_size, store_path, store, args)
    results: list[Any] = [None] * world_size
    allow = set(allow_missing)
    buffers = _collect(children, allow, timeout)
    if release_w is not None:
        os.close(release_w)  # every rank has answered or timed out: the store's host may go
    errors = []
    for rank in range(world_size):
        data = b"".join(buffers[rank])
        if data:
            status, value = pickle.loads(data)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
        elif rank not in allow:
            errors.append(f"rank {rank} returned nothing (died or timed out)")
    for pid, _ in children:  # reap; kill stragglers (hung or stopped ranks)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def _serve_store(port_file: str) -> None:
    """Child: serve a TCPStore (no worker hosts it) until killed; its port is published through ``port_file``."""
    try:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(server.port))
        os.replace(port_file + ".tmp", port_file)
        signal.pause()
    finally:
        os._exit(0)


def run_workers_on_store(fn: Callable[..., Any], workers: int, tmp_path: Any, *args: Any,
                         timeout: float = 120.0) -> list[Any]:
    """Like :func:`run_ranks` without a process group: a forked child serves a gossip store (a TCPStore no worker
    hosts, as ``fgdiloco store`` does) and worker ``k`` calls ``fn(k, workers, "127.0.0.1:PORT", *args)``."""
    port_file = os.path.join(str(tmp_path), f"gossip-store-{time.monotonic_ns()}.port")  # before any store here
    pid = os.fork()
    if pid == 0:
        _serve_store(port_file)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file):
            if time.monotonic() > deadline:
                raise TimeoutError("the gossip store child did not publish its port")
            time.sleep(0.005)
        with open(port_file) as f:
            address = f"127.0.0.1:{int(f.read())}"
        return run_ranks(fn, workers, tmp_path, address, *args, timeout=timeout, store="none")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
