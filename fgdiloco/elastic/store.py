"""The gossip store of an elastic job: a ``TCPStore`` served by a process that is not a worker.

:class:`GossipStore` serves it in this process (tests, tools). :class:`SupervisedStore` serves it in a child process
and replaces it on the same port when it dies (a hot standby takes over within a tenth of a second): the store holds
only *soft state* (heartbeats, published rounds, slot owners, exchanges in flight) that the workers re-publish when
they reconnect
(:class:`~fgdiloco.elastic.ElasticMembership`), so a restarted store costs them a few skipped exchanges, not their
job. ``fgdiloco store``, ``fgdiloco launch`` and ``fgdiloco pretrain`` use the supervised one. The child exits with
its supervisor: a store never outlives its job (and its workers stop once it has been unreachable for
``store_timeout`` seconds).

The child is ``python -m fgdiloco.elastic.serve --host H --port P --listen-fd FD --parent PID``: it serves on the
listening socket FD its supervisor bound, prints ``port N`` once it does, and exits when its parent is gone or on
SIGTERM; a second child with ``--standby`` waits beside it, ready to serve on the same socket
(:mod:`fgdiloco.elastic.serve`).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from ..runtime import Service

__all__ = ["GossipStore", "SupervisedStore"]

log = logging.getLogger("fgdiloco")


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in [0, 65536), got {port!r}")
    return port


#: Whether TCPStore's libuv backend serves on a socket it is given (``master_listen_fd``): torch 2.8 and later
#: (pytorch/pytorch#150215). Older versions serve a given socket with the classic backend.
_LIBUV_TAKES_A_SOCKET = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 8)


#: Hosts that mean every interface.
_ANY_HOST = ("", "0.0.0.0", "::")


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``: every interface (IPv6 and IPv4 where the host has both) for
    :data:`_ANY_HOST`, else the first address ``host`` resolves to. Raises OSError (the port is taken, the host is
    not this machine's)."""
    if host in _ANY_HOST:
        if socket.has_dualstack_ipv6():
            try:
                return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=4096)
            except OSError:  # IPv6 present but not usable here: IPv4 only
                pass
        return socket.create_server(("", port), backlog=4096)
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address, family=family, backlog=4096)


def _address(host: str, port: int) -> str:
    return f"{'localhost' if host in _ANY_HOST else host}:{port}"


