"""Per-round diagnostics of Factored Gossip DiLoCo."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RoundStats"]


@dataclass
class RoundStats:
    """What one outer round did on this worker. Times in seconds, sizes in bytes.

    Attributes:
        round: index of the outer round that just finished (0-based).
        inner_steps: inner optimizer steps since the previous outer round (``sync_every``, or ``sync_every /
            fragments`` with fragments).
        round_seconds: wall time from the end of the previous outer step to the end of this one, less the time
            spent inside ``FGDiLoCo.paused()`` (evaluation, checkpointing).
        inner_seconds: ``round_seconds`` minus the time blocked in synchronisation: the time the worker spent
            on its own work (forward, backward, inner step, data loading).
        mix2_seconds: time blocked in Mix2 (pseudo-gradient gossip).
        mix1_wait_seconds: time spent waiting for Mix1 (parameter gossip) after Mix2; ~0 when Mix1 hid behind
            the inner steps.
        mix1_seconds: Mix1's own duration (in the background).
        outer_seconds: time of the local outer (Nesterov) step.
        utilisation: ``inner_seconds / round_seconds``, in [0, 1].
        mix1_bytes_sent, mix1_bytes_received, mix2_bytes_sent, mix2_bytes_received: frame bytes on the wire.
        consensus_distance: disagreement of the round-start parameters with Mix1's (first) peer: RMS per element of
            ``q(θ_i) − q(θ_peer)`` in fp32, as transmitted (so identical replicas give exactly 0; bf16 adds its
            floor, ~2⁻⁹·|θ|). Size-independent: comparable across models. For the exact topology: 0 when the
            digests agree, else the RMS of ``√2·(θ_i − θ̄)``. None when Mix1 exchanged nothing. Ring and
            exponential topologies only ever see neighbours, so it tracks local agreement.
        consensus_relative: the same as a fraction of the parameters' size, ``‖θ_i − θ_peer‖ / ‖θ_i‖``.
        pseudo_gradient_distance, pseudo_gradient_relative: the same for Mix2's pseudo-gradients before mixing
            (with a low-rank codec: of the part in the pair's shared basis, the part that is mixed).
        momentum_distance: the same (RMS per element) for the outer momentum buffers when Mix1 carries them.
        failed_exchanges: exchanges of either mix that failed, timed out or were rejected.
        skipped_exchanges: exchanges of either mix not made, with no timeout spent: the peer had left, its slot was
            empty, it restarted or was in a later outer round, it declined, or this worker was backing off from it
            (:class:`fgdiloco.gossip.mix.MixResult`). Not in ``failed_exchanges``.
        out_of_scale: exchanges (of either mix) rejected because the peer's values were out of scale against this
            worker's own (``‖q_peer‖ > 100·‖own‖``, :mod:`fgdiloco.gossip.mix`); also in ``failed_exchanges``.
        deadline_seconds: the adaptive deadline of Mix2's pair conversations in this round (seconds allowed after
            the peer's first payload: ``max(1 + 3·median, median + 6·MAD)`` of recent exchanges, at most
            ``timeout``), or None when Mix2 had no pair exchange. ``mix1_deadline_seconds``: the same for Mix1.
        resynced: the exact topology's Mix1 found replicas that differed and averaged them.
        rejoins: times this worker has (re)joined the job at its live round so far (:meth:`FGDiLoCo.rejoin`: after
            a restart, or after it fell ``CATCH_UP_ROUNDS`` behind, e.g. hung); elastic jobs only.
        fragment: the fragment whose outer round this was (``fragments`` > 1: one round per fragment sync, every
            ``sync_every / fragments`` inner steps; 0 otherwise).
        mix2_overlap_seconds: how long Mix2 ran behind the inner steps before the outer step (``overlap_steps`` >
            0; it is not in ``mix2_seconds``, which is only the blocking part).
        mix1_peers, mix2_peers: the peer of each gossip round (None: no peer, -1: all-reduce).
        errors: one line per failed or skipped exchange.
    """

    round: int
    inner_steps: int
    round_seconds: float
    inner_seconds: float
    mix2_seconds: float
    mix1_wait_seconds: float
    mix1_seconds: float
    outer_seconds: float
    utilisation: float
    mix1_bytes_sent: int
    mix1_bytes_received: int
    mix2_bytes_sent: int
    mix2_bytes_received: int
    consensus_distance: float | None
    failed_exchanges: int
    consensus_relative: float | None = None
    pseudo_gradient_distance: float | None = None
    pseudo_gradient_relative: float | None = None
    momentum_distance: float | None = None
    skipped_exchanges: int = 0
    out_of_scale: int = 0
    deadline_seconds: float | None = None
    mix1_deadline_seconds: float | None = None
    resynced: bool = False
    rejoins: int = 0
    fragment: int = 0
    mix2_overlap_seconds: float = 0.0
    mix1_peers: list[int | None] = field(default_factory=list)
    mix2_peers: list[int | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return self.mix1_bytes_sent + self.mix2_bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.mix1_bytes_received + self.mix2_bytes_received

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes_sent"] = self.bytes_sent
        d["bytes_received"] = self.bytes_received
        return d

    def scalars(self) -> dict[str, float]:
        """The numeric diagnostics, for loggers (``None`` distances are left out)."""
        out = {k: float(v) for k, v in self.as_dict().items() if isinstance(v, (int, float)) and v is not None}
        return out
