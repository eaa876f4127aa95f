"""Pair groups of the DistributedTransport on a real TCPStore: a group whose exchange ended cleanly on both sides is
reused by the stream's next exchange with the same peer, and only then; anything else builds a fresh one. Workers
are threads here (the transport needs no process group)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from fgdiloco.elastic import ElasticMembership, GossipStore
from fgdiloco.factor import Dense, LowRank
from fgdiloco.gossip.mix import Mixer, PeerHealth
from fgdiloco.gossip.topology import make_topology
from fgdiloco.gossip.transport import DistributedTransport

pytestmark = pytest.mark.usefixtures("torchrun_job")  # tests/conftest.py; ``store`` comes from there too


def _transport(store: GossipStore, rank: int, world: int, timeout: float = 10.0) -> DistributedTransport:
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    return DistributedTransport(membership=ElasticMembership(client, rank, world, "t"), timeout=timeout)


def _both(fn_a, fn_b):
    """Run ``fn_a`` here and ``fn_b`` on a thread (two workers); return both results."""
    out: dict[str, object] = {}

    def run_b() -> None:
        try:
            out["b"] = fn_b()
        except Exception as err:  # noqa: BLE001 - re-raised below
            out["b_err"] = err

    t = threading.Thread(target=run_b)
    t.start()
    a = fn_a()
    t.join(30)
    if "b_err" in out:
        raise out["b_err"]  # type: ignore[misc]
    return a, out["b"]


def _talk(t: DistributedTransport, peer: int, key: str, payloads: list[bytes], clean: bool = True) -> list[bytes]:
    channel = t.open(peer, key=key, timeout=10.0)
    try:
        got = [channel.exchange(p) for p in payloads]
        if clean:
            channel.reuse()
        return got
    finally:
        channel.close()


def test_a_group_that_ended_cleanly_on_both_sides_serves_the_streams_next_exchanges(store):
    a, b = _transport(store, 0, 2), _transport(store, 1, 2)
    for idx in range(4):
        key = f"mix2/0/{idx}"
        got_a, got_b = _both(lambda k=key, i=idx: _talk(a, 1, k, [b"a%d" % i, b"a-accept"]),
                             lambda k=key, i=idx: _talk(b, 0, k, [b"b%d" % i, b"b-accept"]))
        assert got_a == [b"b%d" % idx, b"b-accept"] and got_b == [b"a%d" % idx, b"a-accept"]
    for t in (a, b):  # one group built, then reused three times
        assert (t.pair_groups.built, t.pair_groups.reused) == (1, 3)
    # another stream with the same peer has a group of its own
    _both(lambda: _talk(a, 1, "mix1/0/0", [b"x"]), lambda: _talk(b, 0, "mix1/0/0", [b"y"]))
    assert (a.pair_groups.built, a.pair_groups.reused) == (2, 3)
    a.close(), b.close()


def test_a_conversation_that_did_not_end_cleanly_on_one_side_makes_both_build_a_fresh_group(store):
    a, b = _transport(store, 0, 2), _transport(store, 1, 2)
    _both(lambda: _talk(a, 1, "mix2/0/0", [b"1"]), lambda: _talk(b, 0, "mix2/0/0", [b"2"]))
    # the second exchange ends cleanly on a's side only (b rejected it, or its deadline hit after the last payload)
    _both(lambda: _talk(a, 1, "mix2/0/1", [b"1"]), lambda: _talk(b, 0, "mix2/0/1", [b"2"], clean=False))
    assert (a.pair_groups.built, a.pair_groups.reused) == (1, 1) == (b.pair_groups.built, b.pair_groups.reused)
    # a holds the group, b does not: their hellos differ, both build anew, and the exchange is not held up by it
    t0 = time.monotonic()
    got = _both(lambda: _talk(a, 1, "mix2/0/2", [b"3"]), lambda: _talk(b, 0, "mix2/0/2", [b"4"]))
    assert got == ([b"4"], [b"3"]) and time.monotonic() - t0 < 5.0
    assert (a.pair_groups.built, a.pair_groups.reused) == (2, 1) == (b.pair_groups.built, b.pair_groups.reused)
    # and the fresh group is reused again from there
    _both(lambda: _talk(a, 1, "mix2/0/3", [b"5"]), lambda: _talk(b, 0, "mix2/0/3", [b"6"]))
    assert a.pair_groups.reused == b.pair_groups.reused == 2
    a.close(), b.close()


def test_a_group_in_use_is_never_named_for_a_second_exchange_of_the_same_stream(store):
    """Two exchanges of one stream with one peer at once (random peers can meet in two gossip rounds in a row, a
    prepared exchange can overlap the one before): the kept group is taken by the first, the second builds its own."""
    a, b = _transport(store, 0, 2), _transport(store, 1, 2)
    _both(lambda: _talk(a, 1, "mix2/0/0", [b"1"]), lambda: _talk(b, 0, "mix2/0/0", [b"2"]))
    first_a, first_b = _both(lambda: a.open(1, key="mix2/0/1", timeout=10.0),
                             lambda: b.open(0, key="mix2/0/1", timeout=10.0))
    assert a.pair_groups.reused == b.pair_groups.reused == 1  # mix2/0/1 took the kept group
    # while mix2/0/1 holds it, mix2/0/2 meets on a fresh one, and both conversations work
    got = _both(lambda: _talk(a, 1, "mix2/0/2", [b"p"]), lambda: _talk(b, 0, "mix2/0/2", [b"q"]))
    assert got == ([b"q"], [b"p"])
    assert _both(lambda: first_a.exchange(b"r"), lambda: first_b.exchange(b"s")) == (b"s", b"r")
    assert (a.pair_groups.built, a.pair_groups.reused) == (2, 1) == (b.pair_groups.built, b.pair_groups.reused)
    first_a.close(), first_b.close()
    a.close(), b.close()


def test_a_peer_that_restarted_gets_a_fresh_group(store):
    a, b = _transport(store, 0, 2), _transport(store, 1, 2)
    assert a.membership.returned(1) is False  # first sight
    _both(lambda: _talk(a, 1, "mix2/0/0", [b"1"]), lambda: _talk(b, 0, "mix2/0/0", [b"2"]))
    b.close()
    b2 = _transport(store, 1, 2)  # the slot's new process: it holds no group
    assert a.membership.returned(1) is True  # what a mixer asks before each exchange
    t0 = time.monotonic()
    got = _both(lambda: _talk(a, 1, "mix2/0/1", [b"3"]), lambda: _talk(b2, 0, "mix2/0/1", [b"4"]))
    assert got == ([b"4"], [b"3"]) and time.monotonic() - t0 < 5.0
    assert (a.pair_groups.built, a.pair_groups.reused) == (2, 0)
    a.close(), b2.close()


@pytest.mark.parametrize("codec", [Dense(), LowRank(rank=2)], ids=["dense", "lowrank"])
def test_mixers_reuse_their_pair_groups_round_after_round_and_mix_as_before(store, codec):
    """Three outer rounds of a 2-worker ring: Mix2 builds one group and reuses it; the mixed values are the pair's
    average each time (dense), as with fresh groups."""
    ts = [_transport(store, r, 2) for r in range(2)]
    mixers = [Mixer("mix2", make_topology("ring", 2, 0), t, codec, 1, b"\0" * 8, 10.0, health=PeerHealth())
              for t in ts]
    for rnd in range(3):
        values = [[torch.full((4, 3), float(r + rnd))] for r in range(2)]
        res = _both(lambda r=rnd, v=values: mixers[0].run(v[0], r), lambda r=rnd, v=values: mixers[1].run(v[1], r))
        assert all(x.failed == 0 and x.skipped == 0 for x in res), [x.errors for x in res]
        if isinstance(codec, Dense):
            for x in res:
                torch.testing.assert_close(x.values[0], torch.full((4, 3), rnd + 0.5))
    for t in ts:
        assert (t.pair_groups.built, t.pair_groups.reused) == (1, 2)
        t.close()


def test_a_closed_transport_keeps_no_group(store):
    a, b = _transport(store, 0, 2), _transport(store, 1, 2)
    channels = _both(lambda: a.open(1, key="mix2/0/0", timeout=10.0), lambda: b.open(0, key="mix2/0/0", timeout=10.0))
    assert _both(lambda: channels[0].exchange(b"1"), lambda: channels[1].exchange(b"2")) == (b"2", b"1")
    a.close()
    channels[0].reuse()
    channels[0].close()  # given back after close: dropped
    assert a.pair_groups.take(1, "mix2/0") is None
    b.close()


def test_gloos_errors_are_told_in_one_short_line():
    from fgdiloco.gossip.transport import gloo_reason

    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                          "by peer [10.213.0.3]:40123")
    assert gloo_reason(closed) == "the peer closed the connection (it is probably dead)"
    late = RuntimeError("[/x/gloo/transport/tcp/pair.cc:100] Timed out waiting 1000ms for recv operation\nand more")
    assert gloo_reason(late) == "RuntimeError: Timed out waiting 1000ms for recv operation"
    assert gloo_reason(RuntimeError("")) == "RuntimeError"
    assert len(gloo_reason(RuntimeError("x" * 1000))) == len("RuntimeError: ") + 200
