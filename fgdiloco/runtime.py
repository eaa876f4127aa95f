"""The one owner of fgdiloco's background threads, deadlines and process exit.

Every thread fgdiloco starts is started in this module:

* :class:`Background`: one job in a daemon thread (a pairwise exchange, a whole Mix1, a pair group's set-up);
  :meth:`Background.result` waits for it with a deadline.
* :class:`Service`: a long-lived loop run every ``period`` seconds until stopped (the membership's heartbeat).

One pairwise exchange is watched by **one** loop, :func:`supervise`: until the peer's first payload it waits at
most the join deadline, once the first payload came at most the exchange deadline, and throughout it polls a
``watch`` callback (is the peer gone, has it moved on?) every :data:`WATCH_SECONDS`. The thread doing the
exchange itself only blocks on the network (Gloo's own timeout is the same deadline), never polls.

Process exit. A daemon thread still inside a Gloo call when the interpreter exits aborts the process ("terminate
called without an active exception"), so at exit every object registered with :func:`on_exit` is closed and every
:class:`Background` still running is waited for (at most the longest deadline registered, :func:`drain_background`).
On SIGTERM (torchrun's agent, a scheduler, ``kill``) the callbacks registered with :func:`on_sigterm` run first (each
at most 1 s: a worker posts its departure notice so its peers stop waiting at once), then the handler that was
there before.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Background", "Service", "ExchangeError", "WATCH_SECONDS", "call_with_deadline", "drain_background",
           "running_background", "supervise", "on_exit", "on_sigterm", "exit_wait"]

log = logging.getLogger("fgdiloco")
T = TypeVar("T")

#: Seconds between two checks of a peer's liveness while waiting for its first payload.
WATCH_SECONDS = 0.25


class ExchangeError(RuntimeError):
    """An exchange with a peer failed or timed out; the caller keeps its own value for that round."""


_RUNNING: set[Background] = set()
_RUNNING_LOCK = threading.Lock()


def running_background() -> list[str]:
    """What each :class:`Background` still running is doing (its ``what``)."""
    with _RUNNING_LOCK:
        return [job.what for job in _RUNNING]


def drain_background(limit: float) -> list[str]:
    """Wait (at most ``limit`` seconds in all) for every :class:`Background` still running, one started meanwhile
    included (e.g. an exchange given up on whose thread is still inside Gloo until its own timeout). Returns what
    is still running."""
    t_end = time.monotonic() + limit
    while True:
        with _RUNNING_LOCK:
            running = list(_RUNNING)
        left = t_end - time.monotonic()
        if not running or left <= 0:
            return [job.what for job in running]
        running[0].wait(min(left, 0.5))


class Background:
    """``fn()`` running in a daemon thread (a gossip exchange, a whole mix, a pair group's set-up).

    :meth:`result` waits for it (at most ``timeout`` seconds when given) and returns its value or re-raises its
    exception. A thread left behind by a timeout ends when its own network deadline fires.
    """

    def __init__(self, fn: Callable[[], Any], what: str):
        self.what = what
        self._box: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"fgdiloco-{what}", daemon=True)
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._box["error"] = e
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(self)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for ``fn`` to end; True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> Any:
        """The value of ``fn()``; raises its exception, or :class:`ExchangeError` when ``timeout`` passes first."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ExchangeError(f"{self.what} timed out after {timeout:.1f} s")
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]

    def forsake(self) -> None:
        """Stop counting this job as running: the exit drain does not wait for it (a Gloo call that will not end
        by its deadline; its daemon thread is left to the process's exit)."""
        with _RUNNING_LOCK:
            _RUNNING.discard(self)

    def settle(self) -> None:
        """Wait for ``fn`` to end and drop whatever it returned or raised (a job whose result is not used)."""
        with contextlib.suppress(Exception):
            self.result()


