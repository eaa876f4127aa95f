"""Gossip topologies: who mixes with whom in each gossip round.

Every pairwise topology here is a *matching* per round: worker ``i`` has at most one peer ``j`` and then
``peer(j) == i``. Mixing a pair with weight ½ gives a symmetric, doubly stochastic mixing matrix ``W`` (rows and
columns sum to 1), so gossip preserves the average of the workers' values exactly. A worker without a peer in a
round keeps its own value (its row of ``W`` is the identity row).

``"allreduce"`` is the exact average ``J = 11ᵀ/M``: with it Factored Gossip DiLoCo is DiLoCo (Douillard et al.,
arXiv 2311.08105). The exponential graph follows Ying et al., "Exponential Graph is Provably Efficient for
Decentralized Deep Training" (NeurIPS 2021), whose one-peer variant averages exactly after log2(M) rounds when M is
a power of two.
"""

from __future__ import annotations

import abc
import math
import random
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["Topology", "ExponentialTopology", "RandomTopology", "RingTopology", "AllReduceTopology",
           "make_topology", "TOPOLOGIES", "Step", "PAIR", "GROUP", "IDLE"]

PAIR, GROUP, IDLE = "pair", "group", "idle"


@dataclass(frozen=True)
class Step:
    """What one worker does in one gossip round: the one plan the mixer executes (no special cases elsewhere).

    Attributes:
        kind: ``"pair"`` (mix with ``peer`` with weight ½), ``"group"`` (exact average over all workers: row of
            ``J``) or ``"idle"`` (keep its own value: identity row).
        peer: the peer's rank for ``"pair"``, else None.
    """

    kind: str
    peer: int | None = None


