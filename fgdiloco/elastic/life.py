"""One life of an elastic worker, as ``fgdiloco launch`` starts it: ``torchrun ... -m fgdiloco.elastic.life SCRIPT
ARGS`` (or ``-m MODULE ARGS``).

Before anything else (so a life that dies while importing torch counts too) it appends one line to
``$FGDILOCO_LIVES_FILE``: every life torchrun started is counted, and ``fgdiloco launch`` reports the restarts.
Then it runs the worker's script as ``__main__``. A worker that must stop for good says so instead of failing, so
that torchrun does not restart it for nothing: :class:`~fgdiloco.elastic.StoreUnreachable` (the gossip store has
been out of reach for ``store_timeout``, or could not be reached at all at start),
:class:`~fgdiloco.elastic.SlotTaken` and :class:`~fgdiloco.elastic.AdmissionError` (another slot count, model or
job secret than the job's) end the life
with exit status 0 after one line on stderr and one ``stop`` line in the lives file, which ``fgdiloco launch`` turns
into its own non-zero exit and message.

A life whose script has returned leaves without interpreter teardown: it waits for the script's non-daemon threads,
runs the exit handlers (fgdiloco's exit drain among them: wrappers not closed are closed, exchanges still running
get their deadline), collects garbage (files still open are closed), flushes its output and calls ``os._exit(0)``.
Teardown with a daemon thread still inside Gloo or c10d (a pair group given up on, forsaken until its own timeout,
or a thread of the library's own) aborted the process ("terminate called without an active exception", exit -6),
and torchrun restarted a worker that had finished: seen in CI with a forsaken set-up that the exit drain no longer
counted.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import runpy
import sys
import threading
import time

LIVES_ENV = "FGDILOCO_LIVES_FILE"  # as fgdiloco.elastic.launch sets it (this module is not imported by the package)


def note(record: dict) -> None:
    """Append ``record`` to this worker's lives file (``$FGDILOCO_LIVES_FILE``); nothing without one."""
    path = os.environ.get(LIVES_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _run(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m fgdiloco.elastic.life SCRIPT [ARGS] | -m MODULE [ARGS]")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    note({"event": "start", "time": time.time(), "pid": os.getpid(),
           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
    try:
        _run(sys.argv[1:])
    except SystemExit as done:  # the script's own sys.exit(): a success leaves as a return does
        if done.code not in (None, 0):
            raise
    except Exception as err:
        from . import AdmissionError, SlotTaken, StoreNotReached, StoreUnreachable

        if not isinstance(err, (StoreUnreachable, SlotTaken, AdmissionError)):
            raise
        kind = next(name for cls, name in ((StoreUnreachable, "store"), (SlotTaken, "slot"),
                                           (AdmissionError, "refused")) if isinstance(err, cls))
        print(f"[fgdiloco] worker stopped: {err}", file=sys.stderr, flush=True)
        # "reached": false for a store this life never reached (a wrong address, a store not started)
        note({"event": "stop", "kind": kind, "reason": str(err), "reached": not isinstance(err, StoreNotReached),
               "time": time.time()})
    _leave_without_teardown()
    return 0


def _leave_without_teardown() -> None:
    """End the process as teardown would, without teardown (see the module's docstring): non-daemon threads joined,
    exit handlers run, garbage collected, output flushed, then ``os._exit(0)``."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # CPython's own exit-handler runner (what teardown calls first)
    gc.collect()
    left = [t.name for t in threading.enumerate() if t.daemon and t.name.startswith("fgdiloco-")]
    if left:
        print(f"[fgdiloco] worker done; {len(left)} gossip thread(s) still running ({', '.join(sorted(left)[:3])}) "
              "are left to the exit", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