def call_with_deadline(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Run ``fn`` in a daemon thread and return its result, or raise :class:`ExchangeError` after ``timeout`` s
    (or, wrapped, whatever ``fn`` raised)."""
    try:
        return Background(fn, what).result(timeout)
    except ExchangeError:
        raise
    except BaseException as err:  # noqa: BLE001 - every failure of an exchange is an ExchangeError
        raise ExchangeError(f"{what} failed: {type(err).__name__}: {err}") from err


def supervise(job: Background, *, join_deadline: float, exchange_deadline: float, met: list[float],
              watch: Callable[[float, bool], None], what: str) -> Any:
    """Wait for the exchange running in ``job``: the one supervision loop of an exchange.

    Until the peer's first payload (``met`` is empty; the exchange appends the time it came) the wait is at most
    ``join_deadline`` seconds; after it, at most ``exchange_deadline`` seconds from that payload. Throughout,
    ``watch(t0, talking)`` is called every :data:`WATCH_SECONDS` (``talking``: the first payload has come); it
    raises when the peer will not come or will not finish: it left, its heartbeat stopped (a peer hung or killed
    in the middle of a conversation costs the liveness check, not the whole deadline), it moved on. Returns
    ``job``'s value.

    Raises:
        ExchangeError: the deadline passed, ``watch`` raised one, or ``job`` failed (wrapped).
    """
    t0 = time.monotonic()
    while True:
        limit = met[0] + exchange_deadline if met else t0 + join_deadline
        now = time.monotonic()
        if now >= limit:
            raise ExchangeError(f"{what} timed out after {now - t0:.1f} s"
                                + (f" ({exchange_deadline:.1f} s deadline after the first payload)" if met else ""))
        if job.wait(min(limit - now, WATCH_SECONDS)):
            break
        watch(t0, bool(met))
    try:
        return job.result()
    except ExchangeError:
        raise
    except BaseException as err:  # noqa: BLE001 - every failure of an exchange is an ExchangeError
        raise ExchangeError(f"{what} failed: {type(err).__name__}: {err}") from err


class Service:
    """``step()`` called every ``period`` seconds in a daemon thread until :meth:`stop` (a membership's heartbeat).
    An exception in ``step`` is logged at DEBUG and the loop goes on (a store that is slow or gone: the next beat
    tries again)."""

    def __init__(self, step: Callable[[], None], period: float, name: str):
        self._step = step
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"fgdiloco-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._step()
            except Exception as err:  # noqa: BLE001 - retried at the next period
                log.debug("fgdiloco %s: %s", self._thread.name, err)

    def stop(self, wait: float = 5.0) -> None:
        """Stop the loop and wait (at most ``wait`` s) for a step in progress to end."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._period + wait)


# ---------------------------------------------------------------------------------------------------- exit
_EXIT: weakref.WeakSet[Any] = weakref.WeakSet()  # objects whose close() runs at interpreter exit
_SIGTERM: weakref.WeakSet[Any] = weakref.WeakSet()  # objects whose leave() runs on SIGTERM
_EXIT_WAIT = [0.0]  # the longest deadline of anything registered: the most a given-up exchange can still run
_SIGTERM_PREVIOUS: list[Any] = []  # the handler ours replaced (installed once per process)


def exit_wait() -> float:
    """The longest an exchange given up on may still run (seconds): what the exit drain waits at most."""
    return _EXIT_WAIT[0]


def on_exit(obj: Any, wait: float) -> None:
    """Close ``obj`` (its ``close()``) at interpreter exit, then let exchanges still running end, each within its
    deadline (``wait``: the longest deadline ``obj`` uses). Held weakly."""
    _EXIT.add(obj)
    _EXIT_WAIT[0] = max(_EXIT_WAIT[0], wait)


def forget(obj: Any) -> None:
    """Undo :func:`on_exit` and :func:`on_sigterm` for ``obj`` (it was closed)."""
    _EXIT.discard(obj)
    _SIGTERM.discard(obj)


@atexit.register
def _drain_at_exit() -> None:
    limit = _EXIT_WAIT[0]
    for obj in list(_EXIT):
        with contextlib.suppress(Exception):
            obj.close()
    if limit:
        waiting = running_background()
        if waiting:
            log.warning("fgdiloco: waiting (at most %.0f s) for %d exchange(s) to end before exit: %s", limit,
                        len(waiting), ", ".join(waiting[:5]))
        left = drain_background(limit)
        if left:
            log.warning("fgdiloco: exiting with exchanges still running: %s", ", ".join(left[:5]))


def _leave_on_sigterm(signum: int, frame: Any) -> None:
    for obj in list(_SIGTERM):
        with contextlib.suppress(Exception):
            call_with_deadline(obj.leave, 1.0, "departure notice")
    previous = _SIGTERM_PREVIOUS[0]
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def on_sigterm(obj: Any) -> None:
    """On SIGTERM, call ``obj.leave()`` (at most 1 s) before the handler that was installed before ours (installed
    once, from the main thread only: signal handlers cannot be set elsewhere; an ignored SIGTERM stays ignored).
    Held weakly."""
    _SIGTERM.add(obj)
    if _SIGTERM_PREVIOUS or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None):
        return
    _SIGTERM_PREVIOUS.append(previous)
    signal.signal(signal.SIGTERM, _leave_on_sigterm)
