"""Suite-wide set-up: the resolver's timeout.

``torch.distributed``'s TCPStore reverse-resolves the peer address of every store connection, on the client and in
the server's event loop (``getnameinfo`` without ``NI_NUMERICHOST``; ``::ffff:127.0.0.1`` is not in ``/etc/hosts``,
so it goes to DNS). A resolver that drops a query costs glibc's default 5 s timeout, and the server's loop stalls
meanwhile for every client. The suite opens thousands of connections; ``RES_OPTIONS`` caps each lost query at 1 s
(the processes the tests start inherit it). docs/faults.md tells users the same.

"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture
def store():
    """A gossip store (the elastic jobs' TCPStore server) on a free port, for workers that are threads of a test."""
    from fgdiloco.elastic import GossipStore

    s = GossipStore("127.0.0.1", 0)
    yield s
    s.close()


@pytest.fixture
def torchrun_job(monkeypatch):
    """Every process of a test is 'the same torchrun job' unless a test says otherwise: taking a slot back is then a
    restart (at once), as under torchrun."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-job")
