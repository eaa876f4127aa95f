"""``GossipMonitor``: per-round diagnostics of Factored Gossip DiLoCo in Lightning's loggers and progress bar."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from fgdiloco.outer import RoundStats

__all__ = ["GossipMonitor", "LightningGossipMonitor", "ConsensusGrowthWarning", "ConsensusGrowthTracker"]


class ConsensusGrowthWarning(UserWarning):
    """The replicas' relative consensus distance (``RoundStats.consensus_relative``: ``‖θ_i − θ_peer‖ / ‖θ_i‖``)
    grew for several outer rounds in a row."""


class ConsensusGrowthTracker:
    """Counts consecutive rounds in which the consensus distance grew; says once when ``patience`` is reached.

    A round without a distance (no Mix1 exchange: a failed exchange, no peer, or the all-reduce topology) neither
    counts nor breaks the streak. A distance that is not finite counts as growth.

    Args:
        patience: consecutive growing rounds that trigger the warning (int >= 1).
    """

    def __init__(self, patience: int = 5):
        if isinstance(patience, bool) or not isinstance(patience, int):
            raise TypeError(f"patience must be an int >= 1, got {type(patience).__name__}")
        if patience < 1:
            raise ValueError(f"patience must be an int >= 1 (consecutive growing rounds), got {patience}")
        self.patience = patience
        self.streak = 0
        self.previous: float | None = None
        self.fired = False

    def update(self, distance: float | None) -> bool:
        """Feed one round's distance; True exactly once, on the round that completes the first long streak."""
        if distance is None:
            return False
        d = float(distance)
        if self.previous is not None and (d > self.previous or not math.isfinite(d)):
            self.streak += 1
        else:
            self.streak = 0
        self.previous = d
        if self.streak >= self.patience and not self.fired:
            self.fired = True
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "previous": self.previous, "fired": self.fired}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.previous = state.get("previous")
        self.fired = bool(state.get("fired", False))


# what the progress bar shows by default: RoundStats field -> progress-bar name
DEFAULT_PROG_BAR = {"utilisation": "util", "consensus_relative": "cdist"}


class _GossipMonitorMixin:
    """Namespace-independent logic of :class:`GossipMonitor`."""

    def __init__(self, *, prefix: str = "gossip/", prog_bar: Mapping[str, str] | None = None,
                 growth_patience: int = 5, warn: bool = True):
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        prog = dict(DEFAULT_PROG_BAR if prog_bar is None else prog_bar)
        known = set(RoundStats.__dataclass_fields__) | {"bytes_sent", "bytes_received", "failed_exchanges_total"}
        unknown = sorted(set(prog) - known)
        if unknown:
            raise ValueError(f"prog_bar names unknown RoundStats fields {unknown}; use some of {sorted(known)}")
        super().__init__()
        self.prefix = prefix
        self.prog_bar = prog
        self.warn = warn
        self.tracker = ConsensusGrowthTracker(growth_patience)
        self.history: list[dict[str, float]] = []
        self._seen_round: int | None = None
        self._fgdiloco_missing_warned = False

    # ------------------------------------------------------------------ pure parts (unit-tested)
    def metrics(self, stats: RoundStats, failed_total: int | None = None) -> dict[str, float]:
        """The logged values of one round: every numeric :class:`RoundStats` field, ``bytes_sent`` /
        ``bytes_received`` (both mixes) and ``failed_exchanges_total``, each under ``prefix``. ``consensus_distance``
        and the other distances are left out when the round had no exchange to measure them."""
        out = {f"{self.prefix}{k}": v for k, v in stats.scalars().items()}
        if failed_total is not None:
            out[f"{self.prefix}failed_exchanges_total"] = float(failed_total)
        return out

    def observe(self, stats: RoundStats, *, rank: int = 0) -> bool:
        """Feed one finished round to the growth check; warns (once) and returns True when it fires."""
        fired = self.tracker.update(stats.consensus_relative)
        if fired and self.warn:
            warnings.warn(
                f"fgdiloco: the relative consensus distance of rank {rank} grew for {self.tracker.patience} "
                f"consecutive outer rounds (now {stats.consensus_relative:.4g} of the parameters' norm at round "
                f"{stats.round}); the replicas are drifting "
                "apart. Consider more mix2_rounds, a smaller sync_every or outer_lr, or topology='exponential'.",
                ConsensusGrowthWarning, stacklevel=2)
        return fired

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        fgd = getattr(trainer.strategy, "fgdiloco", None)
        if fgd is None:
            if not self._fgdiloco_missing_warned:
                self._fgdiloco_missing_warned = True
                warnings.warn("GossipMonitor: the Trainer's strategy has no FGDiLoCo wrapper (use "
                              "strategy='fgdiloco'); nothing will be logged", UserWarning, stacklevel=2)
            return
        stats = fgd.last_round
        if stats is None or stats.round == self._seen_round:
            return
        self._seen_round = stats.round
        values = self.metrics(stats, fgd.failed_exchanges_total)
        self.history.append({"global_step": float(trainer.global_step), **values})
        self.observe(stats, rank=trainer.global_rank)
        # Straight to the loggers (rank 0's loggers write; the others are no-ops): a round ends on one step, which
        # `self.log` would drop unless it fell on a `log_every_n_steps` boundary. No sync_dist: values are local.
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
                logger.save()
        for field, name in self.prog_bar.items():
            value = values.get(f"{self.prefix}{field}")
            if value is not None:
                pl_module.log(name, value, prog_bar=True, logger=False, on_step=True, on_epoch=False,
                              sync_dist=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker.state_dict(), "seen_round": self._seen_round}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict.get("tracker", {}))
        self._seen_round = state_dict.get("seen_round")


