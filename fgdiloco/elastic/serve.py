"""The child process of :class:`fgdiloco.elastic.SupervisedStore`: ``python -m fgdiloco.elastic.serve --host H
--port P --listen-fd FD --parent PID`` serves a gossip store on the listening socket FD (port P) that its supervisor
bound and handed down, prints ``port N`` once it does (or ``error ...``), and exits when its parent is gone or on
SIGTERM.

With ``--standby`` it is the supervisor's hot standby: it imports everything a store needs (``torch.distributed``:
seconds of CPU on a busy machine, the most of a cold restart), prints ``standby`` and waits for ``serve`` on its
standard input, then serves on the same socket as above. End of input (its supervisor is gone) ends it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from .store import GossipStore


def _serve(host: str, port: int, listen_fd: int, parent: int, standby: bool) -> int:
    if standby:
        print("standby", flush=True)
        if not sys.stdin.readline().startswith("serve"):  # end of input: the supervisor is gone
            return 0
    try:
        store = GossipStore(host, port, listen_fd=listen_fd)
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
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--listen-fd", type=int, required=True, help="the listening socket to serve on (inherited)")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--standby", action="store_true", help="wait for 'serve' on stdin, then serve on the socket")
    a = p.parse_args()
    if a.standby:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _serve(a.host, a.port, a.listen_fd, a.parent, a.standby)


if __name__ == "__main__":
    sys.exit(main())
