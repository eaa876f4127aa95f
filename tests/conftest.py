"""Suite-wide set-up: how the two pytest-xdist workers share the machine, and the resolver's timeout.

- The README's test command runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``). The slow tests
  of the launcher modules start several worker processes each, kill them, restart them and wait out liveness
  deadlines: two of them side by side on a two-core machine would each see the other's load as hung peers. They
  share one xdist group, so they run one after another on one xdist worker while the other takes everything else.
- ``torch.distributed``'s TCPStore reverse-resolves the peer address of every store connection, on the client and
  in the server's event loop (``getnameinfo`` without ``NI_NUMERICHOST``; ``::ffff:127.0.0.1`` is not in
  ``/etc/hosts``, so it goes to DNS). A resolver that drops a query costs glibc's default 5 s timeout, and the
  server's loop stalls meanwhile for every client. The suite opens thousands of connections; ``RES_OPTIONS`` caps
  each lost query at 1 s (the processes the tests start inherit it). docs/faults.md tells users the same.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

LAUNCHERS = {"test_elastic_launch", "test_pretrain_elastic", "test_faults", "test_launch", "test_pretrain",
             "test_pretrain_stages", "test_chaos"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group into the node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if module in LAUNCHERS and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("launchers"))
