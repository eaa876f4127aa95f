"""Consensus safety of pairwise gossip (docs/gossip.md): a round never increases the workers' disagreement beyond the
codec's own quantisation floor, for every codec allowed in pairwise rounds, and always preserves the average."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fgdiloco.factor import BF16, Dense, Int8, LowRank
from fgdiloco.gossip import make_topology
from fgdiloco.gossip.mix import pair_round_in_process

EPS32 = torch.finfo(torch.float32).eps

CODECS = {
    "dense": lambda: Dense(),
    "bf16": lambda: BF16(),
    "int8": lambda: Int8(block=64),
    "lowrank-r1-int8": lambda: LowRank(rank=1),
    "lowrank-r4-int8": lambda: LowRank(rank=4),
    "lowrank-r2-bf16": lambda: LowRank(rank=2, quantize="bf16"),
    "lowrank-r1-fp32": lambda: LowRank(rank=1, quantize="fp32"),
    "lowrank-r4-fp32": lambda: LowRank(rank=4, quantize="fp32"),
}
LOSSLESS = {"dense", "lowrank-r1-fp32", "lowrank-r4-fp32"}


def disagreement(xs: list[list[torch.Tensor]]) -> float:
    """‖(I − J) X‖_F over all tensors, in float64."""
    total = 0.0
    for parts in zip(*xs):
        stacked = torch.stack([p.double() for p in parts])
        total += float(torch.sum((stacked - stacked.mean(0)) ** 2))
    return math.sqrt(total)


def frob(xs: list[list[torch.Tensor]]) -> float:
    return math.sqrt(sum(float(torch.sum(p.double() ** 2)) for x in xs for p in x))


def workers(m: int, shape: tuple[int, int], shared: float, seed: int, rounds: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    common = [torch.randn(*shape, generator=g) * shared, torch.randn(shape[1], generator=g) * shared]
    return [[common[0] + torch.randn(*shape, generator=g), common[1] + torch.randn(shape[1], generator=g)]
            for _ in range(m)]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(CODECS)), m=st.integers(2, 16), rows=st.integers(8, 40),
       cols=st.integers(8, 48), shared=st.sampled_from([0.0, 1.0, 1000.0]), seed=st.integers(0, 2**31 - 1),
       warm=st.integers(0, 2))
def test_a_pairwise_round_never_increases_disagreement_beyond_the_floor_and_keeps_the_average(
        name, m, rows, cols, shared, seed, warm):
    codecs = [CODECS[name]() for _ in range(m)]
    topo = make_topology("random", m, seed)
    xs = workers(m, (rows, cols), shared, seed)
    for r in range(warm):  # earlier rounds leave different warm starts on different workers
        xs, _ = pair_round_in_process(codecs, xs, [topo.peer(i, r) for i in range(m)])
    partner = [topo.peer(i, warm) for i in range(m)]
    before, scale = disagreement(xs), frob(xs)
    mixed, floors = pair_round_in_process(codecs, xs, partner)
    after = disagreement(mixed)
    rounding = 16 * EPS32 * scale  # fp32 storage and arithmetic of values of this size
    bound = math.sqrt(before**2 + sum(f * f for f in floors)) + rounding
    assert after <= bound, (name, before, after, floors)
    if name in LOSSLESS:  # no floor at all, even when the shared part is 1000x the disagreement
        assert max(floors) <= rounding
        assert after <= before + rounding, (name, before, after)
    # the average is preserved: c_j = −c_i bit for bit, so only the fp32 rounding of x + c remains
    for t in range(2):
        mean_before = torch.stack([x[t].double() for x in xs]).mean(0)
        mean_after = torch.stack([x[t].double() for x in mixed]).mean(0)
        assert float((mean_after - mean_before).abs().max()) <= 4 * EPS32 * max(1.0, float(mean_before.abs().max())
                                                                               + before)


@pytest.mark.parametrize("shared", [0.0, 1000.0])
@pytest.mark.parametrize("rank", [1, 4])
def test_lowrank_gossip_contracts_where_per_worker_powersgd_expanded(shared, rank):
    """The issue's synthetic table (M = 8, random matching, 64 × 96, shared component + per-worker noise): every
    low-rank ratio is now ≤ 1 in every round, with fp32 numbers, also when the shared part dominates."""
    m = 8
    codecs = [LowRank(rank=rank, quantize="fp32") for _ in range(m)]
    topo = make_topology("random", m, 5)
    xs = workers(m, (64, 96), shared, 11)
    for r in range(6):
        before = disagreement(xs)
        xs, _ = pair_round_in_process(codecs, xs, [topo.peer(i, r) for i in range(m)])
        assert disagreement(xs) <= before * (1 + 1e-5)


def test_a_pair_agreed_basis_recovers_a_disagreement_of_rank_r_exactly():
    """Workers whose values lie in a common rank-3 column space (shared rank-1 part, rank-2 difference): the
    pair-agreed rank-4 basis spans it, so one round averages them exactly (to fp32 rounding)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(30, 1, generator=g) @ torch.randn(1, 40, generator=g) * 10
    u, v = torch.randn(30, 2, generator=g), torch.randn(2, 40, generator=g)
    xs = [[base + u @ v, torch.ones(3)], [base - u @ v, -torch.ones(3)]]
    mixed, _ = pair_round_in_process([LowRank(rank=4, quantize="fp32") for _ in range(2)], xs, [1, 0])
    assert disagreement(mixed) < 1e-5 * disagreement(xs)
    torch.testing.assert_close(mixed[0][0], base, atol=1e-4, rtol=0)


def test_two_lowrank_rounds_on_the_exponential_graph_average_four_workers_exactly_where_one_round_cannot():
    """Mix2 with ``topology="exponential", mix2_rounds=2`` on 4 workers (benchmarks/RESULTS.md, "Two Mix2 rounds on
    the exponential graph"): the two pair rounds of one outer round (schedule indices 1 and 2: Mix2's offset 1)
    pair each worker along both dimensions, so where every pair's difference lies in a common rank-2 space the
    pair-agreed rank-4 bases average each pair exactly and the two rounds give every worker the mean of all four;
    after the first round the two halves still disagree."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(24, 1, generator=g) @ torch.randn(1, 32, generator=g) * 10
    direction = torch.randn(24, 2, generator=g) @ torch.randn(2, 32, generator=g)
    scales = [3.0, -1.0, 0.5, -2.5]
    xs = [[base + a * direction, torch.full((5,), a)] for a in scales]
    mean = [torch.stack([x[t] for x in xs]).mean(0) for t in range(2)]
    topo = make_topology("exponential", 4)
    codecs = [LowRank(rank=4, quantize="fp32") for _ in range(4)]
    schedule = [1, 2]  # Mixer.schedule_index(0, k) = 0 * rounds + k + offset, for k = 0, 1
    first, _ = pair_round_in_process(codecs, xs, [topo.peer(i, schedule[0]) for i in range(4)])
    assert disagreement(first) > 0.1 * disagreement(xs)
    second, _ = pair_round_in_process(codecs, first, [topo.peer(i, schedule[1]) for i in range(4)])
    assert disagreement(second) < 1e-5 * disagreement(xs)
    for x in second:
        torch.testing.assert_close(x[0], mean[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(x[1], mean[1], atol=1e-5, rtol=0)
