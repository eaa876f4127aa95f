"""One outer round on one worker: :class:`Round`.

Its life (``docs/design.md``, "the life of a round"):

1. **start** (:meth:`Round.__init__`, at the round's first inner step, or right after the previous round's end):
   Mix1 of the round-start values (parameters, and the outer momentum when Mix1 carries it) runs in a background
   thread, and Mix2's pair exchanges are set up in the background (:meth:`fgdiloco.gossip.Mixer.prepare`);
2. the H inner steps run meanwhile, from the *unmixed* round-start parameters;
3. **finish** (:meth:`Round.finish`): the pseudo-gradient ``Δ = θ^t − θ`` goes through Mix2 (blocking), Mix1 is
   waited for (normally long done), the outer step gives the next round-start values, which are **committed** to the
   :class:`~fgdiloco.outer.state.OuterState` (and copied into the model), and the round's :class:`RoundStats` are
   returned;
4. or **discard** (:meth:`Round.discard`: a checkpoint is loaded, the worker rejoins or leaves): Mix1 is waited for
   and dropped, and Mix2's prepared exchanges are given up (their peers fail them at once instead of waiting).

The round's clock runs from its start to the end of its outer step, less the time spent inside
``FGDiLoCo.paused()`` (:attr:`Round.paused`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..gossip.mix import Mixer, MixResult
from ..runtime import Background
from .state import OuterState
from .stats import RoundStats

__all__ = ["Round", "nesterov_step"]


@torch.no_grad()
def nesterov_step(theta: list[torch.Tensor], delta: list[torch.Tensor], momentum: list[torch.Tensor], *,
                  lr: float, mu: float, nesterov: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outer step on fp32 masters, ``torch.optim.SGD``'s rule (no dampening): ``m ← μ·m + Δ̄``;
    ``θ ← θ̄ − η·(Δ̄ + μ·m)`` (Nesterov) or ``θ̄ − η·m``. Returns new lists ``(θ, m)``; nothing is changed in
    place."""
    new_theta, new_momentum = [], []
    for t, d, m in zip(theta, delta, momentum):
        if mu > 0:
            m = m.mul(mu).add_(d)
            step = d.add(m, alpha=mu) if nesterov else m
        else:
            step = d
        new_theta.append(t.sub(step, alpha=lr))
        new_momentum.append(m)
    return new_theta, new_momentum


class Round:
    """Outer round ``outer.round`` of one worker, from its start to its commit (see the module docstring).

    Args:
        outer: the worker's outer state (round-start values, counters).
        mix1, mix2: the two mixes.
        outer_step: ``(θ̄, Δ̄, m̄) -> (θ, m)`` (:func:`nesterov_step` with the wrapper's settings).
        momentum_in_mix1: Mix1 carries the outer momentum as well.
        exact: the exact topology: Mix1's collective (a digest check) must end before Mix2's starts, on every
            worker, or the collectives of the two threads could interleave.
        t0: when the round's clock starts (``time.perf_counter()``).
    """

    def __init__(self, outer: OuterState, mix1: Mixer, mix2: Mixer,
                 outer_step: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]], *,
                 momentum_in_mix1: bool, exact: bool, t0: float):
        self.outer = outer
        self.index = outer.round
        self.t0 = t0
        self.paused = 0.0
        self._mix2 = mix2
        self._mix1_mixer = mix1
        self._outer_step = outer_step
        self._momentum_in_mix1 = momentum_in_mix1
        self._exact = exact
        values = [t.clone() for t in outer.theta0]
        if momentum_in_mix1:
            values += [m.clone() for m in outer.momentum]
        index = self.index

        def run_mix1() -> MixResult:
            with torch.no_grad():  # grad mode is per thread
                return mix1.run(values, index)

        self._mix1 = Background(run_mix1, f"mix1-{index}")
        mix2.prepare(index)

    def mix1_done(self) -> bool:
        """Whether Mix1 has finished (it overlaps the inner steps)."""
        return self._mix1.done()

    def discard(self) -> None:
        """Give the round up: wait for Mix1 and drop it; give up Mix2's prepared exchanges."""
        self._mix1.settle()
        self._mix1_mixer.discard_prepared()
        self._mix2.discard_prepared()

    @torch.no_grad()
    def finish(self) -> RoundStats:
        """Mix2 (blocking), wait for Mix1, the outer step, commit; returns the round's diagnostics."""
        outer = self.outer
        t_sync = time.perf_counter()
        if self._exact:
            self._mix1.result()
        delta = [t - p.detach().to(torch.float32) for t, p in zip(outer.theta0, outer.params)]
        mix2 = self._mix2.run(delta, self.index)
        t_mix2 = time.perf_counter()
        mix1 = self._mix1.result()
        t_mix1 = time.perf_counter()
        n = len(outer.params)
        momentum = mix1.values[n:] if self._momentum_in_mix1 else outer.momentum
        steps = outer.steps_in_round
        theta, momentum = self._outer_step(mix1.values[:n], mix2.values, momentum)
        outer.commit(theta, momentum)
        t_end = time.perf_counter()
        return self._stats(mix1, mix2, steps, t_sync, t_mix2, t_mix1, t_end)

    def _stats(self, mix1: MixResult, mix2: MixResult, steps: int, t_sync: float, t_mix2: float, t_mix1: float,
               t_end: float) -> RoundStats:
        n = len(self.outer.params)
        round_seconds = t_end - self.t0 - self.paused
        inner_seconds = max(round_seconds - (t_end - t_sync), 0.0)
        cons = mix1.distance(range(n))
        cons_m = mix1.distance(range(n, 2 * n)) if self._momentum_in_mix1 else None
        cons_d = mix2.distance()
        return RoundStats(
            round=self.index,
            inner_steps=steps,
            round_seconds=round_seconds,
            inner_seconds=inner_seconds,
            mix2_seconds=t_mix2 - t_sync,
            mix1_wait_seconds=t_mix1 - t_mix2,
            mix1_seconds=mix1.seconds,
            outer_seconds=t_end - t_mix1,
            utilisation=inner_seconds / round_seconds if round_seconds > 0 else 1.0,
            mix1_bytes_sent=mix1.bytes_sent,
            mix1_bytes_received=mix1.bytes_received,
            mix2_bytes_sent=mix2.bytes_sent,
            mix2_bytes_received=mix2.bytes_received,
            consensus_distance=cons[0] if cons else None,
            consensus_relative=cons[1] if cons else None,
            pseudo_gradient_distance=cons_d[0] if cons_d else None,
            pseudo_gradient_relative=cons_d[1] if cons_d else None,
            momentum_distance=cons_m[0] if cons_m else None,
            failed_exchanges=mix1.failed + mix2.failed,
            skipped_exchanges=mix1.skipped + mix2.skipped,
            out_of_scale=mix1.out_of_scale + mix2.out_of_scale,
            deadline_seconds=mix2.deadline,
            mix1_deadline_seconds=mix1.deadline,
            resynced=mix1.resynced,
            rejoins=self.outer.rejoins,
            mix1_peers=mix1.peers,
            mix2_peers=mix2.peers,
            errors=mix1.errors + mix2.errors,
        )
