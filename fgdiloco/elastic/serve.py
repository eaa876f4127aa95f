"""The child process of :class:`fgdiloco.elastic.SupervisedStore`: ``python -m fgdiloco.elastic.serve --host H
--port P --parent PID`` serves a gossip store, prints ``port N`` once it does (or ``error ...``), and exits when its
parent is gone or on SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from .store import GossipStore


def _serve(host: str, port: int, parent: int) -> int:
    try:
        store = GossipStore(host, port)
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
    a = p.parse_args()
    return _serve(a.host, a.port, a.parent)


if __name__ == "__main__":
    sys.exit(main())
