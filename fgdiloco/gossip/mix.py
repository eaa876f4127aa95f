"""One gossip mix: ``r`` gossip rounds over a list of tensors, each round one :class:`~fgdiloco.gossip.topology.Step`
of the topology's plan (pair, group or idle), executed by one loop.

**Pair** (random, exponential, ring). The codec's pair session (:meth:`fgdiloco.factor.Codec.pair_session`) runs
on a channel to the peer and ends in a correction ``c_i`` with ``c_j = −c_i`` bit for bit: the pair's sum, hence the
workers' average, is preserved whatever the codec drops, and the round is consensus-safe (docs/gossip.md): the
disagreement ``‖(I−J)X‖_F`` never grows beyond the codec's quantisation floor. Then a one-byte accept/reject each
way: **an exchange is applied by both sides or by neither** (a frame rejected at one receiver, or a payload that
never arrives, leaves both peers with their own values) and codec state (warm starts) is committed only when it
was applied. Only a failure inside the final accept/reject byte itself can still split the pair's decision (one
side got the peer's accept, the other timed out waiting for it): the two-generals window, one 1-byte round trip
wide. A worker that skips the exchange (peer in back-off) posts a skip notice so its peer does not wait.

**Group** (``allreduce``). The exact average over all workers, computed identically on every worker: a lossless
codec uses the all-reduce (Gloo's result is bit-identical on every rank); a lossy one all-gathers frames, every
worker decodes all of them, the workers agree on which frames every one accepted (a second, tiny all-gather) and
sum exactly those in rank order. With ``resync=True`` (Mix1 of the exact topology) the group step first compares
an 8-byte digest of every worker's values and only averages, losslessly, when they differ: replicas split by a
fault or started from different weights are re-synced within one round; identical replicas cost one tiny
all-gather.

**Idle**: the worker keeps its own value.

A failed, rejected, declined or skipped exchange leaves the worker's row of the mixing matrix as the identity for
that gossip round (it keeps its own value), is counted in :class:`MixResult` (``failed``, or ``skipped`` when no
timeout was spent: the peer left, declined, is absent, restarted or ahead, or is in back-off) and logged.

**Deadlines.** Until the peer's first payload arrives, a pair exchange waits at most ``join_timeout`` and only
while the peer is live: one supervision loop (:func:`fgdiloco.runtime.supervise`) asks the membership every
0.25 s, so a dead, hung (SIGSTOPped) or departed peer costs at most ``liveness`` (2 s;
1 s once another worker saw its connection reset), a side that gave up the exchange ends its peer's wait at once, a
peer that fell ``CATCH_UP_ROUNDS`` behind the job's median round (it hung; it catches up at its next round start:
:meth:`~fgdiloco.gossip.membership.Membership.lagging`) is skipped at once, and a live peer that is late because it
lost time to a dead third one is waited for (exchanges between live peers do not fail in a cascade).
After the first payload the rest of the conversation is bounded by the *adaptive deadline* (:meth:`Mixer.deadline`):
``max(1 s + 3·median, median + 6·MAD)`` of the last 16 successful conversations of this mix (measured from the
first payload to the accept byte), at most ``exchange_timeout``, and ``exchange_timeout`` itself until 5 have been
measured. Group steps (the exact topology) are bounded by ``collective_timeout``.

**Values out of scale.** Before a peer's message is mixed in, its norm is compared with this worker's own
message of the same quantity: ``‖q_peer‖ > max_ratio·‖own‖ + 1e-6·√n`` (``max_ratio`` 100 in ``FGDiLoCo``, n elements)
rejects the exchange on both sides through the abort path, is counted (:attr:`MixResult.out_of_scale`) and logged,
so one broken or malicious peer cannot blow up a replica. Honest replicas are within a few percent of each other.
Frames are authenticated with the job secret when one is set (:func:`fgdiloco.factor.frame.job_secret`).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..config import FGDiLoCoConfig
from ..factor.codec import Codec, CodecError, PairOutcome, sq_norm
from ..factor.frame import FrameError, decode_frame, encode_frame
from ..runtime import Background, ExchangeError, supervise
from .topology import GROUP, IDLE, PAIR, Topology
from .transport import PeerDeclined, PeerGone, Transport, gone_error

__all__ = ["MixResult", "Mixer", "PeerHealth", "pair_round_in_process"]

log = logging.getLogger("fgdiloco")

_ABORT = b"FGDL/abort"  # sent instead of the next frame, or of the accept byte, by a side that gives up
_ACCEPT = b"\x01"
MAX_RATIO = 100.0  # a peer's message may be at most this many times our own in norm (plus SCALE_EPS per element)
SCALE_EPS = 1e-6  # RMS per element added to the bound, so that all-zero values (round 0's momentum) still mix
DEADLINE_SAMPLES = 16  # successful conversations the adaptive deadline is measured over
DEADLINE_MIN_SAMPLES = 5  # before that many, the deadline is ``timeout``
DEADLINE_MADS = 6.0  # deadline = median + this many MADs ...
DEADLINE_FLOOR = (1.0, 3.0)  # ... but at least 1 s + 3 x the median


class _Rejected(ExchangeError):
    """We rejected the peer's frame (or our own input), or the peer rejected ours: no one is to blame for a
    timeout, and the peer is not put in back-off."""


class _OutOfScale(_Rejected):
    """The peer's values were far out of scale against ours (``MAX_RATIO``)."""


