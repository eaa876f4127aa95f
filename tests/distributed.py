"""Run a function on M real ``torch.distributed`` Gloo ranks: fork + FileStore (PLATFORM.md: 8 ranks in 0.2 s).

``run_ranks(fn, world_size, tmp_path, *args)`` forks ``world_size`` children; child ``r`` initialises a Gloo
process group on a FileStore, calls ``fn(rank, world_size, *args)`` and sends its (picklable) return value back
through a pipe. The parent returns the list of results indexed by rank; a child that raised re-raises here with
its traceback, a child that died (``os._exit``) or is still running after ``timeout`` seconds gives ``None``
(``allow_missing``) or fails the test.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


def _child(fn: Callable[..., Any], rank: int, world: int, store_path: str, wfd: int, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        out = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - sent to the parent
        out = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    data = pickle.dumps(out)
    with os.fdopen(wfd, "wb") as w:
        w.write(data)
    os._exit(code)  # no atexit, no process-group teardown that could wait on dead peers


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Any, *args: Any, timeout: float = 120.0,
              allow_missing: Iterable[int] = ()) -> list[Any]:
    store = os.path.join(str(tmp_path), f"store-{time.monotonic_ns()}")
    children = []
    for rank in range(world_size):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(fn, rank, world_size, store, w, args)
        os.close(w)
        children.append((pid, r))
    results: list[Any] = [None] * world_size
    deadline = time.monotonic() + timeout
    allow = set(allow_missing)
    errors = []
    for rank, (pid, r) in enumerate(children):
        chunks = []
        with os.fdopen(r, "rb") as f:
            os.set_blocking(f.fileno(), False)
            while True:
                try:
                    chunk = f.read()
                except BlockingIOError:
                    chunk = None
                if chunk:
                    chunks.append(chunk)
                    continue
                if chunk == b"":
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        data = b"".join(chunks)
        if data:
            status, value = pickle.loads(data)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
        elif rank not in allow:
            errors.append(f"rank {rank} returned nothing (died or timed out)")
    for pid, _ in children:  # reap; kill stragglers (hung or stopped ranks)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    if errors:
        raise AssertionError("\n".join(errors))
    return results