class GossipStore:
    """The job's gossip store: a ``torch.distributed.TCPStore`` served by this process, which is not a worker,
    so no worker's death takes it down.

    Args:
        host: the address the workers are told (``"0.0.0.0"``: all interfaces, told as ``localhost``). TCPStore
            listens on every interface whatever the host.
        port: TCP port (0: one the OS picks; see :attr:`port`).
        listen_fd: serve on this listening socket instead of binding ``port`` (its port; :class:`SupervisedStore`
            binds it once and hands it to every child that serves).
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0, listen_fd: int | None = None):
        self.host = host
        self.store = dist.TCPStore(host, _check_port(port), is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60), master_listen_fd=listen_fd,
                                   use_libuv=listen_fd is None or _LIBUV_TAKES_A_SOCKET)
        self.port: int = self.store.port

    @property
    def address(self) -> str:
        """``HOST:PORT`` for workers on this machine (``FGDILOCO_STORE``)."""
        return _address(self.host, self.port)

    def close(self) -> None:
        """Stop serving (workers still connected see their next store operation fail)."""
        del self.store


class SupervisedStore:
    """A gossip store served by a child process that is replaced on the same port when it dies.

    This process binds the port once and keeps the listening socket for the store's whole life; every child that
    serves is handed that socket, so the address is known at once (workers can start while the first child is
    still importing ``torch.distributed``: :meth:`ready` waits for it), and a replacement never waits for a dead
    child's port to be released (a connection made meanwhile waits in the socket's queue instead of being refused).

    A *hot standby* waits beside the serving child: a second child that has already imported what a store needs and
    takes over the moment the first one is found dead (checked every :data:`WATCH_SECONDS`); a new standby is then
    started in the background. A cold restart imports ``torch.distributed`` first, which took 6-10 s on the 2-core
    machine under a chaos job's load (its workers trained without gossip meanwhile); a standby's takeover takes
    about a tenth of a second. Without a live standby (it died too) the store is restarted cold.

    Args:
        host: the interface to listen on (``"0.0.0.0"``: every one, told to the workers as ``localhost``).
        port: TCP port (0: one the OS picks; see :attr:`port`).

    Attributes:
        restarts: how many times the store was replaced.

    Raises:
        ValueError: ``port`` out of range.
        RuntimeError: the port is taken or ``host`` is not this machine's (:meth:`ready`: the first child could
            not serve; the message has its output).
    """

    #: Seconds between two looks at the serving child.
    WATCH_SECONDS = 0.1

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        self.host = host
        try:
            self._socket = _listen(host, _check_port(port))
        except OSError as err:
            # create_server's own text names its address tuple; a resolver error has a negative errno
            why = os.strerror(err.errno) if err.errno and err.errno > 0 else (err.strerror or str(err))
            raise RuntimeError(f"the gossip store cannot listen on {host or '0.0.0.0'}:{port}: {why}") from None
        self.port: int = self._socket.getsockname()[1]
        self.restarts = 0
        self._closing = False
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._failure: RuntimeError | None = None
        self._child = self._spawn(standby=False)
        self._standby: subprocess.Popen[str] | None = None
        self._monitor = Service(self._watch, self.WATCH_SECONDS, "store-supervisor")

    def ready(self, wait: float = 120.0) -> None:
        """Wait (at most ``wait`` seconds) until the first child serves.

        Raises:
            RuntimeError: it could not serve (its output), or it did not within ``wait``.
        """
        if not self._started.wait(wait):
            raise RuntimeError(f"the gossip store on {self.address} did not start within {wait:.0f} s")
        if self._failure is not None:
            raise self._failure

    def _spawn(self, *, standby: bool) -> subprocess.Popen[str]:
        fd = self._socket.fileno()
        cmd = [sys.executable, "-m", "fgdiloco.elastic.serve", "--host", self.host, "--port", str(self.port),
               "--listen-fd", str(fd), "--parent", str(os.getpid()), *(["--standby"] if standby else [])]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE if standby else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True, pass_fds=(fd,))

    def _serving(self, child: subprocess.Popen[str]) -> subprocess.Popen[str]:
        """Wait for ``child``'s ``port N`` (a standby's ``standby`` line first) and return it; raise RuntimeError
        with what it said instead."""
        line = ""
        while child.stdout is not None:
            line = child.stdout.readline()
            if line != "standby\n":
                break
        if not line.startswith("port "):
            child.kill()
            child.wait()
            raise RuntimeError(f"the gossip store could not serve on {self.address}: {line.strip() or 'it died'}")
        return child

    def _first(self) -> None:
        """The first look: wait (outside the lock, so :meth:`close` can end a child that hangs) for the first
        child to serve, then start the standby."""
        try:
            self._serving(self._child)
        except RuntimeError as err:
            self._failure = err
        with self._lock:
            if not self._closing and self._failure is None:
                self._standby = self._spawn(standby=True)
        self._started.set()

    def _take_over(self) -> subprocess.Popen[str] | None:
        """The standby serves now (None: there was none alive, or it could not)."""
        standby, self._standby = self._standby, None
        if standby is None or standby.poll() is not None or standby.stdin is None:
            return None
        try:
            standby.stdin.write("serve\n")
            standby.stdin.flush()
            return self._serving(standby)
        except (OSError, RuntimeError) as err:
            log.warning("fgdiloco: the gossip store's standby could not take over: %s", err)
            return None

    def _cold_start(self) -> subprocess.Popen[str] | None:
        for attempt in range(3):  # the socket is ours: only a child that fails to start can fail
            try:
                return self._serving(self._spawn(standby=False))
            except RuntimeError as err:
                if attempt == 2:
                    log.error("fgdiloco: could not restart the gossip store on port %d: %s", self.port, err)
        return None

    def _watch(self) -> None:
        if not self._started.is_set():
            self._first()
            return
        with self._lock:
            if self._closing or self._failure is not None or self._child.poll() is None:
                return
            code = self._child.returncode
            child = self._take_over()
            warm = child is not None
            child = child or self._cold_start()
            if child is None:
                return
            self._child = child
            self._standby = self._spawn(standby=True)
            self.restarts += 1
        how = "its standby took over" if warm else "cold: no standby was ready"
        print(f"[fgdiloco] the gossip store on {self.address} died (exit {code}) and was restarted ({how}; "
              f"{self.restarts} restart(s)); the workers reconnect and re-publish their state", file=sys.stderr,
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
        """Stop serving and stop replacing (the standby ends too)."""
        with self._lock:
            self._closing = True
            children = [c for c in (self._standby, self._child) if c is not None and c.poll() is None]
            for child in children:  # both at once: each takes up to half a second to see it
                child.terminate()
            for child in children:
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
        self._monitor.stop()
        self._socket.close()