@dataclass
class MixResult:
    """What one mix did.

    Attributes:
        values: the mixed tensors (same shapes as the input).
        bytes_sent, bytes_received: bytes on the wire (frames with their headers, accept bytes, digests), summed
            over gossip rounds.
        exchanges: gossip rounds in which this worker had a peer (or took part in a group average).
        failed: exchanges that failed, timed out or were rejected (a bad frame, out of scale, aborted by the peer).
        skipped: exchanges not made, with no timeout spent: the peer had left, its slot was empty, it restarted or
            moved on to a later outer round, it declined (it is backing off from this worker), or this worker is
            backing off from it (:class:`PeerHealth`). Not in ``failed``.
        peers: this worker's peer in each gossip round (None: idle; -1: group average).
        distance_sq: per tensor, the squared disagreement ``‖q(x_i) − q(x_peer)‖²`` of the first successful
            exchange (as transmitted; for a group step ``2‖x_i − x̄‖²``, the same scale), or None.
        norm_sq: per tensor, ``‖x_i‖²`` of this worker's input at that exchange, or None.
        floor: this worker's quantisation error ``‖q(x_i) − x_i‖_F`` summed in quadrature over its exchanges.
        resynced: a group step with ``resync`` found replicas that differed and averaged them.
        out_of_scale: exchanges rejected because the peer's values were out of scale (``MAX_RATIO``).
        deadline: the adaptive deadline (seconds) of this mix's pair conversations, or None without any.
        seconds: wall time of the mix.
        errors: one line per failed or skipped exchange.
    """

    values: list[torch.Tensor]
    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges: int = 0
    failed: int = 0
    skipped: int = 0
    peers: list[int | None] = field(default_factory=list)
    distance_sq: list[float] | None = None
    norm_sq: list[float] | None = None
    floor: float = 0.0
    resynced: bool = False
    out_of_scale: int = 0
    deadline: float | None = None
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def distance(self, indices: Sequence[int] | None = None) -> tuple[float, float] | None:
        """``(rms, relative)`` disagreement over the tensors ``indices`` (default all): RMS per element of
        ``q(x_i) − q(x_peer)`` and the same relative to ``‖x_i‖`` (``‖Δx‖ / ‖x‖``), or None without an exchange.
        Both are size-independent: comparable across models and tensor subsets."""
        if self.distance_sq is None or self.norm_sq is None:
            return None
        idx = range(len(self.distance_sq)) if indices is None else indices
        numel = sum(self.values[i].numel() for i in idx)
        d2 = sum(self.distance_sq[i] for i in idx)
        n2 = sum(self.norm_sq[i] for i in idx)
        if numel == 0:
            return None
        return math.sqrt(d2 / numel), (math.sqrt(d2 / n2) if n2 > 0 else 0.0)


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


def _digest(values: Sequence[torch.Tensor]) -> bytes:
    """8 bytes that differ when any bit of ``values`` differs (CRC-32 of the fp32 bytes, plus the element count)."""
    crc, n = 0, 0
    for v in values:
        a = v.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        crc = zlib.crc32(memoryview(a).cast("B"), crc)
        n += a.size
    return crc.to_bytes(4, "little") + (n % (1 << 32)).to_bytes(4, "little")