class Topology(abc.ABC):
    """A gossip schedule over ``world_size`` workers.

    Args:
        world_size: number of workers M (>= 1).
        seed: seed of random schedules; every worker must use the same one (schedules are computed locally, never
            negotiated).
    """

    name: str = ""
    #: True when one gossip round is the exact average (all-reduce) instead of pairwise exchanges.
    exact: bool = False

    def __init__(self, world_size: int, seed: int = 0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.seed = int(seed)

    @abc.abstractmethod
    def peer(self, rank: int, round: int) -> int | None:
        """The peer of ``rank`` in gossip round ``round`` (>= 0), or None when it keeps its own value."""

    def step(self, rank: int, round: int) -> Step:
        """The :class:`Step` of ``rank`` in gossip round ``round``: pair with :meth:`peer`, or idle."""
        peer = self.peer(rank, round)
        return Step(IDLE) if peer is None else Step(PAIR, peer)

    def mixing_matrix(self, round: int) -> torch.Tensor:
        """The M×M float64 mixing matrix of gossip round ``round``: ``x_new = W @ x`` (one row per worker)."""
        m = self.world_size
        w = torch.eye(m, dtype=torch.float64)
        for i in range(m):
            j = self.peer(i, round)
            if j is not None:
                w[i, i] = 0.5
                w[i, j] = 0.5
        return w

    def _check(self, rank: int, round: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        if round < 0:
            raise ValueError(f"round must be >= 0, got {round}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, seed={self.seed})"


class ExponentialTopology(Topology):
    """One-peer exponential graph as a matching: in round k worker i pairs with ``i XOR 2**(k mod ⌈log2 M⌉)``.

    A worker whose partner index is >= M keeps its own value. When M is a power of two, any ⌈log2 M⌉ consecutive
    rounds multiply to the exact average J.
    """

    name = "exponential"

    def __init__(self, world_size: int, seed: int = 0):
        super().__init__(world_size, seed)
        self.dims = max(1, math.ceil(math.log2(world_size))) if world_size > 1 else 0

    def peer(self, rank: int, round: int) -> int | None:
        self._check(rank, round)
        if self.dims == 0:
            return None
        j = rank ^ (1 << (round % self.dims))
        return j if j < self.world_size else None


class RandomTopology(Topology):
    """A fresh uniformly random perfect matching every round, drawn from ``(seed, round)`` (all 64 bits of the seed
    count).

    All workers draw the same matching without talking. With M odd, one worker per round keeps its own value.
    """

    name = "random"

    def peer(self, rank: int, round: int) -> int | None:
        self._check(rank, round)
        return _random_matching(self.world_size, self.seed, round)[rank]


@lru_cache(maxsize=256)
def _random_matching(m: int, seed: int, round: int) -> tuple[int | None, ...]:
    order = list(range(m))
    # random.Random(int) is deterministic across processes and platforms (unlike hash()) and uses every bit of an
    # arbitrary-size int: seed (64 bits, two's complement) and round are packed without overlap.
    random.Random(((seed % (1 << 64)) << 64) | round).shuffle(order)
    partner: list[int | None] = [None] * m
    for a, b in zip(order[0::2], order[1::2]):
        partner[a], partner[b] = b, a
    return tuple(partner)


class RingTopology(Topology):
    """A ring gossiped one matching at a time.

    M even: even rounds pair (0,1), (2,3), ...; odd rounds (1,2), (3,4), ..., (M-1,0); two consecutive rounds touch
    every edge once. M odd: round k pairs (s, s+1), (s+2, s+3), ... (mod M) starting at ``s = k mod M``, leaving
    worker ``s − 1`` out; the start rotates, so every edge, the wrap-around one included, is used
    (M − 1)/2 times in any M consecutive rounds (a plain two-colouring would never use the wrap-around edge and mix
    like a path, about 3× slower).
    """

    name = "ring"

    def peer(self, rank: int, round: int) -> int | None:
        self._check(rank, round)
        m = self.world_size
        if m == 1:
            return None
        if m == 2:
            return 1 - rank
        shift = round % 2 if m % 2 == 0 else round % m
        pos = (rank - shift) % m
        # pairs (shift + 2k, shift + 2k + 1) mod m for 2k + 1 < m, i.e. pos in [0, 2*(m//2))
        if pos >= 2 * (m // 2):
            return None
        mate = pos + 1 if pos % 2 == 0 else pos - 1
        return (mate + shift) % m


class AllReduceTopology(Topology):
    """The exact average: ``W = J``. One all-reduce per gossip round; this is DiLoCo's synchronisation."""

    name = "allreduce"
    exact = True

    def peer(self, rank: int, round: int) -> int | None:
        self._check(rank, round)
        return None

    def step(self, rank: int, round: int) -> Step:
        self._check(rank, round)
        return Step(GROUP) if self.world_size > 1 else Step(IDLE)

    def mixing_matrix(self, round: int) -> torch.Tensor:
        m = self.world_size
        return torch.full((m, m), 1.0 / m, dtype=torch.float64)


TOPOLOGIES: dict[str, type[Topology]] = {
    cls.name: cls for cls in (RandomTopology, ExponentialTopology, RingTopology, AllReduceTopology)
}


def make_topology(name: str | Topology, world_size: int, seed: int = 0) -> Topology:
    """Build a topology by name: ``"random"``, ``"exponential"``, ``"ring"`` or ``"allreduce"``.

    A :class:`Topology` instance is returned unchanged (its world size must equal ``world_size``).

    Raises:
        ValueError: unknown name or a world size that does not match.
        TypeError: ``name`` is neither a string nor a Topology.
    """
    if isinstance(name, Topology):
        if name.world_size != world_size:
            raise ValueError(f"topology is built for world_size={name.world_size}, the group has {world_size}")
        return name
    if not isinstance(name, str):
        raise TypeError(f"topology must be a name or a Topology, got {type(name).__name__}")
    key = name.lower()
    if key not in TOPOLOGIES:
        raise ValueError(f"topology={name!r} is not known; use one of {sorted(TOPOLOGIES)}")
    return TOPOLOGIES[key](world_size, seed)
