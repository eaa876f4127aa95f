"""Gossip on real Gloo ranks: equal to a mixing-matrix reference, exchanges applied by both peers or neither,
skip notices, and the exact topology that stays exact (bit-identical replicas, re-sync after a split)."""

from __future__ import annotations

import threading
import time

import torch

import fgdiloco.gossip.mix as mixmod
from fgdiloco import FGDiLoCo, LocalHub, LowRank
from fgdiloco.factor import Dense, FrameError
from fgdiloco.gossip import DistributedTransport, make_topology
from fgdiloco.gossip.mix import Mixer, _digest
from fgdiloco.testing import run_ranks
from tests.reference import INNER_LR, gossip_reference, loss_of, make_model

H = 3


def _gossip_train(rank: int, world: int, rounds: int, mix_momentum: bool) -> list[list[float]]:
    model = make_model(seed=rank)  # different initial weights on every rank
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, topology="random",
                   codec="dense", mix1_codec="dense", broadcast_init=False, mix_momentum=mix_momentum, seed=7,
                   timeout=20.0)
    for step in range(rounds * H):
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    assert opt.failed_exchanges_total == 0
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_random_gossip_equals_the_mixing_matrix_reference_in_float32(tmp_path):
    rounds, m, seed = 6, 4, 7
    t1, t2 = make_topology("random", m, seed), make_topology("random", m, seed + 1)
    for mix_momentum in (True, False):
        got = run_ranks(_gossip_train, m, tmp_path, rounds, mix_momentum)
        want = gossip_reference([make_model(seed=r).state_dict() for r in range(m)], rounds, H,
                                w1=lambda t: [t1.mixing_matrix(t)], w2=lambda t: [t2.mixing_matrix(t + 1)],
                                mix_momentum=mix_momentum)
        for rank in range(m):
            for g, w in zip(got[rank], want[rank]):
                torch.testing.assert_close(torch.tensor(g).view(w.shape), w, rtol=0, atol=1e-5)
        assert got[0] != got[1]


# ------------------------------------------------------------------ one exchange: both sides or neither
def _two_local_mixers(drop) -> list:
    hub = LocalHub(2, drop=drop)
    topo = make_topology("random", 2, 0)
    out: list = [None, None]

    def work(rank: int) -> None:
        mixer = Mixer("mix2", topo, hub.transport(rank), Dense(), 1, b"\0" * 8, timeout=0.5, offset=1)
        out[rank] = mixer.run([torch.full((5,), float(rank))], 0)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_an_exchange_whose_peer_is_gone_is_not_waited_for_at_exit():
    """The peer never comes and the membership finds it dead: the exchange fails at once (a failure, not a skip),
    and its thread, still waiting inside the transport until its own deadline, is not one the exit drain waits for
    (a finished worker waited up to 120 s at exit for such an exchange with a partner that had died)."""
    from fgdiloco.gossip.membership import Membership
    from fgdiloco.runtime import running_background

    class PeerDies(Membership):
        def gone(self, peer: int, since: float) -> str | None:
            return "no heartbeat for 5.0 s" if time.monotonic() - since > 0.2 else None

    t = LocalHub(2).transport(0)
    t.membership = PeerDies(0, 2)
    mixer = Mixer("mix2", make_topology("random", 2, 0), t, Dense(), 1, b"\0" * 8, join_timeout=30.0,
                  exchange_timeout=30.0, offset=1)
    t0 = time.monotonic()
    res = mixer.run([torch.ones(5)], 0)
    assert time.monotonic() - t0 < 5.0 and res.failed == 1 and "the peer is gone" in res.errors[0], res.errors
    assert torch.equal(res.values[0], torch.ones(5))  # it kept its own value
    assert not [w for w in running_background() if "mix2/" in w], running_background()


def test_when_only_the_peers_payload_arrives_both_keep_their_own_values(caplog):
    # rank 0's frame (message 0 of the conversation) is lost on the way to rank 1; rank 1's reaches rank 0
    with caplog.at_level("WARNING", logger="fgdiloco"):
        res = _two_local_mixers(lambda key, src, dst, pos: src == 0 and pos == 0)
    for rank in (0, 1):
        assert torch.equal(res[rank].values[0], torch.full((5,), float(rank))), res[rank].values
        assert res[rank].failed == 1
        # each worker's warning names it: the lines of a job's workers end up side by side
        assert f"fgdiloco rank {rank} mix2: " in caplog.text, caplog.text
    # without the fault both mix
    res = _two_local_mixers(None)
    assert all(torch.equal(r.values[0], torch.full((5,), 0.5)) for r in res)