class Mixer:
    """Runs one kind of mix (Mix1 or Mix2) for a worker.

    Args:
        name: ``"mix1"`` or ``"mix2"``: part of every exchange key, so the two mixes never meet on the wire.
        topology: the gossip schedule (its :meth:`~fgdiloco.gossip.Topology.step` is the plan).
        transport: moves the bytes.
        codec: compresses what is sent.
        rounds: gossip rounds per mix (``r1`` or ``r2``); 0 makes the mix the identity.
        fingerprint: the parameter-layout fingerprint checked in every frame.
        timeout: seconds; the default of the three deadlines below (earlier versions' single ``timeout``).
        join_timeout: seconds a peer may take to arrive for a pair exchange, up to its first payload.
        exchange_timeout: seconds the rest of a pair conversation may take at most (the adaptive deadline's cap).
        collective_timeout: seconds one collective of a group step may take.
        offset: added to the schedule index so that Mix1 and Mix2 of the same outer round pick different peers.
        health: shared peer back-off state.
        resync: group steps compare digests first and average (losslessly) only replicas that differ (Mix1 of the
            exact topology).
        secret: the job secret: frames are authenticated with it (HMAC-SHA256) and unauthenticated ones rejected.
        max_ratio: bound on a peer's message norm against our own (see the module docstring; ``FGDiLoCo`` uses
            ``MAX_RATIO``); None: no check.

    :attr:`generation` is part of every exchange key: the wrapper bumps it when a checkpoint is loaded into it, so
    the restarted rounds never meet the keys of the rounds before.
    """

    def __init__(self, name: str, topology: Topology, transport: Transport | None, codec: Codec, rounds: int,
                 fingerprint: bytes, timeout: float | None = None, offset: int = 0, health: PeerHealth | None = None,
                 resync: bool = False, secret: bytes | None = None, max_ratio: float | None = None, *,
                 join_timeout: float | None = None, exchange_timeout: float | None = None,
                 collective_timeout: float | None = None):
        self.name = name
        self.topology = topology
        self.transport = transport
        self.codec = codec
        self.rounds = rounds
        self.fingerprint = fingerprint
        d = FGDiLoCoConfig.build(**{k: v for k, v in (("timeout", timeout), ("join_timeout", join_timeout),
                                                      ("exchange_timeout", exchange_timeout),
                                                      ("collective_timeout", collective_timeout)) if v is not None})
        self.join_timeout = d.join_timeout
        self.exchange_timeout = d.exchange_timeout
        self.collective_timeout = d.collective_timeout
        self.offset = offset
        self.health = health or PeerHealth()
        self.resync = resync
        self.secret = secret
        self.max_ratio = max_ratio
        self.generation = 0
        self._prepared: dict[str, tuple[int, int]] = {}  # exchange key -> (peer, the membership's epoch then)
        self._views: dict[int, str] = {}  # peer -> the incarnations this mixer last paired under (a prefix)
        self._durations: deque[float] = deque(maxlen=DEADLINE_SAMPLES)

    def deadline(self) -> float:
        """Seconds a pair conversation may take once both peers are there: ``max(1 + 3·median, median + 6·MAD)``
        of the last ``DEADLINE_SAMPLES`` successful conversations of this mix, at most ``exchange_timeout``;
        ``exchange_timeout`` until ``DEADLINE_MIN_SAMPLES`` were measured."""
        if len(self._durations) < DEADLINE_MIN_SAMPLES:
            return self.exchange_timeout
        med = statistics.median(self._durations)
        mad = statistics.median(abs(d - med) for d in self._durations)
        return min(self.exchange_timeout, max(DEADLINE_FLOOR[0] + DEADLINE_FLOOR[1] * med,
                                              med + DEADLINE_MADS * mad))

    def _key(self, idx: int) -> str:
        return f"{self.name}/{self.generation}/{idx}"

    def schedule_index(self, outer_round: int, k: int) -> int:
        return outer_round * self.rounds + k + self.offset

    def _active(self) -> bool:
        return self.transport is not None and self.transport.world_size > 1 and self.rounds > 0

    def prepare(self, outer_round: int) -> None:
        """Let the transport set up this mix's pair exchanges of ``outer_round`` in the background (e.g. Mix2's
        pair groups while the inner steps run). Peers in back-off are left out; :meth:`run` declines them."""
        if not self._active() or self.transport.membership.unreachable:
            return
        for k in range(self.rounds):
            idx = self.schedule_index(outer_round, k)
            step = self.topology.step(self.transport.rank, idx)
            if step.kind == PAIR:
                self._returned(step.peer)  # a peer back as a new process is prepared for again
            if step.kind == PAIR and not self.health.skip(step.peer, outer_round) \
                    and not self.transport.membership.has_left(step.peer):
                key = self._key(idx)
                self.transport.prepare(step.peer, key=key, timeout=self.join_timeout)
                self._prepared[key] = (step.peer, self.transport.membership.epoch)

    def _returned(self, peer: int) -> bool:
        """A peer that came back as a new process starts with a clean slate: its back-off is reset.

        ``membership.returned`` says so once per return, to whichever mixer of the worker asks first; the worker's
        other mixers (Mix1 and Mix2 share one membership) see it as the change of the incarnations they pair
        under. CI: Mix2 noticed a restarted peer first, and Mix1 kept the hello loop it had prepared under the old
        incarnation, which the new process never answers: a full join timeout with each of its partners."""
        membership = self.transport.membership
        try:
            back = membership.returned(peer)
            view = membership.prefix(peer, "")
        except Exception as err:  # noqa: BLE001 - a store we cannot reach: the exchange finds out
            log.debug("fgdiloco %s: could not check rank %d's incarnation: %s", self._who, peer, err)
            return False
        seen = self._views.get(peer)
        self._views[peer] = view
        back = back or (seen is not None and seen != view)
        if back:
            log.warning("fgdiloco %s: rank %d came back (a new process); pairing with it again", self._who, peer)
            self.health.success(peer)
        return back

    def discard_prepared(self) -> None:
        """Give up every exchange set up by :meth:`prepare` and not run (a checkpoint was loaded, or the worker
        leaves): the peers' exchanges fail at once instead of waiting for their deadline."""
        prepared, self._prepared = self._prepared, {}
        for key, (peer, _) in prepared.items():
            try:
                self.transport.discard(peer, key=key)
            except Exception as err:  # noqa: BLE001 - a store we cannot reach: the peer times out as before
                log.debug("fgdiloco %s: could not discard %s: %s", self._who, key, err)

    def run(self, values: Sequence[torch.Tensor], outer_round: int) -> MixResult:
        """Mix ``values`` (fp32 tensors) in outer round ``outer_round``. The inputs are never modified in place;
        the result holds new tensors, or the inputs themselves where nothing was exchanged."""
        t0 = time.perf_counter()
        res = MixResult(values=list(values))
        if not self._active():
            res.seconds = time.perf_counter() - t0
            return res
        averaged = False
        floor_sq = 0.0
        for k in range(self.rounds):
            idx = self.schedule_index(outer_round, k)
            step = self.topology.step(self.transport.rank, idx)
            if step.kind == PAIR:
                floor_sq += self._pair(res, step.peer, idx, outer_round) ** 2
            elif step.kind == GROUP:
                res.peers.append(-1)
                if not averaged:  # the exact average is idempotent: a second group step changes nothing
                    averaged = self._group(res, idx)
            else:
                assert step.kind == IDLE
                res.peers.append(None)
        res.floor = math.sqrt(floor_sq)
        res.seconds = time.perf_counter() - t0
        return res

    @property
    def _who(self) -> str:
        """How this worker's mixer names itself in the log: ``"rank 3 mix2"`` (the log lines of every worker of a
        job may end up side by side)."""
        return self.name if self.transport is None else f"rank {self.transport.rank} {self.name}"

    def _fail(self, res: MixResult, msg: str, outcome: str = "keeping own value for this gossip round") -> None:
        res.failed += 1
        res.errors.append(msg)
        log.warning("fgdiloco %s: %s; %s", self._who, msg, outcome)

    def _skip(self, res: MixResult, msg: str) -> None:
        """An exchange not made (the peer left, declined, is absent or ahead; or back-off): no timeout was spent,
        so it is counted apart from failures and logged at INFO."""
        res.skipped += 1
        res.errors.append(msg)
        log.info("fgdiloco %s: %s; keeping own value for this gossip round", self._who, msg)

    # ------------------------------------------------------------------ pair
    def _pair(self, res: MixResult, peer: int, idx: int, outer_round: int) -> float:
        res.peers.append(peer)
        res.exchanges += 1
        key = self._key(idx)
        prepared = self._prepared.pop(key, None)
        membership = self.transport.membership
        back = not membership.unreachable and self._returned(peer)  # before back-off: a new process is not to blame
        reason = self._no_exchange(peer, key, prepared is not None, outer_round)
        if reason is None and prepared is not None and (back or prepared[1] != membership.epoch):
            # set up for the peer's previous process, or over connections to a store that has been replaced
            self.transport.discard(peer, key=key)
        if reason is not None:
            self._skip(res, reason)
            return 0.0
        values = res.values
        counts = [0, 0]  # bytes sent, received (kept even when the conversation fails midway)
        deadline = self.deadline()
        res.deadline = deadline if res.deadline is None else max(res.deadline, deadline)
        met: list[float] = []  # when the peer's first payload came (the conversation's deadline starts then)
        what = f"{self.name} exchange {key} with rank {peer}"
        try:  # a peer already known to be gone, ahead or behind costs no wait at all (not even the first poll)
            self._watch(peer, key, time.monotonic(), outer_round, what, talking=False, first=True)
        except ExchangeError as e:
            self._not_applied(res, peer, key, outer_round, e)
            return 0.0
        job = Background(lambda: self._converse(peer, key, idx, values, counts, deadline, met), what)
        try:
            outcome: PairOutcome = supervise(
                job, join_deadline=self.join_timeout, exchange_deadline=deadline, met=met, what=what,
                watch=lambda t0, talking: self._watch(peer, key, t0, outer_round, what, talking))
        except ExchangeError as e:
            if isinstance(e, (PeerGone, PeerDeclined)) and not job.done():
                job.forsake()  # its peer will not finish it: the exit drain does not wait for its Gloo deadline
            self._not_applied(res, peer, key, outer_round, e)
            return 0.0
        finally:
            res.bytes_sent += counts[0]
            res.bytes_received += counts[1]
        self._durations.append(time.monotonic() - met[0])
        self.health.success(peer)
        if res.distance_sq is None:
            res.distance_sq = outcome.distance_sq
            res.norm_sq = [sq_norm(v) for v in values]
        res.values = [v + c.to(device=v.device, dtype=v.dtype) for v, c in zip(values, outcome.correction)]
        outcome.commit()
        return outcome.floor

    def _no_exchange(self, peer: int, key: str, prepared: bool, outer_round: int) -> str | None:
        """Why no exchange is tried with ``peer`` (it left, the store is out of reach, or this worker backs off
        from it), or None."""
        if self.transport.membership.has_left(peer):
            return f"rank {peer} has left (departure notice)"
        if self.transport.membership.unreachable:
            return f"rank {peer} skipped: the gossip store is out of reach"
        if not prepared and self.health.skip(peer, outer_round):
            try:
                self.transport.decline(peer, key=key)  # the peer's open() fails at once instead of timing out
            except Exception as err:  # noqa: BLE001 - a store we cannot reach: the peer times out as before
                log.debug("fgdiloco %s: could not post a skip notice for %s: %s", self._who, key, err)
            return f"rank {peer} skipped (back-off after failures)"
        return None

    def _watch(self, peer: int, key: str, since: float, outer_round: int, what: str, talking: bool,
               first: bool = False) -> None:
        """Raise when ``peer`` will not come to (or finish) the exchange ``key`` of ``outer_round``: it left, gave
        the exchange up, its heartbeat stopped (the membership's verdicts), or, before its first payload
        (``talking`` False), it has started a later outer round (an elastic peer that rejoined ahead; one that is
        talking may start its next round while a background Mix1 of this one still runs) or fell rounds behind the
        job (:meth:`~fgdiloco.gossip.membership.Membership.lagging`). Asked once before the exchange starts
        (``first``) and then polled by the supervision loop for the whole exchange.

        The look before the exchange spares every exchange with a peer known to be out its first poll (0.25 s):
        with a third of the chaos job out at any time, the rounds were 19 % longer without it (1.22x the clean job
        against 0.95x). It does not skip a peer that is still *joining* (a restart loading its checkpoint): that one
        gets the first poll, as before, so the workers of a resumed job, all joining at once, meet at the newest
        checkpoint's round instead of skipping each other and racing apart."""
        try:
            membership = self.transport.membership
            gone = "abandoned" if self.transport.abandoned(peer, key) else membership.gone(peer, since)
            if first and gone == "joining":
                gone = None
            ahead = membership.peer_round(peer) if gone is None and not talking else None
            behind = membership.lagging(peer) if gone is None and not talking else None
        except ExchangeError:
            raise
        except Exception as err:  # noqa: BLE001 - c10d's errors for a store that is gone
            raise PeerDeclined(f"{what}: skipped: the gossip store did not answer ({type(err).__name__})") from err
        if gone is not None:
            raise gone_error(gone, what)
        if ahead is not None and ahead > outer_round:
            raise PeerDeclined(f"{what}: skipped: the peer has moved on to outer round {ahead}")
        if behind is not None:
            raise PeerDeclined(f"{what}: skipped: the peer is {behind} outer rounds behind the job (it catches up "
                               "at its next round start)")

    def _not_applied(self, res: MixResult, peer: int, key: str, outer_round: int, err: ExchangeError) -> None:
        """Count and log an exchange that was not applied; stop this side's part of it and tell the peer (which
        may still be waiting); back off from a peer that failed."""
        if isinstance(err, _Rejected):  # the conversation ended: both sides know
            if isinstance(err, _OutOfScale):
                res.out_of_scale += 1
            self._fail(res, str(err))
            return
        reset = "reset by peer" in str(err) or "closed by peer" in str(err)
        try:
            self.transport.abandon(peer, key=key, suspect=reset and not isinstance(err, PeerDeclined))
        except Exception as e:  # noqa: BLE001 - a store we cannot reach: the peer times out as before
            log.debug("fgdiloco %s: could not abandon %s: %s", self._who, key, e)
        if isinstance(err, PeerDeclined):  # PeerLeft is a PeerDeclined: no back-off needed either
            self._skip(res, str(err))
            return
        try:  # a peer that left dropped its end of a prepared group: not a failure to back off from
            left = self.transport.membership.gone(peer, time.monotonic()) == "left"
        except Exception:  # noqa: BLE001 - a store we cannot reach: treat it as a plain failure
            left = False
        if left:
            self._skip(res, f"{err} (rank {peer} has left: departure notice)")
            return
        self.health.failure(peer, outer_round)
        self._fail(res, str(err))

    def _check_scale(self, reply: Sequence[torch.Tensor], own: Sequence[torch.Tensor], peer: int, key: str) -> None:
        """Raise :class:`_OutOfScale` when ``‖reply‖ > max_ratio·‖own‖ + SCALE_EPS·√n``."""
        n = sum(t.numel() for t in own)
        peer_norm = math.sqrt(sum(sq_norm(t) for t in reply))
        own_norm = math.sqrt(sum(sq_norm(t) for t in own))
        bound = self.max_ratio * own_norm + SCALE_EPS * math.sqrt(n)
        if peer_norm > bound:
            raise _OutOfScale(f"rejected values from rank {peer} in {key}: norm {peer_norm:.3g} is out of scale "
                              f"against ours ({own_norm:.3g}; bound {self.max_ratio:g}x + {SCALE_EPS:g}/element)")

    def _converse(self, peer: int, key: str, idx: int, values: Sequence[torch.Tensor],
                  counts: list[int], deadline: float, met: list[float]) -> PairOutcome:
        """The whole conversation with ``peer`` (runs under :func:`~fgdiloco.runtime.supervise`): the codec's
        messages, then accept/reject. Returns the outcome only when both sides accepted."""
        rank = self.transport.rank
        channel = self.transport.open(peer, key=key, timeout=self.join_timeout, deadline=deadline,
                                      supervised=True)

        def send(payload: bytes) -> bytes:
            got = channel.exchange(payload)
            if not met:
                met.append(time.monotonic())
            counts[0] += len(payload)
            counts[1] += len(got)
            return got

        try:
            session = self.codec.pair_session(values, lower=rank < peer, peer=peer)
            reply: list[torch.Tensor] | None = None
            phase = 0
            while True:
                try:
                    msg = next(session) if reply is None else session.send(reply)
                except StopIteration as stop:
                    outcome: PairOutcome = stop.value
                    break
                except CodecError as e:  # our own input cannot be sent (NaN/Inf): tell the peer, keep own
                    send(_ABORT)
                    raise _Rejected(f"own {self.name} input not sent: {e}") from e
                tag = (idx << 2) | min(phase, 3)
                frame = encode_frame(msg.codec, msg.body, sender=rank, round=tag, fingerprint=self.fingerprint,
                                     shuffle=msg.codec.shuffle, secret=self.secret)
                got = send(frame)
                if got == _ABORT:
                    raise _Rejected(f"rank {peer} aborted {key} (it rejected our frame or could not send)")
                try:
                    reply = decode_frame(got, msg.codec, msg.like, fingerprint=self.fingerprint, sender=peer,
                                         round=tag, secret=self.secret)
                except FrameError as e:  # the abort takes the place of our next message or of our accept byte
                    send(_ABORT)
                    raise _Rejected(f"rejected frame from rank {peer}: {e}") from e
                if self.max_ratio is not None:
                    try:
                        self._check_scale(reply, msg.like, peer, key)
                    except _OutOfScale:
                        send(_ABORT)
                        raise
                phase += 1
            verdict = send(_ACCEPT)
            if verdict != _ACCEPT:
                raise _Rejected(f"rank {peer} rejected our frame in {key}")
            channel.reuse()  # every payload went both ways: the pair group may serve the next exchange
            return outcome
        finally:
            channel.close()

    # ------------------------------------------------------------------ group
    def _group(self, res: MixResult, idx: int) -> bool:
        """The exact average over every worker. Returns True when the values now are that average."""
        res.exchanges += 1
        m = self.transport.world_size
        key = self._key(idx)
        values = res.values
        if self.resync:
            mine = _digest(values)
            try:
                digests = self.transport.all_gather(mine, key=key + "/digest", timeout=self.collective_timeout)
            except ExchangeError as e:
                self._fail(res, str(e))
                return False
            res.bytes_sent += len(mine) * (m - 1)
            res.bytes_received += sum(len(d) for d in digests) - len(mine)
            if all(d == mine for d in digests):
                res.distance_sq = [0.0] * len(values)
                res.norm_sq = [sq_norm(v) for v in values]
                return True
            res.resynced = True
            log.warning("fgdiloco %s: replicas differ (digests %s): averaging them exactly", self._who,
                        sorted({d.hex() for d in digests}))
        if self.resync or self.codec.lossless:
            mean = self._all_reduce_mean(res, values, key)
        else:
            mean = self._gather_mean(res, values, key)
        if mean is None:
            return False
        if res.distance_sq is None:
            res.distance_sq = [2.0 * sq_norm(v - mu.to(v.device)) for v, mu in zip(values, mean)]
            res.norm_sq = [sq_norm(v) for v in values]
        res.values = mean
        return True

    def _all_reduce_mean(self, res: MixResult, values: Sequence[torch.Tensor], key: str) -> list[torch.Tensor] | None:
        m = self.transport.world_size
        flat = torch.cat([v.reshape(-1).float().cpu() for v in values])
        try:
            self.transport.all_reduce_mean(flat, key=key, timeout=self.collective_timeout)
        except ExchangeError as e:
            self._fail(res, str(e))
            return None
        nbytes = 4 * flat.numel()
        # bytes of a ring all-reduce: 2 (M-1)/M of the buffer each way
        res.bytes_sent += 2 * (m - 1) * nbytes // m
        res.bytes_received += 2 * (m - 1) * nbytes // m
        out, off = [], 0
        for v in values:
            out.append(flat[off : off + v.numel()].view(v.shape).to(device=v.device, dtype=v.dtype))
            off += v.numel()
        return out

    def _gather_mean(self, res: MixResult, values: Sequence[torch.Tensor], key: str) -> list[torch.Tensor] | None:
        """Lossy codec: all-gather frames, agree on the accepted set, sum it in rank order (identical everywhere);
        the codec's error feedback is committed only when this worker's frame was part of the mean."""
        m, rank = self.transport.world_size, self.transport.rank
        body, own_q, commit = self.codec.encode_staged(values)
        frame = encode_frame(self.codec, body, sender=rank, round=0, fingerprint=self.fingerprint,
                             shuffle=self.codec.shuffle, secret=self.secret)
        try:
            frames = self.transport.all_gather(frame, key=key, timeout=self.collective_timeout)
        except ExchangeError as e:
            self._fail(res, str(e))
            return None
        res.bytes_sent += len(frame) * (m - 1)
        decoded: list[list[torch.Tensor] | None] = []
        for src, f in enumerate(frames):
            if src == rank:
                decoded.append(own_q)
                continue
            res.bytes_received += len(f)
            try:
                decoded.append(decode_frame(f, self.codec, values, fingerprint=self.fingerprint, sender=src, round=0,
                                            secret=self.secret))
            except FrameError as e:
                decoded.append(None)
                self._fail(res, f"rejected frame from rank {src}: {e}", "left out of the mean by every worker")
        accepted = bytes(int(d is not None) for d in decoded)
        try:
            verdicts = self.transport.all_gather(accepted, key=key + "/accepted", timeout=self.collective_timeout)
        except ExchangeError as e:
            self._fail(res, str(e))
            return None
        res.bytes_sent += m * (m - 1)
        res.bytes_received += m * (m - 1)
        use = [all(len(v) == m and v[src] == 1 for v in verdicts) for src in range(m)]
        if not any(use):
            self._fail(res, "no frame was accepted by every worker")
            return None
        if not use[rank]:
            self._fail(res, "our frame was rejected by a peer", "every worker applies the mean of the accepted frames")
        count = sum(use)
        mean = []
        for t, parts in enumerate(zip(*[d if d is not None else [None] * len(values) for d in decoded])):
            total = None
            for src in range(m):  # fixed order: every worker sums the same numbers the same way
                if use[src]:
                    p = parts[src].to(device=values[t].device, dtype=torch.float32)
                    total = p.clone() if total is None else total.add_(p)
            mean.append((total / count).to(values[t].dtype))
        if use[rank]:
            commit()
        return mean


