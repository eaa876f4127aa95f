"""Gossip schedules: doubly stochastic mixing, exact averaging, matchings every rank agrees on."""

from __future__ import annotations

import math

import pytest
import torch

from fgdiloco.factor import Dense, layout_fingerprint
from fgdiloco.gossip import (
    TOPOLOGIES,
    DistributedTransport,
    LocalHub,
    Mixer,
    make_topology,
)
from fgdiloco.testing import run_ranks

NAMES = sorted(TOPOLOGIES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m", range(2, 10))
def test_every_mixing_matrix_is_doubly_stochastic_and_symmetric(name, m):
    topo = make_topology(name, m, seed=3)
    for r in range(12):
        w = topo.mixing_matrix(r)
        assert w.shape == (m, m)
        assert torch.all(w >= 0)
        torch.testing.assert_close(w.sum(0), torch.ones(m, dtype=torch.float64))
        torch.testing.assert_close(w.sum(1), torch.ones(m, dtype=torch.float64))
        torch.testing.assert_close(w, w.T)


@pytest.mark.parametrize("name", ["random", "exponential", "ring"])
@pytest.mark.parametrize("m", range(1, 10))
def test_pairwise_topologies_are_matchings(name, m):
    topo = make_topology(name, m, seed=11)
    for r in range(20):
        for i in range(m):
            j = topo.peer(i, r)
            if j is not None:
                assert j != i and 0 <= j < m
                assert topo.peer(j, r) == i


@pytest.mark.parametrize("m", [2, 4, 6, 8])
def test_random_matching_is_perfect_for_even_m_and_changes_between_rounds(m):
    topo = make_topology("random", m, seed=5)
    seen = set()
    for r in range(30):
        peers = tuple(topo.peer(i, r) for i in range(m))
        assert None not in peers
        seen.add(peers)
    if m >= 4:
        assert len(seen) > 1  # fresh random peers, not one fixed pairing


def test_random_matching_leaves_exactly_one_out_for_odd_m():
    topo = make_topology("random", 7, seed=0)
    for r in range(20):
        assert sum(topo.peer(i, r) is None for i in range(7)) == 1


def test_random_matching_depends_on_seed():
    a = [make_topology("random", 8, seed=1).peer(0, r) for r in range(20)]
    b = [make_topology("random", 8, seed=2).peer(0, r) for r in range(20)]
    assert a != b


@pytest.mark.parametrize("m", [4, 8, 16])
def test_exponential_products_average_exactly_after_log2_m_rounds(m):
    topo = make_topology("exponential", m)
    d = int(math.log2(m))
    j = torch.full((m, m), 1.0 / m, dtype=torch.float64)
    for start in range(3):  # any log2 M consecutive rounds
        w = torch.eye(m, dtype=torch.float64)
        for r in range(start, start + d):
            w = topo.mixing_matrix(r) @ w
        torch.testing.assert_close(w, j, rtol=0, atol=1e-15)
    # and not before
    w = torch.eye(m, dtype=torch.float64)
    for r in range(d - 1):
        w = topo.mixing_matrix(r) @ w
    assert not torch.allclose(w, j)


def test_allreduce_is_the_exact_average():
    w = make_topology("allreduce", 5).mixing_matrix(0)
    torch.testing.assert_close(w, torch.full((5, 5), 0.2, dtype=torch.float64))


def test_ring_touches_every_edge_in_two_rounds():
    m = 6
    topo = make_topology("ring", m)
    edges = {frozenset((i, topo.peer(i, r))) for r in range(2) for i in range(m)}
    assert edges == {frozenset((i, (i + 1) % m)) for i in range(m)}


@pytest.mark.parametrize("m", [3, 5, 7, 9])
def test_ring_with_odd_m_uses_every_edge_including_the_wrap_around(m):
    topo = make_topology("ring", m)
    ring = {frozenset((i, (i + 1) % m)) for i in range(m)}
    counts = dict.fromkeys(ring, 0)
    for r in range(m):
        for i in range(m):
            j = topo.peer(i, r)
            if j is not None and i < j:
                counts[frozenset((i, j))] += 1
    assert set(counts) == ring  # never an edge outside the ring
    assert all(c == (m - 1) // 2 for c in counts.values()), counts  # every edge, equally often
    # the ring mixes like a ring, not a path: 3m rounds bring the disagreement far below a path's
    x = torch.eye(m, dtype=torch.float64)
    for r in range(3 * m):
        x = topo.mixing_matrix(r) @ x
    assert float((x - 1.0 / m).abs().max()) < 0.25


def test_random_matchings_use_all_64_bits_of_the_seed():
    a, b = make_topology("random", 16, 1), make_topology("random", 16, 1 + (1 << 40))
    assert [a.peer(0, r) for r in range(20)] != [b.peer(0, r) for r in range(20)]
    c = make_topology("random", 16, -1)  # negative seeds are seeds too (two's complement)
    assert [c.peer(0, r) for r in range(20)] == [make_topology("random", 16, (1 << 64) - 1).peer(0, r)
                                                  for r in range(20)]


def test_make_topology_rejects_unknown_names_and_types():
    with pytest.raises(ValueError, match="topology='star'.*allreduce.*exponential.*random.*ring"):
        make_topology("star", 4)
    with pytest.raises(TypeError, match="topology"):
        make_topology(3, 4)
    with pytest.raises(ValueError, match="world_size"):
        make_topology("ring", 0)


def _values(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]


def _exponential_mix(rank: int, world: int) -> list[list[float]]:
    transport = DistributedTransport(timeout=20.0)
    d = int(math.log2(world))
    like = _values(rank)
    fp = layout_fingerprint((str(i), t.shape, t.dtype) for i, t in enumerate(like))
    mixer = Mixer("mix1", make_topology("exponential", world), transport, Dense(), d, fp, 20.0)
    res = mixer.run(like, outer_round=0)
    assert res.failed == 0 and res.exchanges == d
    return [t.flatten().tolist() for t in res.values]


@pytest.mark.parametrize("m", [4, 8])
def test_exponential_real_multiprocess_mix_averages_exactly(tmp_path, m):
    results = run_ranks(_exponential_mix, m, tmp_path)
    mean = [sum(ts) / m for ts in zip(*[_values(r) for r in range(m)])]
    for res in results:
        for got, want in zip(res, mean):
            torch.testing.assert_close(torch.tensor(got).view(want.shape), want, rtol=0, atol=1e-6)


def _random_schedule(rank: int, world: int) -> tuple[list[list[int | None]], int]:
    topo = make_topology("random", world, seed=1234)
    schedule = [[topo.peer(i, r) for i in range(world)] for r in range(40)]
    # the schedule is computed locally; a real exchange shows the peers meet (no failure, no timeout)
    transport = DistributedTransport(timeout=20.0)
    like = _values(rank)
    fp = layout_fingerprint((str(i), t.shape, t.dtype) for i, t in enumerate(like))
    mixer = Mixer("mix1", topo, transport, Dense(), 3, fp, 20.0)
    return schedule, mixer.run(like, outer_round=0).failed


def test_random_matchings_agree_across_processes_without_talking(tmp_path):
    results = run_ranks(_random_schedule, 6, tmp_path)
    schedules = [s for s, _ in results]
    assert all(s == schedules[0] for s in schedules)
    assert all(failed == 0 for _, failed in results)


def _local_mix(topology: str, codec_factory, rounds: int, m: int = 4) -> dict[int, list[torch.Tensor]]:
    import threading

    hub = LocalHub(m)
    topo = make_topology(topology, m, seed=0)
    like = _values(0)
    fp = layout_fingerprint((str(i), t.shape, t.dtype) for i, t in enumerate(like))
    out: dict[int, list[torch.Tensor]] = {}

    def worker(rank: int) -> None:
        mixer = Mixer("mix2", topo, hub.transport(rank), codec_factory(), rounds, fp, 10.0)
        out[rank] = mixer.run([v.double() for v in _values(rank)], 0).values

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("codec", ["bf16", "lowrank-r1", "lowrank-r1-no-ef"])
def test_pairwise_gossip_preserves_the_sum_exactly_with_a_lossy_codec(codec):
    """The difference form: whatever the codec drops stays with its owner, so the workers' average (what DiLoCo
    would apply) is untouched, while the replicas still move towards each other."""
    from fgdiloco.factor import BF16, LowRank

    factory = {"bf16": BF16, "lowrank-r1": lambda: LowRank(rank=1, quantize=None),
               "lowrank-r1-no-ef": lambda: LowRank(rank=1, quantize=None, error_feedback=False)}[codec]
    m = 4
    out = _local_mix("random", factory, 2, m)
    for k in range(2):
        before = [_values(r)[k].double() for r in range(m)]
        after = [out[r][k] for r in range(m)]
        torch.testing.assert_close(sum(after), sum(before), rtol=0, atol=1e-12)
        spread = lambda xs: sum(float((x - sum(xs) / m).norm()) for x in xs)  # noqa: E731
        assert spread(after) < spread(before)


def test_exact_topology_with_a_lossy_codec_leaves_identical_replicas():
    from fgdiloco.factor import LowRank

    out = _local_mix("allreduce", lambda: LowRank(rank=1, quantize=None), 1)
    for r in range(1, 4):
        for a, b in zip(out[0], out[r]):
            assert torch.equal(a, b)
