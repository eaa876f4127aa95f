"""The gossip store's supervisor (:class:`fgdiloco.elastic.SupervisedStore`): this process binds the port once and
every child that serves is handed the socket, so the address is known at once and a dead child is replaced on it."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time

import pytest
import torch.distributed as dist

from fgdiloco.elastic import StoreNotReached, SupervisedStore, connect


def _client(port: int, seconds: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=seconds),
                         use_libuv=True)


@pytest.mark.slow
def test_the_address_is_known_at_once_and_a_killed_child_is_replaced_on_the_same_socket():
    store = SupervisedStore("127.0.0.1", 0)
    try:
        port = store.port  # known before any child serves: the constructor does not wait for one
        assert port > 0 and store.address == f"127.0.0.1:{port}"
        with pytest.raises(RuntimeError, match="did not start within 0 s"):
            store.ready(wait=0)  # the first child imports torch for a second or more
        # connected before the child serves (it is still importing torch): the connection waits in the socket's
        # queue and is served once the child is up
        early = _client(port, 60)
        store.ready()
        early.set("round", "7")
        assert early.get("round") == b"7"
        first = store.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while store.restarts == 0:  # the supervisor looks every 0.1 s; its standby takes over
            assert time.monotonic() < deadline, "the store was not replaced"
            time.sleep(0.02)
        assert store.pid != first and store.port == port
        again = _client(port, 10)
        assert not again.check(["round"])  # a replaced store starts empty (soft state: the workers re-publish)
        again.set("round", "8")
        assert again.get("round") == b"8"
    finally:
        store.close()
    with pytest.raises(OSError):  # closed: the socket is gone, connections are refused
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_taken_port_is_refused_at_once_naming_it():
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"^the gossip store cannot listen on 0.0.0.0:{port}: Address already "
                                               "in use$"):
            SupervisedStore("0.0.0.0", port)
    with pytest.raises(ValueError, match="port must be an int in"):
        SupervisedStore("0.0.0.0", 70000)


def _accepts(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_the_host_is_the_interface_listened_on():
    """127.0.0.1: loopback's one address only (127.0.0.2, also this machine's loopback, is refused); 0.0.0.0:
    every interface. (The kernel accepts a connection into the socket's queue before any child serves.)"""
    for host, elsewhere in (("127.0.0.1", False), ("0.0.0.0", True)):
        store = SupervisedStore(host, 0)
        try:
            assert _accepts("127.0.0.1", store.port)
            assert _accepts("127.0.0.2", store.port) is elsewhere, host
        finally:
            store.close()


def test_a_store_address_where_nothing_listens_fails_within_the_timeout_saying_so(caplog):
    """A wrong store address ends the worker's connect after its timeout with one line, and says once, at the start,
    that nothing answers there (a TCPStore client alone was silent for 60 s and then slept 64 s more)."""
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="fgdiloco"), pytest.raises(
            StoreNotReached, match=f"127.0.0.1:{port} .* within 1.5 s: nothing accepts connections there"):
        connect(f"127.0.0.1:{port}", 0, 1, timeout=1.5)
    assert time.monotonic() - t0 < 5
    assert caplog.text.count(f"nothing accepts connections at the gossip store's address 127.0.0.1:{port}") == 1