def pair_round_in_process(codecs: Sequence[Codec], values: Sequence[Sequence[torch.Tensor]],
                          partner: Sequence[int | None], fingerprint: bytes = b"\0" * 8,
                          ) -> tuple[list[list[torch.Tensor]], list[float]]:
    """One pairwise gossip round of M workers held in one process, through the same pair sessions and the same
    checked frames as :class:`Mixer` (no transport, no threads): for tests, simulations and benchmarks.

    Args:
        codecs: one codec instance per worker (its state, e.g. LowRank's warm starts, is committed as in a run).
        values: per worker, its fp32 tensors (same layout on every worker); not modified.
        partner: ``partner[i]`` is worker i's peer or None (a matching: ``partner[partner[i]] == i``).
        fingerprint: the layout fingerprint written into and checked in every frame.

    Returns:
        ``(mixed, floors)``: per worker its new tensors, and its quantisation floor ``‖q(x_i) − x_i‖_F``.

    Raises:
        ValueError: ``partner`` is not a matching.
    """
    m = len(values)
    for i, j in enumerate(partner):
        if j is not None and (not 0 <= j < m or j == i or partner[j] != i):
            raise ValueError(f"partner must be a matching over {m} workers, got {list(partner)}")
    mixed = [list(v) for v in values]
    floors = [0.0] * m
    for i, j in enumerate(partner):
        if j is None or j < i:
            continue
        sessions = {i: codecs[i].pair_session(values[i], lower=True, peer=j),
                    j: codecs[j].pair_session(values[j], lower=False, peer=i)}
        msgs = {w: next(s) for w, s in sessions.items()}
        outcomes: dict[int, PairOutcome] = {}
        phase = 0
        while not outcomes:
            frames = {w: encode_frame(msg.codec, msg.body, sender=w, round=phase, fingerprint=fingerprint,
                                      shuffle=msg.codec.shuffle) for w, msg in msgs.items()}
            replies = {w: decode_frame(frames[o], msgs[w].codec, msgs[w].like, fingerprint=fingerprint, sender=o,
                                       round=phase) for w, o in ((i, j), (j, i))}
            for w in (i, j):
                try:
                    msgs[w] = sessions[w].send(replies[w])
                except StopIteration as stop:
                    outcomes[w] = stop.value
            phase += 1
        if len(outcomes) != 2:
            raise RuntimeError(f"the pair sessions of workers {i} and {j} ended after different numbers of messages")
        for w in (i, j):
            mixed[w] = [v + c for v, c in zip(values[w], outcomes[w].correction)]
            floors[w] = outcomes[w].floor
            outcomes[w].commit()
    return mixed, floors
