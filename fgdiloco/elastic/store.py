"""The gossip store of an elastic job: a ``TCPStore`` served by a process that is not a worker.

:class:`GossipStore` serves it in this process (tests, tools). :class:`SupervisedStore` serves it in a child process
and restarts it on the same port when it dies: the store holds only *soft state* (heartbeats, published rounds,
slot owners, exchanges in flight) that the workers re-publish when they reconnect
(:class:`~fgdiloco.elastic.ElasticMembership`), so a restarted store costs them a few skipped exchanges, not their
job. ``fgdiloco store``, ``fgdiloco launch`` and ``fgdiloco pretrain`` use the supervised one. The child exits with
its supervisor: a store never outlives its job (and its workers stop once it has been unreachable for
``store_timeout`` seconds).

The child is ``python -m fgdiloco.elastic.serve --host H --port P --parent PID``: it prints ``port N`` once it serves,
and exits when its parent is gone or on SIGTERM.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from ..runtime import Service

__all__ = ["GossipStore", "SupervisedStore"]

log = logging.getLogger("fgdiloco")


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in [0, 65536), got {port!r}")
    return port


def _address(host: str, port: int) -> str:
    return f"{'localhost' if host in ('0.0.0.0', '::', '') else host}:{port}"


class GossipStore:
    """The job's gossip store: a ``torch.distributed.TCPStore`` served by this process, which is not a worker,
    so no worker's death takes it down.

    Args:
        host: interface to listen on (``"0.0.0.0"``: all, for workers on other machines).
        port: TCP port (0: one the OS picks; see :attr:`port`).
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        self.host = host
        self.store = dist.TCPStore(host, _check_port(port), is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60), use_libuv=True)
        self.port: int = self.store.port

    @property
    def address(self) -> str:
        """``HOST:PORT`` for workers on this machine (``FGDILOCO_STORE``)."""
        return _address(self.host, self.port)

    def close(self) -> None:
        """Stop serving (workers still connected see their next store operation fail)."""
        del self.store


class SupervisedStore:
    """A gossip store served by a child process that is restarted on the same port when it dies.

    Args:
        host, port: as :class:`GossipStore` (port 0: the first child picks one; its restarts keep it).

    Attributes:
        restarts: how many times the store was restarted.

    Raises:
        ValueError: ``port`` out of range.
        RuntimeError: the first child could not serve (the message has its output).
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        self.host = host
        self.port = _check_port(port)
        self.restarts = 0
        self._closing = False
        self._lock = threading.Lock()
        self._child = self._start(self.port)
        self._monitor = Service(self._watch, 0.5, "store-supervisor")

    def _start(self, port: int) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "fgdiloco.elastic.serve", "--host", self.host, "--port", str(port),
               "--parent", str(os.getpid())]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 start_new_session=True)
        line = child.stdout.readline() if child.stdout else ""  # "port N", or "error ..." and the end
        if not line.startswith("port "):
            child.wait()
            raise RuntimeError(f"the gossip store could not serve on {self.host}:{port}: {line.strip() or 'it died'}")
        self.port = int(line.split()[1])
        return child

    def _watch(self) -> None:
        with self._lock:
            if self._closing or self._child.poll() is None:
                return
            code = self._child.returncode
            for attempt in range(20):  # the port may be held a moment after the death
                try:
                    self._child = self._start(self.port)
                    break
                except RuntimeError as err:
                    if attempt == 19:
                        log.error("fgdiloco: could not restart the gossip store on port %d: %s", self.port, err)
                        return
                    time.sleep(0.25)
            self.restarts += 1
        print(f"[fgdiloco] the gossip store on {self.address} died (exit {code}) and was restarted "
              f"({self.restarts} restart(s)); the workers reconnect and re-publish their state", file=sys.stderr,
              flush=True)

    @property
    def address(self) -> str:
        """``HOST:PORT`` for workers on this machine (``FGDILOCO_STORE``)."""
        return _address(self.host, self.port)

    @property
    def pid(self) -> int:
        """The process that serves the store now."""
        return self._child.pid

    def close(self) -> None:
        """Stop serving and stop restarting."""
        with self._lock:
            self._closing = True
            if self._child.poll() is None:
                self._child.terminate()
                try:
                    self._child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._child.kill()
        self._monitor.stop()