def _reject_once(rank: int, world: int) -> list:
    if rank == 1:  # rank 1 rejects the first frame it receives
        real, calls = mixmod.decode_frame, []

        def picky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise FrameError("injected rejection")
            return real(*args, **kwargs)

        mixmod.decode_frame = picky
    t = DistributedTransport(timeout=10.0)
    mixer = Mixer("mix2", make_topology("random", 2, 0), t, Dense(), 1, b"\0" * 8, timeout=10.0)
    out = []
    for outer in range(2):
        r = mixer.run([torch.full((3,), float(rank))], outer)
        out.append((r.values[0].tolist(), r.failed))
    return out


def test_a_frame_rejected_at_one_receiver_leaves_both_peers_with_their_own_values(tmp_path):
    res = run_ranks(_reject_once, 2, tmp_path)
    for rank in (0, 1):
        assert res[rank][0] == ([float(rank)] * 3, 1)  # both keep, both count it
        assert res[rank][1] == ([0.5] * 3, 0)  # the next exchange mixes


def _skipping(rank: int, world: int) -> float:
    t = DistributedTransport(timeout=10.0)
    mixer = Mixer("mix2", make_topology("random", 2, 0), t, Dense(), 1, b"\0" * 8, timeout=10.0)
    if rank == 0:
        mixer.health.failure(1, 0)  # rank 0 backs off from rank 1 for rounds 0 and 1
    t0 = time.perf_counter()
    r = mixer.run([torch.zeros(3)], 0)
    assert (r.failed, r.skipped) == (0, 1)  # the back-off skip and the peer's declined exchange: no timeout spent
    return time.perf_counter() - t0


def test_a_worker_that_skips_an_exchange_does_not_make_its_peer_wait(tmp_path):
    seconds = run_ranks(_skipping, 2, tmp_path)
    assert max(seconds) < 2.0, seconds  # the timeout is 10 s


# ------------------------------------------------------------------ the exact topology stays exact
SPLIT_AT, REJECT_AT, ROUNDS = 10, 20, 30


def _exact_run(rank: int, world: int, broadcast_init: bool) -> dict:
    if rank == 2:  # one receiver rejects rank 1's frame in round REJECT_AT
        real, state = mixmod.decode_frame, {"round": -1}

        def picky(data, codec, like, *, fingerprint, sender=None, round=None, **kwargs):
            if state["round"] == REJECT_AT and sender == 1:
                raise FrameError("injected rejection")
            return real(data, codec, like, fingerprint=fingerprint, sender=sender, round=round, **kwargs)

        mixmod.decode_frame = picky
    model = make_model(seed=0 if broadcast_init else rank)
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, topology="allreduce",
                   codec=LowRank(rank=2), broadcast_init=broadcast_init, timeout=20.0)
    if rank == 3:  # a fault splits one replica: its outer step of round SPLIT_AT comes out slightly off
        real_commit = opt.outer.commit

        def faulty_commit(indices, theta, merge_alpha=0.0):
            if opt.round == SPLIT_AT:
                theta = [theta[0] + 1e-3, *theta[1:]]
            real_commit(indices, theta, merge_alpha)

        opt.outer.commit = faulty_commit
    digests, resynced, failed = [], [], []
    for step in range(ROUNDS * H):
        if rank == 2:
            state["round"] = opt.round
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % H == 0:
            digests.append(_digest(list(model.parameters()) + opt.outer.momentum).hex())
            resynced.append(opt.last_round.resynced)
            failed.append(opt.last_round.failed_exchanges)
    return {"digests": digests, "resynced": resynced, "failed": failed}


def test_exact_topology_with_lowrank_keeps_replicas_bit_identical_and_resyncs_a_split(tmp_path):
    res = run_ranks(_exact_run, 4, tmp_path, True)
    for t in range(ROUNDS):
        same = len({r["digests"][t] for r in res}) == 1
        assert same == (t != SPLIT_AT), (t, [r["digests"][t] for r in res])
    # the split replica was found and averaged back by the next round's Mix1, on every worker alike
    assert all([i for i, x in enumerate(r["resynced"]) if x] == [SPLIT_AT + 1] for r in res)
    # the rejected frame was left out of the mean by every worker (so the replicas did not split), and counted by
    # the worker that rejected it and by its sender
    assert res[2]["failed"][REJECT_AT] == 1 and res[1]["failed"][REJECT_AT] == 1


def test_exact_topology_without_broadcast_is_identical_after_the_first_round(tmp_path):
    res = run_ranks(_exact_run, 4, tmp_path, False)
    assert all(r["resynced"][0] for r in res)
    for t in range(ROUNDS):
        assert (len({r["digests"][t] for r in res}) == 1) == (t != SPLIT_AT), t
