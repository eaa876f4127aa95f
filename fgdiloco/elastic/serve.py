"""The child process of :class:`fgdiloco.elastic.SupervisedStore`: ``python -m fgdiloco.elastic.serve --host H
--port P --parent PID`` serves a gossip store, prints ``port N`` once it does (or ``error ...``), and exits when its
parent is gone or on SIGTERM.

With ``--standby`` it is the supervisor's hot standby: it imports everything a store needs (``torch.distributed``:
seconds of CPU on a busy machine, the most of a cold restart), prints ``standby`` and waits for ``serve`` on its
standard input, then takes the port over (retrying while the dead store's socket is released) and serves as above.
End of input (its supervisor is gone) ends it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from .store import GossipStore

#: How long a standby retries binding the port of the store it replaces (seconds).
TAKEOVER_SECONDS = 5.0


def _bind(host: str, port: int, retry: float) -> GossipStore:
    t_end = time.monotonic() + retry
    while True:
        try:
            return GossipStore(host, port)
        except Exception:  # noqa: BLE001 - the port may be held a moment after the old store's death
            if time.monotonic() >= t_end:
                raise
            time.sleep(0.05)


def _serve(host: str, port: int, parent: int, standby: bool) -> int:
    if standby:
        print("standby", flush=True)
        if not sys.stdin.readline().startswith("serve"):  # end of input: the supervisor is gone
            return 0
    try:
        store = _bind(host, port, TAKEOVER_SECONDS if standby else 0.0)
    except Exception as err:  # noqa: BLE001 - reported to the supervisor on stdout
        print(f"error {type(err).__name__}: {err}", flush=True)
        return 1
    print(f"port {store.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the supervisor, which stops this
    while not stop.wait(0.5):
        if os.getppid() != parent:  # the supervisor is gone: so is the job
            break
    store.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--standby", action="store_true", help="wait for 'serve' on stdin, then take the port over")
    a = p.parse_args()
    if a.standby:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _serve(a.host, a.port, a.parent, a.standby)


if __name__ == "__main__":
    sys.exit(main())
