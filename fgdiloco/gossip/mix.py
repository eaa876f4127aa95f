"""One gossip mix: ``r`` rounds of pairwise (or exact) averaging of a list of tensors through a codec.

Pairwise gossip (both mixes) uses the *difference* form ``x_i ← x_i + ½(q_j − q_i)``, where ``q`` is what the codec
transmits and each side computes ``q_i`` exactly as its peer decodes it. The pair's sum is preserved exactly, so
the average over workers (what DiLoCo would apply) is never changed by compression; the codec only limits how much
agreement one round buys. A worker's own value is never replaced by its compressed copy: for parameters (Mix1, bf16)
the rounding touches only the difference between replicas, and for pseudo-gradients (Mix2, e.g. low rank) each
worker applies all of its own pseudo-gradient at once, nothing waits for a later round. The first gossip round of a
mix encodes statefully (the codec's error feedback and warm start): over rounds, the sum of what a worker sent
tracks the sum of its inputs, so the accumulated correction ``½ Σ (q_j − q_i)`` tracks full pairwise averaging
(Vogels et al., PowerSGD, NeurIPS 2019, for the compressor; Koloskova et al., CHOCO-SGD, ICML 2019, for gossip of
compressed differences). Later gossip rounds of the same mix encode with the codec's state read-only.

The exact topology (``allreduce``) averages all workers at once: a lossless codec uses an all-reduce; a lossy one
all-gathers frames and every worker takes the mean of the decoded values (the compressed all-reduce of DiLoCo with
PowerSGD-style compression: the replicas stay identical and error feedback carries what was not sent).

A failed exchange, a rejected frame or a peer in back-off leaves the worker's row of the mixing matrix as the
identity for that gossip round (it keeps its own value), is counted in :class:`MixResult` and logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..factor.codec import Codec
from ..factor.frame import FrameError, decode_frame, encode_frame
from .topology import Topology
from .transport import ExchangeError, Transport

__all__ = ["MixResult", "Mixer", "PeerHealth"]

log = logging.getLogger("fgdiloco")


@dataclass
class MixResult:
    """What one mix did.

    Attributes:
        values: the mixed tensors (same shapes as the input).
        bytes_sent, bytes_received: frame bytes on the wire (headers included), summed over gossip rounds.
        exchanges: gossip rounds in which this worker had a peer (or took part in an all-reduce).
        failed: exchanges that failed, timed out, were rejected or skipped (peer in back-off).
        peers: this worker's peer in each gossip round (None: no peer; -1: all-reduce).
        consensus_distance: ``‖q(x_i) − q(x_peer)‖₂`` over all tensors (both as the codec transmits them, so equal
            replicas give exactly 0), from the first successful exchange, or None when there was none.
        seconds: wall time of the mix.
        errors: one line per failure.
    """

    values: list[torch.Tensor]
    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges: int = 0
    failed: int = 0
    peers: list[int | None] = field(default_factory=list)
    consensus_distance: float | None = None
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class PeerHealth:
    """Exponential back-off for peers that failed: after ``n`` consecutive failures a peer is skipped for
    ``min(2**(n-1), max_skip)`` outer rounds, so a dead peer costs one timeout, not one per round."""

    def __init__(self, max_skip: int = 32):
        self.max_skip = max_skip
        self._streak: dict[int, int] = {}
        self._until: dict[int, int] = {}
        self._lock = threading.Lock()

    def skip(self, peer: int, outer_round: int) -> bool:
        with self._lock:
            return outer_round < self._until.get(peer, -1)

    def failure(self, peer: int, outer_round: int) -> None:
        with self._lock:
            n = self._streak.get(peer, 0) + 1
            self._streak[peer] = n
            self._until[peer] = outer_round + 1 + min(2 ** (n - 1), self.max_skip)

    def success(self, peer: int) -> None:
        with self._lock:
            self._streak.pop(peer, None)
            self._until.pop(peer, None)


def _l2(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return float(sum(float(torch.sum((x.float() - y.float()) ** 2)) for x, y in zip(a, b)) ** 0.5)


class Mixer:
    """Runs one kind of mix (Mix1 or Mix2) for a worker.

    Args:
        name: ``"mix1"`` or ``"mix2"``: part of every exchange key, so the two mixes never meet on the wire.
        topology: the gossip schedule.
        transport: moves the frames.
        codec: compresses what is sent.
        rounds: gossip rounds per mix (``r1`` or ``r2``); 0 makes the mix the identity.
        fingerprint: the parameter-layout fingerprint checked in every frame.
        timeout: seconds per exchange.
        offset: added to the schedule index so that Mix1 and Mix2 of the same outer round pick different peers.
        health: shared peer back-off state.
    """

    def __init__(self, name: str, topology: Topology, transport: Transport | None, codec: Codec, rounds: int,
                 fingerprint: bytes, timeout: float, offset: int = 0, health: PeerHealth | None = None):
        self.name = name
        self.topology = topology
        self.transport = transport
        self.codec = codec
        self.rounds = rounds
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.offset = offset
        self.health = health or PeerHealth()

    def schedule_index(self, outer_round: int, k: int) -> int:
        return outer_round * self.rounds + k + self.offset

    def prepare(self, outer_round: int) -> None:
        """Let the transport set up this mix's exchanges of ``outer_round`` in the background (e.g. Mix2's pair
        groups while the inner steps run). Peers in back-off are left out, as :meth:`run` will skip them."""
        if self.transport is None or self.transport.world_size == 1 or self.topology.exact:
            return
        for k in range(self.rounds):
            idx = self.schedule_index(outer_round, k)
            peer = self.topology.peer(self.transport.rank, idx)
            if peer is not None and not self.health.skip(peer, outer_round):
                self.transport.prepare(peer, key=f"{self.name}/{idx}", timeout=self.timeout)

    def run(self, values: Sequence[torch.Tensor], outer_round: int) -> MixResult:
        """Mix ``values`` in outer round ``outer_round``. The inputs are never modified in place; the result holds
        new tensors, or the inputs themselves where nothing was exchanged."""
        t0 = time.perf_counter()
        res = MixResult(values=list(values))
        if self.transport is None or self.transport.world_size == 1 or self.rounds == 0:
            res.seconds = time.perf_counter() - t0
            return res
        for k in range(self.rounds):
            idx = self.schedule_index(outer_round, k)
            first = k == 0
            if self.topology.exact:
                self._exact_round(res, idx, first)
            else:
                self._pair_round(res, idx, first, outer_round)
        res.seconds = time.perf_counter() - t0
        return res

    def _fail(self, res: MixResult, msg: str) -> None:
        res.failed += 1
        res.errors.append(msg)
        log.warning("fgdiloco %s: %s; keeping own value for this gossip round", self.name, msg)

    def _pair_round(self, res: MixResult, idx: int, first: bool, outer_round: int) -> None:
        rank = self.transport.rank
        peer = self.topology.peer(rank, idx)
        res.peers.append(peer)
        if peer is None:
            return
        res.exchanges += 1
        if self.health.skip(peer, outer_round):
            self._fail(res, f"peer {peer} skipped (back-off after failures)")
            return
        body, own_q = self.codec.encode(res.values, stateful=first)
        frame = encode_frame(self.codec, body, sender=rank, round=idx, fingerprint=self.fingerprint,
                             shuffle=self.codec.shuffle)
        key = f"{self.name}/{idx}"
        try:
            got = self.transport.exchange(peer, frame, key=key, timeout=self.timeout)
        except ExchangeError as e:
            self.health.failure(peer, outer_round)
            self._fail(res, str(e))
            return
        res.bytes_sent += len(frame)
        res.bytes_received += len(got)
        try:
            peer_q = decode_frame(got, self.codec, res.values, fingerprint=self.fingerprint, sender=peer,
                                  round=idx)
        except FrameError as e:
            self._fail(res, f"rejected frame from rank {peer}: {e}")
            return
        self.health.success(peer)
        if res.consensus_distance is None:
            res.consensus_distance = _l2(own_q, peer_q)  # both as sent: 0 for equal replicas
        res.values = [v + 0.5 * (b - a) for v, a, b in zip(res.values, own_q, peer_q)]

    def _exact_round(self, res: MixResult, idx: int, first: bool) -> None:
        res.peers.append(-1)
        res.exchanges += 1
        m = self.transport.world_size
        key = f"{self.name}/{idx}"
        if self.codec.lossless:
            flat = torch.cat([v.reshape(-1).float().cpu() for v in res.values])
            try:
                self.transport.all_reduce_mean(flat, key=key, timeout=self.timeout)
            except ExchangeError as e:
                self._fail(res, str(e))
                return
            nbytes = 4 * flat.numel()
            # bytes of a ring all-reduce: 2 (M-1)/M of the buffer each way
            res.bytes_sent += 2 * (m - 1) * nbytes // m
            res.bytes_received += 2 * (m - 1) * nbytes // m
            off = 0
            out = []
            for v in res.values:
                out.append(flat[off : off + v.numel()].view(v.shape).to(device=v.device, dtype=v.dtype))
                off += v.numel()
            res.values = out
            return
        stateful = first
        rank = self.transport.rank
        body, own_q = self.codec.encode(res.values, stateful=stateful)
        frame = encode_frame(self.codec, body, sender=rank, round=idx, fingerprint=self.fingerprint,
                             shuffle=self.codec.shuffle)
        try:
            frames = self.transport.all_gather(frame, key=key, timeout=self.timeout)
        except ExchangeError as e:
            if stateful:
                res.values = own_q
            self._fail(res, str(e))
            return
        res.bytes_sent += len(frame) * (m - 1)
        decoded = [own_q]
        for src, f in enumerate(frames):
            if src == rank:
                continue
            res.bytes_received += len(f)
            try:
                decoded.append(decode_frame(f, self.codec, res.values, fingerprint=self.fingerprint,
                                            sender=src, round=idx))
            except FrameError as e:
                self._fail(res, f"rejected frame from rank {src}: {e}")
        mean = [sum(ts) / len(decoded) for ts in zip(*decoded)]
        if stateful:
            res.values = mean
        else:
            res.values = [v + (mu - a) for v, mu, a in zip(res.values, mean, own_q)]
