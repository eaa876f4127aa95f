"""One outer round of one fragment on one worker: :class:`Round`.

Its life (``docs/design.md``, "the life of a round"):

1. **start** (:meth:`Round.__init__`, at the first inner step, or right after the fragment's previous round):
   Mix1 of the fragment's round-start values (parameters, and the outer momentum when Mix1 carries it) runs in a
   background thread, and Mix2's pair exchanges are set up in the background (:meth:`fgdiloco.gossip.Mixer.prepare`);
2. the inner steps run meanwhile, from the *unmixed* round-start parameters;
3. with ``overlap_steps`` τ > 0, :meth:`Round.start_mix2` starts Mix2 of the pseudo-gradient ``Δ = θ^t − θ`` τ inner
   steps before the outer step, in the background (Streaming DiLoCo's overlap; Mix2 then carries τ steps of delay);
4. **finish** (:meth:`Round.finish`): Mix2 (blocking when τ = 0) and Mix1 are waited for, the outer optimizer gives the
   next round-start values, which are **committed** to the :class:`~fgdiloco.outer.state.OuterState` (the model's
   parameters become them, or ``α·local + (1 − α)·outer`` with ``merge_alpha``), and the round's
   :class:`RoundStats` are returned;
5. or **discard** (:meth:`Round.discard`: a checkpoint is loaded, the worker rejoins or leaves): both mixes are
   waited for and dropped, and Mix2's prepared exchanges are given up (their peers fail them at once instead of
   waiting).

The index of a round is the wrapper's outer-round counter at its end (one per fragment sync), which keys its
exchanges, so every fragment meets its peers on keys of its own.
"""

from __future__ import annotations

import time

import torch

from ..gossip.mix import Mixer, MixResult
from ..gossip.staging import HostStaging
from ..runtime import Background
from .state import OuterState
from .stats import RoundStats

__all__ = ["Round"]