_CLASS_DOC = """Logs the diagnostics of every finished outer round of :class:`~lightning_callbacks.FGDiLoCoStrategy`.

    After the step that ends a round, on every rank, it reads ``trainer.strategy.fgdiloco.last_round`` and

    * writes these values to the Trainer's loggers at ``trainer.global_step`` (Lightning's loggers write on global
      rank 0, so they show rank 0's replica), under ``prefix`` (default ``"gossip/"``): ``round``,
      ``inner_steps``, ``round_seconds``, ``inner_seconds``, ``mix2_seconds``, ``mix1_wait_seconds``,
      ``mix1_seconds``, ``outer_seconds``, ``utilisation``, ``mix1_bytes_sent``, ``mix1_bytes_received``,
      ``mix2_bytes_sent``, ``mix2_bytes_received``, ``bytes_sent``, ``bytes_received``, the size-independent
      distances ``consensus_distance`` (RMS per element), ``consensus_relative`` (fraction of ‖θ‖),
      ``pseudo_gradient_distance``, ``pseudo_gradient_relative``, ``momentum_distance`` (each absent in rounds
      without an exchange to measure it), ``failed_exchanges``, ``skipped_exchanges`` (not made: the peer left,
      was absent or ahead, or is in back-off) and ``failed_exchanges_total``. Times in
      seconds, sizes in bytes (see :class:`fgdiloco.RoundStats`);
    * shows the ``prog_bar`` fields in the progress bar (default ``util`` = utilisation, ``cdist`` = relative
      consensus distance);
    * appends the values (plus ``global_step``) to :attr:`history` on every rank (rank-local, never reduced);
    * warns once (:class:`ConsensusGrowthWarning`, on the rank where it happens) when the relative consensus
      distance grew for ``growth_patience`` consecutive rounds.

    Nothing is synchronised between ranks (no ``sync_dist``), so the monitor never makes replicas wait.

    Args:
        prefix: prepended to every logged name.
        prog_bar: RoundStats field -> progress-bar name; ``{}`` shows nothing.
        growth_patience: consecutive rounds of growing consensus distance that trigger the warning.
        warn: set False to keep the growth check (``tracker``) without warning.
    """

# one concrete class per installed Lightning namespace
try:
    from pytorch_lightning import Callback as _PLCallback
except ImportError:  # pragma: no cover
    _PLCallback = None
try:
    from lightning.pytorch import Callback as _LCallback
except ImportError:
    _LCallback = None

if _PLCallback is not None:

    class GossipMonitor(_GossipMonitorMixin, _PLCallback):
        __doc__ = _CLASS_DOC

if _LCallback is not None:

    class LightningGossipMonitor(_GossipMonitorMixin, _LCallback):
        __doc__ = "``lightning.pytorch`` twin of :class:`GossipMonitor`.\n\n    " + _CLASS_DOC

    if _PLCallback is None:  # pragma: no cover
        GossipMonitor = LightningGossipMonitor
