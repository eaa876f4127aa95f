"""Membership of elastic jobs on a real TCPStore (fgdiloco.elastic.ElasticMembership under a DistributedTransport):
slots, incarnations, absent and restarted peers, the live round, state for joiners, and the settings' errors.
Workers are threads here (the transport needs no process group); tests/test_elastic_launch.py runs real processes
under ``fgdiloco launch``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fgdiloco import FGDiLoCo
from fgdiloco.elastic import (
    AdmissionError,
    ElasticMembership,
    GossipStore,
    SlotTaken,
    StoreUnreachable,
    connect,
    settings,
)
from fgdiloco.elastic.membership import BEATING_SECONDS
from fgdiloco.elastic.rejoin import ADOPT_ROUNDS, CATCH_UP_ROUNDS
from fgdiloco.factor import Dense
from fgdiloco.gossip.membership import StoreMembership, StorePool
from fgdiloco.gossip.mix import Mixer, PeerHealth
from fgdiloco.gossip.topology import make_topology
from fgdiloco.gossip.transport import DistributedTransport, PeerDeclined, PeerGone
from fgdiloco.runtime import Background, drain_background, running_background

pytestmark = pytest.mark.usefixtures("torchrun_job")  # tests/conftest.py; ``store`` comes from there too


def _client(store: GossipStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False)


def _transport(store: GossipStore, rank: int, world: int, timeout: float = 10.0) -> DistributedTransport:
    return DistributedTransport(membership=ElasticMembership(_client(store), rank, world, "t"), timeout=timeout)


def test_settings_come_from_the_environment_and_bad_ones_are_named():
    env = {"FGDILOCO_STORE": "host:29400", "FGDILOCO_WORKER": "2", "FGDILOCO_WORKERS": "5"}
    assert settings(environ=env) == {"host": "host", "port": 29400, "worker": 2, "workers": 5, "job": "default",
                                     "min_workers": 5}
    assert settings(worker=4, min_workers=3, job="j", environ=env)["worker"] == 4
    with pytest.raises(ValueError, match="FGDILOCO_STORE"):
        settings(environ={})
    with pytest.raises(ValueError, match="HOST:PORT"):
        settings(environ=dict(env, FGDILOCO_STORE="nohost"))
    with pytest.raises(ValueError, match=r"worker \(\$FGDILOCO_WORKER\) must be in \[0, workers=5\)"):
        settings(environ=dict(env, FGDILOCO_WORKER="5"))
    with pytest.raises(ValueError, match="workers is not set"):
        settings(environ={"FGDILOCO_STORE": "h:1", "FGDILOCO_WORKER": "0"})
    with pytest.raises(ValueError, match="min_workers"):
        settings(min_workers=6, environ=env)
    with pytest.raises(ValueError, match="job"):
        settings(job="a/b", environ=env)
    with pytest.raises(TypeError, match="worker must be an int"):
        settings(worker=1.5, environ=env)


def test_an_elastic_membership_checks_its_arguments(store):
    c = _client(store)
    for kw, match in (({"rank": 2, "world_size": 2}, "rank must be"), ({"rank": 0, "world_size": 0}, "world_size"),
                      ({"rank": 0, "world_size": 2, "namespace": ""}, "namespace")):
        args = {"namespace": "t", **kw}
        with pytest.raises(ValueError, match=match):
            ElasticMembership(c, args["rank"], args["world_size"], args["namespace"])


def test_connect_waits_a_bounded_time_for_the_first_workers_and_names_the_missing(store, caplog):
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="fgdiloco"):
        early = connect(store.address, 0, 2, wait=0.5)  # slot 1 never comes: it starts without it
    assert time.monotonic() - t0 < 5.0 and "starts without slot(s) [1]" in caplog.text
    early.membership.leave()  # gives the slot up at once
    early.close()
    got = {}
    t = threading.Thread(target=lambda: got.setdefault(1, connect(store.address, 1, 2, wait=10)))
    t.start()
    a = connect(store.address, 0, 2, wait=10)
    t.join()
    assert (a.rank, got[1].rank, a.world_size) == (0, 1, 2)
    # both passed the start barrier at round 0: joined from now on, so a partner in round 1 waits for either
    assert a.membership._joined and got[1].membership._joined
    a.membership.round_now = 1
    with a.membership.stores.lease() as s:
        assert a.membership._slot_verdict(s, 1, 1) is None  # not "joining": its partners exchange with it
    assert a.membership.incarnation == 2  # the first attempt above registered slot 0 once already
    with pytest.raises(ValueError, match="has 2 slots"):
        connect(store.address, 0, 3, wait=1)
    with pytest.raises(TimeoutError, match="cannot reach the gossip store") as unreached:
        connect("127.0.0.1:1", 0, 1, timeout=1.0)
    assert isinstance(unreached.value, StoreUnreachable)  # a life of fgdiloco launch stops for good on it
    a.close()
    got[1].close()


def test_a_worker_that_finds_the_job_past_round_0_does_not_wait_for_the_first_workers(store):
    # after a store restart only the slots that re-published count as joined: a restarted worker (or a late joiner)
    # must not wait its whole join timeout for first workers that finished, left or are down meanwhile
    a = connect(store.address, 0, 3, min_workers=1)
    a.membership.publish_round(4)
    t0 = time.monotonic()
    b = connect(store.address, 1, 3, min_workers=3, wait=20.0)
    assert time.monotonic() - t0 < 5.0
    assert not b.membership._joined  # a late joiner: at its first round start it enters the live round
    with a.membership.stores.lease() as s:
        assert a.membership._slot_verdict(s, 1, 1) == "joining"  # skipped by its peers until then
    a.close(), b.close()


def test_a_first_worker_is_joined_from_its_registration_so_a_resumed_jobs_partner_waits_for_it(store):
    """A resumed job starts at its checkpoints' round, not at 0. A first worker that passed the start barrier and
    published that round before its partner looked again was taken by the partner for a late joiner: not joined, so
    skipped, and it jumped to the live round (CI: a resumed worker's rounds 4-6 were missing). A worker that
    registers before any has passed the barrier is joined from then on; one that registers after is joining until
    its first round start."""
    got = {}
    t = threading.Thread(target=lambda: got.setdefault(1, connect(store.address, 1, 3, job="j", min_workers=2)))
    t.start()
    client = _client(store)
    while client.add("fgdiloco/j/alive/1", 0) == 0 and t.is_alive():  # worker 1 registered: it waits at the barrier
        time.sleep(0.01)
    a = connect(store.address, 0, 3, job="j", min_workers=2)  # worker 1 beats: worker 0 passes at once
    a.membership.publish_round(3)  # the resumed job's start round
    t.join()
    b = got[1]
    assert a.membership.first and b.membership.first and b.membership._joined
    with a.membership.stores.lease() as s:
        assert a.membership._slot_verdict(s, 1, 1) is None  # worker 1 is waited for at round 3, not skipped
    # registers after the barrier was passed, as connect would: a late joiner (or a restart)
    late = ElasticMembership(_client(store), 2, 3, "fgdiloco/j", first=True)
    assert not late.first and not late._joined
    with a.membership.stores.lease() as s:
        assert a.membership._slot_verdict(s, 2, 1) == "joining"  # skipped until its first round start
    late.close()
    a.close(), b.close()


class _StartingMembership:
    """What :func:`fgdiloco.elastic.rejoin.before_round` asks of a membership: peers at fixed rounds."""

    def __init__(self, joined: bool, rounds: dict[int, int]):
        self._joined, self.resync, self.unreachable, self.rounds = joined, False, False, rounds
        self.published = None

    def too_long_away(self) -> bool:
        return False

    def live_round(self) -> int:
        return max(self.rounds.values())

    def front(self) -> int:
        rounds = sorted(self.rounds.values())
        return rounds[(len(rounds) - 1) // 2]

    def serve(self, source) -> None:
        pass

    def publish_round(self, outer_round: int) -> None:
        self.published = outer_round

    def mark_joined(self) -> None:
        self._joined = True


class _Outer:
    def __init__(self):
        self.round, self.fresh, self.rank, self.steps_in_round = 0, False, 3, 0

    def committed_state(self):
        return None

    def jump(self, live: int) -> None:
        self.round = live


@pytest.mark.parametrize("call", ["before_round", "rejoin"])
@pytest.mark.parametrize("joined, rounds, entered", [
    (True, {0: 1, 1: 0, 2: 1}, 0),   # a first worker whose partners are a round further starts round 0 (waited for)
    (False, {0: 1, 1: 0, 2: 1}, 1),  # a late joiner (or a restart) enters the live round
    (True, {0: 3, 1: 3, 2: 4}, 3),   # a first worker CATCH_UP_ROUNDS behind the median catches up, as a joined one
])
def test_a_first_worker_starting_a_round_late_is_not_taken_for_a_late_joiner(call, joined, rounds, entered):
    """A first worker of the job (:func:`connect` marks it joined at the start barrier, round 0) whose set-up ended
    a round after its partners' (the pinned elastic run, on a loaded machine: 0.11 s of start skew against 80 ms
    rounds) took a live peer's state and skipped round 0, so the trajectory depended on timing; now it starts
    round 0, both at a round start and through ``FGDiLoCo.rejoin`` (the example job calls it before its first step)."""
    from fgdiloco.elastic import rejoin

    m, outer = _StartingMembership(joined, rounds), _Outer()
    getattr(rejoin, call)(m, outer)
    assert (outer.round, m._joined) == (entered, True)
    if call == "before_round":
        assert m.published == entered


@pytest.mark.slow
def test_a_second_process_on_a_held_slot_is_refused_and_a_restart_or_a_dead_holders_slot_is_taken(store,
                                                                                                  monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    a = connect(store.address, 0, 2, min_workers=1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    t0 = time.monotonic()
    with pytest.raises(SlotTaken, match=r"slot 0 of job 'default' is held by a live worker \(torchrun job job-a\)"):
        connect(store.address, 0, 2, min_workers=1)
    assert time.monotonic() - t0 < 3.0  # the holder's heartbeat moved: no need to wait out liveness
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")  # a restart of the holder's own torchrun job
    again = connect(store.address, 0, 2, min_workers=1)
    assert again.membership.incarnation == a.membership.incarnation + 1
    a.close(), again.close()  # no departure notice: the holder is dead once its heartbeat stops
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    t0 = time.monotonic()
    b = connect(store.address, 0, 2, min_workers=1, liveness=1.0)
    assert time.monotonic() - t0 >= 1.0  # it waited for the dead holder's heartbeat to stay still
    b.close()


def test_a_worker_with_another_model_or_secret_is_refused_when_it_connects(store):
    a = connect(store.address, 0, 2, min_workers=1, fingerprint=b"12345678", secret=b"s3cret")
    with pytest.raises(AdmissionError, match="another parameter layout"):
        connect(store.address, 1, 2, min_workers=1, fingerprint=b"87654321", secret=b"s3cret")
    with pytest.raises(AdmissionError, match="job secret differs"):
        connect(store.address, 1, 2, min_workers=1, fingerprint=b"12345678", secret=b"other")
    with pytest.raises(AdmissionError, match="job secret differs"):
        connect(store.address, 1, 2, min_workers=1, fingerprint=b"12345678", secret=None)
    b = connect(store.address, 1, 2, min_workers=1, fingerprint=b"12345678", secret=b"s3cret")
    a.close(), b.close()


@pytest.mark.slow
def test_a_restarted_store_is_reconnected_and_refilled_and_a_store_gone_for_good_stops_the_worker():
    server = GossipStore("127.0.0.1", 0)
    port = server.port
    a = connect(f"127.0.0.1:{port}", 0, 2, min_workers=2, wait=0.0, store_timeout=3.0, fingerprint=b"f" * 8)
    b = connect(f"127.0.0.1:{port}", 1, 2, min_workers=2, store_timeout=3.0, fingerprint=b"f" * 8)
    a.membership.publish_round(5)
    server.close()
    t0 = time.monotonic()
    while not a.membership.unreachable and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert a.membership.unreachable
    mixer = Mixer("mix2", make_topology("ring", 2, 0), a, Dense(), 1, b"\0" * 8, 5.0)
    t1 = time.monotonic()
    res = mixer.run([torch.zeros(3)], 6)
    assert (res.failed, res.skipped) == (0, 1) and time.monotonic() - t1 < 0.5  # skipped at once, no timeout
    server = GossipStore("127.0.0.1", port)  # the launcher restarts it, empty
    t0 = time.monotonic()
    while (a.membership.unreachable or b.membership.unreachable) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not a.membership.unreachable and not b.membership.unreachable
    fresh = dist.TCPStore("127.0.0.1", port, is_master=False)
    assert fresh.get("fgdiloco/default/fingerprint") == (b"f" * 8).hex().encode()  # the job's keys are back
    t0 = time.monotonic()  # and the job has begun: a restart that registers now is no first worker
    while fresh.add("fgdiloco/default/begun", 0) == 0 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert fresh.add("fgdiloco/default/begun", 0) > 0
    t0 = time.monotonic()  # each worker re-publishes its own round on its own heartbeat thread
    while b.membership.peer_round(0) != 5 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert b.membership.peer_round(0) == 5 and a.membership.joined() == [0, 1]
    server.close()
    while not a.membership.unreachable:
        time.sleep(0.05)
    a.membership.check_reachable()  # not yet too long
    time.sleep(3.5)
    with pytest.raises(StoreUnreachable, match=rf"the gossip store at 127.0.0.1:{port} has been out of reach"):
        a.membership.check_reachable()
    a.close(), b.close()


def test_a_fixed_groups_worker_stops_once_its_store_has_been_gone_for_store_timeout():
    """A fixed torch.distributed group's store lives in rank 0's process (or the launcher's) and dies with it: a
    survivor trains on without gossip for store_timeout, then its next round start stops it with one line."""
    server = GossipStore("127.0.0.1", 0)
    m = StoreMembership(dist.TCPStore("127.0.0.1", server.port, is_master=False), 1, 3, "fixed", store_timeout=30.0)
    try:
        m.before_round(None)  # the store answers: nothing to do
        server.close()
        t0 = time.monotonic()
        while not m.unreachable and time.monotonic() - t0 < 5:  # the next heartbeat finds it gone
            time.sleep(0.05)
        assert m.unreachable
        m.before_round(None)  # away for less than store_timeout: it trains on
        m.down_since -= 31.0  # as if 31 s had passed since
        with pytest.raises(StoreUnreachable, match=r"^the job's store \(served by rank 0's process or the launcher: "
                                                   r"the job has ended\) has been out of reach for 31 s "
                                                   r"\(store_timeout 30 s\): stopping rank 1$"):
            m.before_round(None)
    finally:
        m.close()


def test_closing_with_an_exchange_prepared_for_an_empty_slot_ends_its_set_up(store, caplog):
    """A set-up still waiting for a hello that never comes (an empty slot's, prepared for the round after the last)
    ends when the transport closes: left running into interpreter exit it aborted the worker (exit -6), which
    torchrun took for a death and restarted."""
    a = _transport(store, 0, 3)
    a.prepare(2, key="mix1/0/80")  # slot 2 never had a worker
    assert "prepare mix1/0/80 with rank 2" in running_background()
    t0 = time.monotonic()
    a.close()
    assert time.monotonic() - t0 < 1.0
    assert "prepare mix1/0/80 with rank 2" not in running_background()  # ended, not forsaken
    assert "still inside Gloo" not in caplog.text


def test_an_absent_slot_is_skipped_at_once(store):
    a = _transport(store, 0, 3)
    t0 = time.monotonic()
    with pytest.raises(PeerDeclined, match="never joined"):
        a.open(2, key="k", timeout=10.0)
    assert time.monotonic() - t0 < 1.0
    a.close()


def test_a_process_that_has_not_started_a_round_is_skipped_at_once_once_the_job_is_past_round_0(store):
    """A restarted worker loading its checkpoint or waiting for a peer's state beats but will enter a later round:
    its partners skip it at once instead of waiting their join deadline (CI: a 20 s timeout at a rejoin). At round 0
    everyone is joining and is waited for."""
    a, b = _transport(store, 0, 2), _transport(store, 1, 2)
    assert a.membership.gone(1, time.monotonic()) is None  # round 0: b is waited for
    a.membership.publish_round(5)
    a.membership.mark_joined()
    assert a.membership.gone(1, time.monotonic()) == "joining"
    t0 = time.monotonic()
    with pytest.raises(PeerDeclined, match="joining the job"):
        a.open(1, key="k", timeout=10.0)
    assert time.monotonic() - t0 < 1.0
    assert b.membership.gone(0, time.monotonic()) is None  # a has started a round: b waits for it
    b.membership.publish_round(5)
    b.membership.mark_joined()
    assert a.membership.gone(1, time.monotonic()) is None
    out = {}
    tb = threading.Thread(target=lambda: out.setdefault("b", b.exchange(0, b"from b", key="k2", timeout=10)))
    tb.start()
    out["a"] = a.exchange(1, b"from a", key="k2", timeout=10)
    tb.join()
    assert out == {"a": b"from b", "b": b"from a"}
    assert a.membership.returned(1) is False  # first sight of b's incarnation
    b.close()
    b2 = _transport(store, 1, 2)  # its restart is joining again: a new incarnation that has not started a round
    assert a.membership.returned(1) is True and a.membership.gone(1, time.monotonic()) == "joining"
    a.close(), b2.close()


def test_a_peer_whose_replica_has_a_hung_stage_is_gone_after_liveness_though_its_own_heartbeat_beats(store):
    """2 pipeline replicas x 2 stages, each stage gossiping in its own job. Replica 0's stage 0 hangs (its heartbeat
    stops); its stage 1 still beats (blocked in the pipeline, it never comes to its exchange). Replica 1's stage 1
    gives that exchange up after ``liveness`` because of the sibling's silence, instead of waiting for the hang
    (up to ``join_timeout``); without the siblings it would have waited for the whole hang."""
    jobs = ["fgdiloco/p.stage0", "fgdiloco/p.stage1"]

    def stage(replica: int, s: int) -> ElasticMembership:
        return ElasticMembership(_client(store), replica, 2, jobs[s], liveness=1.0,
                                 siblings=[j for j in jobs if j != jobs[s]])

    hung, blocked = stage(0, 0), stage(0, 1)
    mine = DistributedTransport(membership=stage(1, 1), join_timeout=10.0, liveness=1.0)
    assert mine.membership.gone(0, time.monotonic()) is None  # every stage of replica 0 beats
    hung.close()  # SIGSTOP: no more heartbeats, no departure notice
    t0 = time.monotonic()  # the verdict names the silent sibling, silent for liveness (1.x s): without the
    # sibling check the open would end only at join_timeout (10 s) with another message
    with pytest.raises(PeerGone, match=r"its replica's p\.stage0 has had no heartbeat for 1\.\d s"):
        mine.open(0, key="mix2/r3", timeout=10.0)
    with mine.membership.stores.lease() as client:  # by its own heartbeat the peer is alive: without the
        assert mine.membership._gone(client, 0, t0) is None  # sibling it would be waited for as a late peer
    mine.close(), blocked.close()


def test_a_restarted_peer_gets_new_keys_and_its_old_exchange_ends_at_once(store):
    a, b = _transport(store, 0, 2), _transport(store, 1, 2)
    assert a.membership.returned(1) is False  # first sight
    errors = []

    def wait_for_old_b():
        try:
            a.open(1, key="k", timeout=20.0)
        except PeerDeclined as e:
            errors.append((str(e), time.monotonic()))

    t = threading.Thread(target=wait_for_old_b)
    t.start()
    time.sleep(0.3)  # a is waiting for b's hello (b is "alive" but never comes)
    b.close()
    b2 = _transport(store, 1, 2)  # the restarted process takes the slot: a new incarnation
    t_restart = time.monotonic()
    t.join(10)
    assert errors and "restarted" in errors[0][0] and errors[0][1] - t_restart < 2.0
    assert b2.membership.incarnation == 2 and a.membership.returned(1) is True and a.membership.returned(1) is False
    # the new incarnation and a meet on keys that name it
    out = {}
    tb = threading.Thread(target=lambda: out.setdefault("b", b2.exchange(0, b"from b2", key="k2", timeout=10)))
    tb.start()
    out["a"] = a.exchange(1, b"from a", key="k2", timeout=10)
    tb.join()
    assert out == {"a": b"from b2", "b": b"from a"}
    a.close()
    b2.close()


def test_a_returned_peer_is_out_of_back_off(store):
    a = _transport(store, 0, 2)
    b = _transport(store, 1, 2)
    mixer = Mixer("mix2", make_topology("random", 2, 0), a, Dense(), 1, b"\0" * 8, 5.0, health=PeerHealth())
    assert mixer._returned(1) is False
    mixer.health.failure(1, 0)
    assert mixer.health.skip(1, 1)
    b.close()
    b2 = _transport(store, 1, 2)
    assert mixer._returned(1) is True and not mixer.health.skip(1, 1)
    a.close()
    b2.close()


def test_a_mixer_drops_what_it_prepared_for_a_peer_that_restarted_though_another_mixer_noticed_first(store):
    """Mix1 and Mix2 of one worker share its membership, which reports a restarted peer once, to whichever asks
    first. Mix1 prepared its exchange (a hello loop under the old incarnation's keys) before the peer restarted;
    Mix2 noticed the return. Mix1 still drops its stale set-up and meets the new process at once (CI: a full join
    timeout with each partner of a rejoined worker, and that worker's own round stalled as long)."""
    a, b = _transport(store, 0, 2), _transport(store, 1, 2)
    topology = make_topology("random", 2, 0)
    mix1 = Mixer("mix1", topology, a, Dense(), 1, b"\0" * 8, 8.0, health=PeerHealth())
    mix2 = Mixer("mix2", topology, a, Dense(), 1, b"\0" * 8, 8.0, health=PeerHealth())
    mix1.prepare(1)  # under b's first incarnation: b never answers it
    b.close()
    b2 = _transport(store, 1, 2)
    assert mix2._returned(1) is True  # the membership's one report of the return goes to Mix2
    theirs = Mixer("mix1", topology, b2, Dense(), 1, b"\0" * 8, 8.0, health=PeerHealth())
    mine_values, their_values = [torch.zeros(4)], [torch.full((4,), 2.0)]
    out = {}
    tb = threading.Thread(target=lambda: out.setdefault("b", theirs.run(their_values, 1)))
    t0 = time.monotonic()
    tb.start()
    out["a"] = mix1.run(mine_values, 1)
    tb.join()
    assert time.monotonic() - t0 < 4.0  # not the 8 s join timeout
    for res in out.values():
        assert (res.failed, res.skipped, res.exchanges) == (0, 0, 1), res.errors
        assert torch.equal(res.values[0], torch.ones(4))  # the pair's average
    a.close(), b2.close()


def test_rounds_are_published_and_the_live_round_is_the_newest(store):
    ms = [_transport(store, r, 3).membership for r in range(3)]
    assert ms[0].live_round() == 0
    ms[1].publish_round(4)
    ms[2].publish_round(7)
    ms[2].publish_round(9)
    assert (ms[0].live_round(), ms[0].peer_round(1), ms[0].peer_round(2), ms[1].live_round()) == (9, 4, 9, 9)
    ms[2].close()
    again = _transport(store, 2, 3).membership  # a restart continues from the slot's published round
    again.publish_round(10)
    assert ms[0].peer_round(2) == 10
    again.leave()  # a departed worker is no longer waited for, but the round it reached still counts for joining
    assert ms[0].peer_rounds() == {1: 4} and ms[0].live_round() == 10
    for m in (ms[0], ms[1], again):
        m.close()


def test_a_peer_rounds_behind_the_job_is_skipped_at_once_and_hung_slots_do_not_hold_the_median_back(store):
    """A live peer CATCH_UP_ROUNDS or more behind the job's median round (as it sees it) jumps to the live round at
    its next round start, so its partners skip it at once instead of waiting for it (in the chaos job, lateness
    passed from partner to partner: 5 s per stopped worker). The median counts only slots whose heartbeat moves:
    with a third of a job stopped, the median of every slot lagged the workers that trained."""
    ts = [_transport(store, r, 4, timeout=10.0) for r in range(4)]
    a, b, c, d = (t.membership for t in ts)
    for m, rnd in ((a, 12), (b, 9), (c, 5), (d, 5)):
        m.publish_round(rnd)
        m.mark_joined()
    # c and d are at round 5 and beating: b (3 behind a) is not behind the median of {a, c, d} (5)
    assert a.lagging(1) is None and a.front(without=1) == 5
    c._service.stop(), d._service.stop()  # c and d hang: their heartbeats stop
    a.peer_rounds()  # a reads every slot now and again (at each round start), noting when each heartbeat moved
    time.sleep(BEATING_SECONDS + 0.3)
    assert a.front(without=1) == 12 and a.lagging(1) == 3  # b's median is a's round alone now
    assert a.lagging(2) == 4 and a.lagging(0) is None  # c sees b (9) and a (12): the lower median, 9
    b.publish_round(10)
    assert a.lagging(1) is None  # 2 behind: waited for, as before
    b.publish_round(9)
    mixer = Mixer("mix2", make_topology("ring", 4, 0), ts[0], Dense(), 1, b"\0" * 8, 10.0, health=PeerHealth())
    peer = mixer.topology.step(0, mixer.schedule_index(12, 0)).peer
    assert peer == 1  # the ring pairs 0 with b in round 12
    t0 = time.monotonic()
    res = mixer.run([torch.zeros(3)], 12)
    assert time.monotonic() - t0 < 1.0  # not the 10 s join timeout: b beats, but it will not come
    assert (res.failed, res.skipped) == (0, 1), res.errors
    assert "3 outer rounds behind the job" in res.errors[0] and not mixer.health.skip(1, 13)  # no back-off
    for t in ts:
        t.close()


@pytest.mark.slow
def test_discarding_an_exchange_whose_peer_died_after_its_hello_does_not_wait_out_the_gloo_timeout(store):
    """A peer that posted its hello for a prepared exchange and died: this side committed and is inside Gloo's pair
    set-up, which waits the exchange timeout (30 s here) for it. Discarding the exchange (close() at the end of a
    run, a rejoin) waits only until the peer is known gone, not for Gloo (it held close() 30 s, 1 run in ~15)."""
    key = "mix2/0/7"
    port_r, port_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the peer: says hello, then dies before it builds its side
        try:
            b = _transport(store, 1, 2)
            b.prepare(0, key=key)
            with b.membership.stores.lease() as s:
                s.wait([f"{b.membership.prefix(0, key)}/hello/1"], timedelta(seconds=20))
            os.write(port_w, b"1")
        finally:
            os._exit(0)
    os.close(port_w)
    assert os.read(port_r, 1) == b"1"
    os.waitpid(pid, 0)
    a = _transport(store, 0, 2, timeout=30.0)
    a.prepare(1, key=key)
    with a.membership.stores.lease() as s:  # the hello was there: this side committed and went into Gloo
        s.wait([f"{a.membership.prefix(1, key)}/decision"], timedelta(seconds=20))
    t0 = time.monotonic()
    a.discard(1, key=key)
    assert time.monotonic() - t0 < a.membership.liveness + 3.0
    a.close()


def test_a_departed_worker_does_not_wait_for_a_live_peer_that_saw_its_notice_and_never_builds(store):
    """A leaving worker's prepared exchange: its peer posted its hello (so this side committed and went into Gloo's
    pair set-up), then saw the departure notice and never builds its end. The peer is alive (its heartbeat moves), so
    only the departure tells the discard not to wait: it ends at once instead of after the Gloo deadline (30 s here;
    it held a leaving worker's close() 20 s in the launcher test, answering joiners with a stale state meanwhile)."""
    key = "mix2/0/9"
    a, b = _transport(store, 0, 2, timeout=30.0), _transport(store, 1, 2)
    with b.membership.stores.lease() as s:  # the peer's hello, as its own prepare would post it
        s.set(f"{b.membership.prefix(0, key)}/hello/1", b"go")
    a.prepare(1, key=key)
    with a.membership.stores.lease() as s:  # this side committed and went into Gloo
        s.wait([f"{a.membership.prefix(1, key)}/decision"], timedelta(seconds=20))
    a.membership.leave()
    assert a.membership.departed and not b.membership.departed
    t0 = time.monotonic()
    a.discard(1, key=key)
    assert time.monotonic() - t0 < 2.0 and b.membership.gone(0, t0) == "left"
    a.close(), b.close()


def test_a_departed_worker_answers_no_state_request(store):
    """A worker that posted its departure notice donates no state: its round is frozen while the job goes on (a
    joiner that took it would pull its partners back)."""
    a, b, c = (_transport(store, r, 3).membership for r in range(3))
    a.serve(lambda: (3, b"state of a"))
    b.serve(lambda: (30, b"state of b"))
    a.leave()
    c.request_state()
    with a.stores.lease() as s:
        assert a.answer_requests(s) == 0
    with b.stores.lease() as s:
        assert b.answer_requests(s) == 1
    assert c.await_state(5.0) == b"state of b"
    a.close(), b.close(), c.close()


def test_a_joiner_gets_one_answer_to_its_state_request(store):
    a, b, c = (_transport(store, r, 3).membership for r in range(3))
    a.serve(lambda: (3, b"state of a"))
    b.serve(lambda: (3, b"state of b"))
    with a.stores.lease() as s:
        assert a.answer_requests(s) == 0  # nothing asked
    c.request_state()
    with a.stores.lease() as s:
        assert a.answer_requests(s) == 1
    with b.stores.lease() as s:
        assert b.answer_requests(s) == 0  # answered already
    assert c.await_state(5.0) == b"state of a"
    for m in (a, b, c):  # everyone else leaves (with a notice)
        m.leave()
    d = _transport(store, 1, 3).membership  # nobody left to answer: the wait ends at once, not after the timeout
    a.close(), b.close(), c.close()
    t0 = time.monotonic()
    d.request_state()
    assert d.await_state(30.0) is None and time.monotonic() - t0 < 2.0
    d.close()


@pytest.mark.slow
def test_live_peers_answer_a_joiner_in_the_background_and_a_dead_donor_is_replaced(store):
    """The heartbeat answers requests (no round start needed); a donor that claimed a request and died before
    sending is replaced: the joiner asks again and another live peer answers."""
    a, b, c = (_transport(store, r, 3).membership for r in range(3))
    c.request_state()
    with a.stores.lease() as s:  # a claims the request by hand, then "dies" without answering
        key = a._state_key(2, f"{c.incarnation}.{c._request}")
        assert s.compare_set(key + "/claim", "", b"0") == b"0"
    a.close()  # its heartbeat stops: after liveness it counts as gone
    b.serve(lambda: (5, b"state of b"))
    t0 = time.monotonic()
    assert c.await_state(30.0) == b"state of b"
    assert time.monotonic() - t0 < 2 * a.liveness + 3.0  # a's silence is noticed after liveness; not the 30 s
    b.close(), c.close()


def test_round_start_reads_every_slot_in_one_batched_store_read(store):
    """A round start's store reads do not grow with the slot count: the slots' rounds come in one multi_get."""
    m = _transport(store, 0, 32).membership
    calls = []
    with m.stores.lease() as s:
        real = type(s).multi_get

        class Counting:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def multi_get(self, keys):
                calls.append(len(keys))
                return real(self.inner, keys)

            def add(self, key, value):
                calls.append(("add", key))
                return self.inner.add(key, value)

    pool = m.stores
    original = pool.acquire
    pool.acquire = lambda: Counting(original())
    try:
        assert m.peer_rounds() == {} and m.live_round() is None
    finally:
        pool.acquire = original
    assert calls == [3 * 31, 3 * 31], calls  # one read each, whatever the slot count
    m.close()


def _wrapper(transport, seed_value: float) -> FGDiLoCo:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(seed_value)
    return FGDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, transport=transport,
                    codec="dense", mix1_codec="dense", outer_momentum=0.5)


def test_rejoin_adopts_a_live_peers_state_and_round(store):
    a = _wrapper(_transport(store, 0, 2), 1.0)
    b = _wrapper(_transport(store, 1, 2), 5.0)  # a fresh joiner: its own values are not to be mixed in
    a.outer.set(a.outer.theta0, [torch.full_like(m, 0.25) for m in a.outer.momentum], 6)
    a.transport.membership.publish_round(6)
    a.transport.membership.serve(a.outer.committed_state)  # its heartbeat answers the request
    assert b.rejoin() == 6
    assert b.rejoins == 1 and b.outer.steps_in_round == 0
    for p in b.params:
        assert torch.equal(p.detach(), torch.ones_like(p))
    for m in b.outer.momentum:
        assert torch.equal(m, torch.full_like(m, 0.25))
    assert b.rejoin() == 6 and b.rejoins == 1  # already there: nothing changes
    a.close(), b.close()
    a.transport.close(), b.transport.close()


def test_a_worker_that_joins_a_job_whose_workers_all_left_says_the_job_ended_and_how_to_start_a_new_one(
        store, caplog, tmp_path, monkeypatch):
    """A second job launched on a store that served an earlier one under the same name joins that job at its end
    and trains nothing; the worker says so, and names --job, and its lives file tells ``fgdiloco launch``. While a
    peer is still in the job it says nothing."""
    from fgdiloco.elastic import LIVES_ENV

    lives = tmp_path / "worker1.lives"
    monkeypatch.setenv(LIVES_ENV, str(lives))
    a = _wrapper(_transport(store, 0, 3), 1.0)
    c = _wrapper(_transport(store, 2, 3), 1.0)
    for w in (a, c):
        w.transport.membership.publish_round(30)
    a.close(), a.transport.close()  # finished: its departure notice is on the store
    b = _wrapper(_transport(store, 1, 3), 5.0)
    b.load_state_dict(b.state_dict())  # its own state of round 0 (a job that trained nothing yet)
    b.outer.set(b.outer.theta0, b.outer.momentum, 28)  # close enough to keep its own state
    with caplog.at_level("WARNING", logger="fgdiloco"):
        assert b.rejoin() == 30
    assert "joining the job at outer round 30" in caplog.text
    assert "has left the gossip store" not in caplog.text  # worker 2 is still in the job
    assert not lives.exists()
    c.close(), c.transport.close()
    assert b.transport.membership.ended() is None  # worker 1 is still in the job
    b.close(), b.transport.close()  # the last to leave: it says that the job ended
    # a second job under the same name: two new workers without state (no checkpoint), and one has taken its slot
    # when the other joins (it counts as in the job: by the slots alone the job has not ended)
    d = _transport(store, 0, 3)  # still starting: no state to give
    e = _wrapper(_transport(store, 1, 3, timeout=1.0), 5.0)
    assert e.outer.fresh and e.transport.membership.ended() is not None
    assert 0 in e.transport.membership.peer_rounds()
    caplog.clear()
    with caplog.at_level("WARNING", logger="fgdiloco"):
        assert e.rejoin() == 30
    assert "every other worker of this job has left the gossip store: the job ended at outer round 30" in (
        caplog.text) and "--job NAME" in caplog.text
    assert [json.loads(line)["round"] for line in lives.read_text().splitlines()] == [30]
    # a worker with a checkpoint of its own does not go by the post: after a stop and a --resume on the same store
    # it continues the job
    f = _wrapper(_transport(store, 2, 3, timeout=1.0), 5.0)
    f.load_state_dict(f.state_dict())
    f.outer.set(f.outer.theta0, f.outer.momentum, 27)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fgdiloco"):
        assert f.rejoin() == 30
    assert "joining the job at outer round 30" in caplog.text and "has left the gossip store" not in caplog.text
    for w in (e, f):
        w.close(), w.transport.close()
    d.close()


def test_rejoin_with_own_state_jumps_to_the_live_round_and_keeps_its_parameters(store):
    """A checkpoint less than ADOPT_ROUNDS old is kept (its rounds are not thrown away), even with a donor there."""
    a = _wrapper(_transport(store, 0, 2), 1.0)
    b = _wrapper(_transport(store, 1, 2), 5.0)
    b.load_state_dict(b.state_dict())  # its own checkpoint: not fresh
    a.outer.set(a.outer.theta0, a.outer.momentum, ADOPT_ROUNDS - 1)
    a.transport.membership.publish_round(ADOPT_ROUNDS - 1)
    a.transport.membership.serve(a.outer.committed_state)
    assert b.rejoin() == ADOPT_ROUNDS - 1 and b.rejoins == 1
    for p, t in zip(b.params, b.outer.theta0):
        assert torch.equal(p.detach(), torch.full_like(p, 5.0)) and torch.equal(t, p.detach())
    a.close(), b.close()
    a.transport.close(), b.transport.close()


def _took_a_state_kept_its_inner_state(a, b) -> None:
    """``b`` holds ``a``'s round-start parameters (ones) and outer momentum (0.5) and its own inner lr (0.25)."""
    for p in b.params:
        assert torch.equal(p.detach(), torch.ones_like(p))
    for m in b.outer.momentum:
        assert torch.equal(m, torch.full_like(m, 0.5))
    assert b.inner_optimizer.param_groups[0]["lr"] == 0.25
    a.close(), b.close()
    a.transport.close(), b.transport.close()


def test_rejoin_with_a_checkpoint_adopt_rounds_old_takes_the_live_peers_state_and_keeps_its_inner_state(store):
    """A restart from a checkpoint ADOPT_ROUNDS or more behind the live round adopts a live peer's parameters and
    outer momentum (it would pull its partners back to an older model), and keeps its own inner optimizer state."""
    a = _wrapper(_transport(store, 0, 2), 1.0)
    b = _wrapper(_transport(store, 1, 2), 5.0)
    b.inner_optimizer.param_groups[0]["lr"] = 0.25
    b.load_state_dict(b.state_dict())  # its own checkpoint, of round 0: not fresh
    a.outer.set(a.outer.theta0, [torch.full_like(m, 0.5) for m in a.outer.momentum], ADOPT_ROUNDS)
    a.transport.membership.publish_round(ADOPT_ROUNDS)
    a.transport.membership.serve(a.outer.committed_state)
    assert b.rejoin() == ADOPT_ROUNDS and b.rejoins == 1
    _took_a_state_kept_its_inner_state(a, b)


def test_a_joined_worker_that_fell_catch_up_rounds_behind_takes_a_live_peers_state(store):
    """A worker that hung (SIGSTOP) or waited rounds for a gone partner catches up at its next round start; its own
    parameters are CATCH_UP_ROUNDS (>= ADOPT_ROUNDS) rounds old, so it takes a live peer's, as a restart with a
    stale checkpoint does, instead of pulling its partners back to an older model. It keeps its inner state."""
    assert CATCH_UP_ROUNDS >= ADOPT_ROUNDS
    a = _wrapper(_transport(store, 0, 2), 1.0)
    b = _wrapper(_transport(store, 1, 2), 5.0)
    b.load_state_dict(b.state_dict())  # not fresh: b trained its own rounds
    b.transport.membership.mark_joined()
    b.inner_optimizer.param_groups[0]["lr"] = 0.25
    a.outer.set(a.outer.theta0, [torch.full_like(m, 0.5) for m in a.outer.momentum], CATCH_UP_ROUNDS)
    a.transport.membership.publish_round(CATCH_UP_ROUNDS)
    a.transport.membership.serve(a.outer.committed_state)
    b.transport.membership.before_round(b.outer)
    assert b.round == CATCH_UP_ROUNDS and b.rejoins == 1
    _took_a_state_kept_its_inner_state(a, b)


def test_a_pipeline_stage_that_catches_up_keeps_its_own_state():
    """Each stage of a pipeline replica would adopt from whichever replica answered first: stages of different
    replicas, not trained together (the pipeline chaos job ended 1.05x its clean loss). A stage (a membership with
    siblings) catches up with its own parameters; a restart's stale checkpoint is still replaced."""
    from fgdiloco.elastic import rejoin

    class Stage(_StartingMembership):
        siblings = ("fgdiloco/j.stage1",)

        def request_state(self):
            raise AssertionError("a joined stage must not ask for a peer's state")

    m, outer = Stage(True, {0: 5, 1: 5, 2: 6}), _Outer()
    rejoin.before_round(m, outer)
    assert outer.round == 5 and m.published == 5


def test_a_peers_state_older_than_this_workers_own_is_not_taken(store):
    """A donor that is itself behind (a replica restarting too) must not send a worker back: the pipeline chaos run
    had a replica at round 54 take a state of round 20. Then the worker keeps its own; a newer state is taken."""
    a = _wrapper(_transport(store, 0, 2), 1.0)
    b = _wrapper(_transport(store, 1, 2), 5.0)
    a.outer.set(a.outer.theta0, a.outer.momentum, 2)
    b.outer.set(b.outer.theta0, b.outer.momentum, 5)
    assert b.outer.adopt(a.outer.committed_state()[1]) is None
    assert b.round == 5 and b.rejoins == 0
    for p in b.params:
        assert torch.equal(p.detach(), torch.full_like(p, 5.0))
    a.outer.set(a.outer.theta0, a.outer.momentum, 6)
    assert b.outer.adopt(a.outer.committed_state()[1]) == 6 and b.round == 6
    for p in b.params:
        assert torch.equal(p.detach(), torch.ones_like(p))
    a.close(), b.close()
    a.transport.close(), b.transport.close()


def test_elastic_arguments_that_cannot_hold_are_refused():
    model = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="exact topology 'allreduce'"):
        FGDiLoCo(model, inner, sync_every=2, elastic=True, topology="allreduce")
    with pytest.raises(TypeError, match="elastic must be a bool"):
        FGDiLoCo(model, inner, sync_every=2, elastic="yes")
    with pytest.raises(ValueError, match="FGDILOCO_STORE"):
        FGDiLoCo(model, inner, sync_every=2, elastic=True)


def test_launch_and_store_refuse_bad_options_with_one_line(capsys):
    from fgdiloco.cli import main

    for argv, text in ((["launch", "--workers", "0", "x.py"], "--workers must be an int >= 1, got 0"),
                       (["launch", "--workers", "2"], "script must name the worker's script"),
                       (["launch", "--store", "nohost", "x.py"], "--store must be HOST:PORT"),
                       (["launch", "--slots", "1", "--workers", "2", "x.py"],
                        "--slots must be an int >= --first-worker + --workers = 2, got 1"),
                       (["launch", "--workers", "2", "no_such_script.py"], "'no_such_script.py' is not a file"),
                       (["store", "--port", "99999"], "port must be an int in [0, 65536)"),
                       # checked before any worker starts (every worker used to fail and restart for nothing)
                       (["launch", "--job", "", __file__], "--job must be a non-empty name without '/', got ''"),
                       (["launch", "--job", "a/b", __file__], "--job must be a non-empty name without '/'"),
                       (["launch", "--stages", "0", __file__], "--stages must be an int >= 1, got 0"),
                       (["launch", "--log-dir", "/proc/nope", __file__], "--log-dir '/proc/nope' cannot be created")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert text in err and len(err.strip().splitlines()) == 1, err
    # a non-number is refused by the parser (usage line, then one error line), worded as pretrain's options word it
    for argv, text in ((["launch", "--workers", "abc", "x.py"], "--workers: expected an int >= 1, got 'abc'"),
                       (["launch", "--first-worker", "1.5", "x.py"], "--first-worker: expected an int >= 0, got '1.5'"),
                       (["store", "--port", "x"], "--port: expected an int (a TCP port in [0, 65536)), got 'x'")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert text in err.strip().splitlines()[-1], err


def test_the_exit_drain_waits_for_exchanges_started_while_it_waits_and_reports_what_is_left():
    """What runs at interpreter exit (a thread inside Gloo then aborts the process): every Background, one started
    by another meanwhile included, is waited for within the limit; what is still running is named."""
    stuck = threading.Event()
    job = Background(lambda: stuck.wait(30), "stuck exchange")
    assert "stuck exchange" in drain_background(0.2)
    stuck.set()
    assert job.wait(5)

    first_go, second_go = threading.Event(), threading.Event()

    def first() -> Background:
        first_go.wait(30)
        return Background(lambda: second_go.wait(30), "second exchange")

    Background(first, "first exchange")
    timers = [threading.Timer(0.1, first_go.set), threading.Timer(0.4, second_go.set)]
    for t in timers:
        t.start()
    left = drain_background(10)
    assert "first exchange" not in left and "second exchange" not in left, left
    assert second_go.is_set()  # it returned after the second one ended, not when the first did


def test_a_life_whose_store_is_never_reached_stops_for_good_with_one_line(tmp_path):
    # torchrun would restart a life that raised, and each restart would wait its whole timeout again: a store that
    # cannot be reached at start ends the life (exit 0, one line, a "store" stop for fgdiloco launch to report)
    script = tmp_path / "worker.py"
    script.write_text("from fgdiloco.elastic import connect\nconnect('127.0.0.1:1', 0, 1, timeout=0.5)\n")
    lives = tmp_path / "lives.jsonl"
    env = dict(os.environ, FGDILOCO_LIVES_FILE=str(lives), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "fgdiloco.elastic.life", str(script)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("[fgdiloco] worker stopped: cannot reach the gossip store") == 1
    events = [json.loads(line) for line in lives.read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "stop"] and events[1]["kind"] == "store"


def test_a_life_whose_script_returned_exits_0_after_its_exit_handlers_without_interpreter_teardown(tmp_path):
    # a pair group given up on can still be inside Gloo when the worker is done (forsaken: the exit drain no longer
    # counts it); interpreter teardown then aborted the process (exit -6: "terminate called without an active
    # exception") and torchrun restarted a finished worker. Here an object whose __del__ aborts, held where only
    # teardown releases it, stands in for that teardown
    probe = ("import atexit, builtins, os\n"
             "class _Teardown:\n"
             "    def __del__(self, abort=os.abort):\n"
             "        abort()\n"
             "builtins._teardown_probe = _Teardown()\n"
             "atexit.register(print, 'exit handlers ran', flush=True)\n")
    script = tmp_path / "worker.py"
    lives = tmp_path / "lives.jsonl"
    env = dict(os.environ, FGDILOCO_LIVES_FILE=str(lives), OMP_NUM_THREADS="1")

    def life(body: str) -> subprocess.CompletedProcess:
        script.write_text(probe + body)
        return subprocess.run([sys.executable, "-m", "fgdiloco.elastic.life", str(script)], capture_output=True,
                              text=True, env=env, timeout=120)

    proc = life("import threading\n"
                "from fgdiloco.runtime import Background\n"
                "Background(threading.Event().wait, 'meet rank 3 for mix1/0/11').forsake()\n"
                "print('results written', flush=True)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "results written\nexit handlers ran\n"
    assert "1 gossip thread(s) still running (fgdiloco-meet rank 3 for mix1/0/11)" in proc.stderr
    # without a thread left, and through the script's own sys.exit(0): the same exit
    proc = life("import sys\nimport fgdiloco.runtime\nsys.exit(0)\n")
    assert (proc.returncode, proc.stdout) == (0, "exit handlers ran\n") and "gossip thread" not in proc.stderr
    # a script that fails keeps its status (torchrun restarts it)
    script.write_text("import sys\nsys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-m", "fgdiloco.elastic.life", str(script)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 3
    assert len([ln for ln in lives.read_text().splitlines() if '"start"' in ln]) == 3




def test_a_new_store_connection_after_the_server_died_fails_at_once_not_after_the_stores_timeout():
    """The pool's third concurrent user needs a new connection (a clone). A TCPStore clone retries its connect for
    the store's whole timeout (30 min for Lightning's or init_process_group's store): after the launcher's rank 0
    (which hosts the store) died, one such clone hung a rank that should have stopped at store_timeout (CI). The
    pool probes the server first and fails in about a second; connections through a PrefixStore are probed too."""
    port_r, port_w = os.pipe()  # child -> parent: the port
    end_r, end_w = os.pipe()  # parent -> child: die now
    pid = os.fork()
    if pid == 0:  # the server's process: serves until the parent says so, then dies
        try:
            server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), use_libuv=True)
            os.write(port_w, str(server.port).encode().ljust(8))
            os.read(end_r, 1)
        finally:
            os._exit(0)
    port = int(os.read(port_r, 8))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True)
    pool = StorePool(dist.PrefixStore("job", client))
    held = [pool.acquire(), pool.acquire()]  # the two warm connections are in use
    extra = pool.acquire()  # the server is up: a new connection works
    extra.set("k", "v")
    pool.release(extra)
    held.append(pool.acquire())
    os.write(end_w, b"x")
    os.waitpid(pid, 0)
    t0 = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="does not accept a connection"):
        pool.acquire()
    assert time.monotonic() - t0 < 3.0