class Round:
    """The outer round of the parameters ``indices`` (one fragment) that ends at outer round ``index``.

    Args:
        outer: the worker's outer state (round-start values, outer optimizer, counters).
        fragment: the fragment's number (in the stats).
        indices: the fragment's parameter indices.
        index: the outer round this round ends as (its exchanges' schedule index).
        mix1, mix2: the two mixes.
        momentum_in_mix1: Mix1 carries the outer optimizer's state as well.
        exact: the exact topology: a Mix1 collective must end before a Mix2 collective starts, on every worker, or
            the collectives of two threads could interleave (the wrapper waits for every Mix1 first).
        merge_alpha: α of the merge after the outer step.
        after: a round whose Mix1 this one's waits for before it starts (the exact topology with fragments: the
            rounds' Mix1 collectives run in the order the rounds were started, the same on every worker).
        staging: where what the mixes send is put on the host (:mod:`fgdiloco.gossip.staging`; CUDA values are
            copied into the worker's pinned buffers, CPU values pass through). Default: a staging of its own.
    """

    def __init__(self, outer: OuterState, fragment: int, indices: list[int], index: int, mix1: Mixer, mix2: Mixer,
                 *, momentum_in_mix1: bool, exact: bool, merge_alpha: float, after: Round | None = None,
                 staging: HostStaging | None = None):
        self.outer = outer
        self.fragment = fragment
        self.indices = indices
        self.index = index
        self._mix1_mixer = mix1
        self._mix2_mixer = mix2
        self._momentum_in_mix1 = momentum_in_mix1
        self._exact = exact
        self._alpha = merge_alpha
        self._staging = staging if staging is not None else HostStaging()
        values = [outer.theta0[i] for i in indices]
        if momentum_in_mix1:
            values += outer.optimizer.state(indices)
        self._mix1_like = values  # where (device, dtype) Mix1's results go back to
        staged = self._staging.to_host(values, ("mix1", fragment), copy=True)

        before = after._mix1 if after is not None else None

        def run_mix1() -> MixResult:
            if before is not None:  # collectives in the same order on every worker
                before.wait()
            with torch.no_grad():  # grad mode is per thread
                return mix1.run(staged.wait(), index)

        self._mix1 = Background(run_mix1, f"mix1-{index}")
        self._mix2: Background | None = None
        self._mix2_started = 0.0
        #: the pseudo-gradient Mix2 is mixing in the background (a checkpoint keeps it: the resumed round mixes
        #: the same one), or None
        self.overlap_delta: list[torch.Tensor] | None = None
        mix2.prepare(index)

    def mix1_done(self) -> bool:
        """Whether Mix1 has finished (it overlaps the inner steps)."""
        return self._mix1.done()

    def wait_mix1(self) -> None:
        """Wait for Mix1 to end (its result is kept)."""
        self._mix1.wait()

    @torch.no_grad()
    def _delta(self) -> list[torch.Tensor]:
        return [self.outer.theta0[i] - self.outer.params[i].detach().to(torch.float32) for i in self.indices]

    def start_mix2(self, delta: list[torch.Tensor] | None = None) -> None:
        """Start Mix2 of the pseudo-gradient now, in the background (``overlap_steps`` before the outer step);
        ``delta``: the one a checkpoint saved (:attr:`overlap_delta`), else the current one."""
        delta = self._delta() if delta is None else delta
        self.overlap_delta = delta
        index, mixer = self.index, self._mix2_mixer
        staged = self._staging.to_host(delta, ("mix2", self.fragment))

        def run_mix2() -> MixResult:
            with torch.no_grad():
                return mixer.run(staged.wait(), index)

        self._mix2_started = time.perf_counter()
        self._mix2 = Background(run_mix2, f"mix2-{index}")

    def discard(self) -> None:
        """Give the round up: wait for its mixes and drop them; give up Mix2's prepared exchanges."""
        self._mix1.settle()
        if self._mix2 is not None:
            self._mix2.settle()
        self._mix1_mixer.discard_prepared()
        self._mix2_mixer.discard_prepared()

    @torch.no_grad()
    def finish(self, t0: float, paused: float) -> RoundStats:
        """Mix2 (blocking unless started early), wait for Mix1, the outer step, commit; returns the round's
        diagnostics. ``t0`` / ``paused``: when the stretch of inner steps before this outer round began, and the
        time spent paused since (the round's clock)."""
        outer = self.outer
        t_sync = time.perf_counter()
        mix2 = self._mix2.result() if self._mix2 is not None else self._run_mix2()
        t_mix2 = time.perf_counter()
        mix1 = self._mix1.result()
        t_mix1 = time.perf_counter()
        k = len(self.indices)
        mixed1 = self._staging.to_device(mix1.values, self._mix1_like)  # back where the snapshot lives
        mixed2 = self._staging.to_device(mix2.values, self._mix1_like[:k])
        if self._momentum_in_mix1:
            outer.optimizer.set_state(self.indices, mixed1[k:])
        steps = outer.steps_in_round
        theta = outer.optimizer.step(self.indices, mixed1[:k], mixed2)
        outer.commit(self.indices, theta, self._alpha)
        t_end = time.perf_counter()
        return self._stats(mix1, mix2, steps, (t0, paused, t_sync, t_mix2, t_mix1, t_end))

    def _run_mix2(self) -> MixResult:
        """Mix2 of the current pseudo-gradient, blocking (``overlap_steps`` = 0)."""
        delta = self._delta()
        return self._mix2_mixer.run(self._staging.to_host(delta, ("mix2", self.fragment)).wait(), self.index)

    def _stats(self, mix1: MixResult, mix2: MixResult, steps: int, times: tuple[float, ...]) -> RoundStats:
        t0, paused, t_sync, t_mix2, t_mix1, t_end = times
        k = len(self.indices)
        round_seconds = t_end - t0 - paused
        inner_seconds = max(round_seconds - (t_end - t_sync), 0.0)
        cons = mix1.distance(range(k))
        state = self.outer.optimizer.state_per_param
        cons_m = mix1.distance(range(k, k + k * state)) if self._momentum_in_mix1 and state else None
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
            fragment=self.fragment,
            mix2_overlap_seconds=(t_sync - self._mix2_started) if self._mix2 is not None else 0.0,
            mix1_peers=mix1.peers,
            mix2_peers=mix2.peers,
            errors=mix1.errors + mix2.errors,
        )
