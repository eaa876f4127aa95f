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
    "lowrank-r4-int8-joint": lambda: LowRank(rank=4, pair_basis="joint"),
    "lowrank-r2-fp32-joint": lambda: LowRank(rank=2, quantize="fp32", pair_basis="joint"),
}
LOSSLESS = {"dense", "lowrank-r1-fp32", "lowrank-r4-fp32", "lowrank-r2-fp32-joint"}


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


def _shared_and_difference(seed: int, shared_rank: int, diff_rank: int, rows: int = 40, cols: int = 48
                           ) -> list[list[torch.Tensor]]:
    """Two workers: a large shared part of rank ``shared_rank`` (1000x) plus and minus a difference of rank
    ``diff_rank`` in other directions."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(rows, shared_rank, generator=g) @ torch.randn(shared_rank, cols, generator=g) * 1000
    half = torch.randn(rows, diff_rank, generator=g) @ torch.randn(diff_rank, cols, generator=g)
    return [[shared + half, torch.zeros(3)], [shared - half, torch.zeros(3)]]


def test_the_difference_basis_averages_a_pair_whose_difference_has_rank_r_where_the_joint_basis_does_not():
    """The part a pair round leaves is ``(I − P̂P̂ᵀ)(Δ_j − Δ_i)``: a basis built from the pair's difference removes a
    rank-2 difference in one rank-4 round however large the shared part, while the joint basis (the pair's top
    directions, here the shared part's rank 8) leaves most of it."""
    xs = _shared_and_difference(3, shared_rank=8, diff_rank=2)
    before = disagreement(xs)
    diff, _ = pair_round_in_process([LowRank(rank=4, quantize="fp32") for _ in range(2)], xs, [1, 0])
    joint, _ = pair_round_in_process([LowRank(rank=4, quantize="fp32", pair_basis="joint") for _ in range(2)], xs,
                                     [1, 0])
    assert disagreement(diff) < 1e-6 * frob(xs)  # exact, to the fp32 rounding of values 1000x larger
    assert disagreement(joint) > 0.5 * before


def test_a_pairs_warm_start_is_kept_per_peer_and_converges_to_the_top_subspace_of_its_difference():
    """Subspace iteration across rounds: the same pair meeting again with the same values (difference of rank 12
    with a spectral gap after 4) starts from the warm start both kept for each other, so the rank-4 round's residual
    falls to the SVD optimum; both sides hold bit-identical warm starts for each other, none for a peer never met."""
    g = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(40, 12, generator=g)).Q
    v = torch.linalg.qr(torch.randn(48, 12, generator=g)).Q
    spectrum = torch.tensor([10.0, 9.0, 8.0, 7.0] + [1.0 / (k + 1) for k in range(8)])
    half = u @ torch.diag(spectrum) @ v.T
    shared = torch.randn(40, 48, generator=g) * 100
    xs = [[shared + half, torch.zeros(3)], [shared - half, torch.zeros(3)]]
    optimum = 2 * float(spectrum[4:].pow(2).sum().sqrt()) / math.sqrt(2)  # ‖(I − J)X‖ of the SVD's rank-4 tail
    codecs = [LowRank(rank=4, quantize="fp32") for _ in range(2)]
    residuals = []
    for _ in range(6):
        mixed, _ = pair_round_in_process(codecs, xs, [1, 0])
        residuals.append(disagreement(mixed))
    assert residuals[0] > 1.5 * optimum
    assert residuals[-1] < 1.01 * optimum
    mine, theirs = codecs[0].state_dict()["pair_q"], codecs[1].state_dict()["pair_q"]
    assert [peer for peer, _ in mine] == [1] and [peer for peer, _ in theirs] == [0]
    assert mine[0][1].keys() == theirs[0][1].keys() == {0}
    assert torch.equal(mine[0][1][0], theirs[0][1][0])


def test_a_pair_whose_warm_starts_differ_still_keeps_its_average_and_agrees_again_after_the_exchange():
    """One side lost its warm start for the other (a restart, or the two-generals window): both still build the same
    basis from the transmitted messages, so the round keeps the average and does not increase the disagreement; after
    it both hold the same warm start again."""
    xs = _shared_and_difference(7, shared_rank=3, diff_rank=10)
    codecs = [LowRank(rank=4, quantize="fp32") for _ in range(2)]
    xs, _ = pair_round_in_process(codecs, xs, [1, 0])
    codecs[1].load_state_dict({**codecs[1].state_dict(), "pair_q": []})  # worker 1 forgot worker 0
    before = disagreement(xs)
    mixed, _ = pair_round_in_process(codecs, xs, [1, 0])
    assert disagreement(mixed) <= before * (1 + 1e-5)
    for t in range(2):
        torch.testing.assert_close((mixed[0][t] + mixed[1][t]).double(), (xs[0][t] + xs[1][t]).double(),
                                   atol=1e-2, rtol=1e-6)  # fp32 rounding of values ~3000 in size
    assert torch.equal(codecs[0].state_dict()["pair_q"][0][1][0], codecs[1].state_dict()["pair_q"][0][1][0])
