"""The outer loop's state on one worker (:class:`OuterState`; its checkpoint format: :mod:`.checkpoint`).

The state is what the next outer round starts from: the round-start parameters ``θ_i^t`` and the outer momentum
(fp32 master copies, also for bf16/fp16 models), the round and step counters and the exchange keys' generation.
A committed round replaces the lists as a whole (tensors are never changed in place), so
:attr:`OuterState.committed_state` can hand a consistent snapshot to a joining peer from another thread without a
copy.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..factor.codec import Dense
from ..factor.frame import FrameError, decode_frame, encode_frame
from .optimizer import OuterOptimizer

__all__ = ["OuterState"]


class OuterState:
    """Round-start parameters (fp32), the outer optimizer (its state: the outer momentum), counters and the
    generation of one worker.

    Args:
        params: the model's trainable parameters (the live tensors the inner optimizer steps).
        optimizer: the outer optimizer (:mod:`fgdiloco.outer.optimizer`), over tensors shaped like ``params``.
        fingerprint: the parameter-layout fingerprint (checked in a peer's state frame).
        secret: the job secret authenticating state frames (None: unauthenticated).
        rank: this worker's rank (in logs).
        join_timeout: seconds a joiner waits for a live peer's state.
    """

    def __init__(self, params: list[torch.Tensor], optimizer: OuterOptimizer, fingerprint: bytes,
                 secret: bytes | None, rank: int, join_timeout: float):
        self.params = params
        self.optimizer = optimizer
        self.fingerprint = fingerprint
        self.secret = secret
        self.rank = rank
        self.join_timeout = join_timeout
        with torch.no_grad():
            self.theta0 = [p.detach().to(torch.float32, copy=True) for p in params]
        self.round = 0
        self.steps_in_round = 0
        self.generation = 0
        self.fresh = True  # no state loaded: a worker joining a running job takes a live peer's state
        self.rejoins = 0
        self._lock = threading.Lock()
        self._committed: tuple[int, list[torch.Tensor]] = (0, self.theta0)

    @property
    def all(self) -> range:
        return range(len(self.params))

    @property
    def momentum(self) -> list[torch.Tensor]:
        """The outer optimizer's mixable state of every parameter (the outer momentum)."""
        return self.optimizer.state(self.all)

    # ------------------------------------------------------------------ changes
    @torch.no_grad()
    def set(self, theta0: list[torch.Tensor], momentum: list[torch.Tensor], round: int, *,
            copy_to_params: bool = True) -> None:
        """Start ``round`` from ``theta0`` / ``momentum`` (fp32 copies are made on the parameters' devices), at its
        step 0; with ``copy_to_params`` the model's parameters are set to ``theta0``."""
        theta0 = [t.detach().to(device=p.device, dtype=torch.float32, copy=True) for t, p in zip(theta0, self.params)]
        like = [p for _ in range(self.optimizer.state_per_param) for p in self.params]
        self.optimizer.set_state(self.all, [m.detach().to(device=p.device, dtype=torch.float32, copy=True)
                                            for m, p in zip(momentum, like)])
        if copy_to_params:
            for p, t in zip(self.params, theta0):
                p.copy_(t)
        with self._lock:
            self.theta0, self.round, self.steps_in_round = theta0, int(round), 0
            self._committed = (self.round, theta0)

    @torch.no_grad()
    def commit(self, indices: list[int], theta0: list[torch.Tensor], merge_alpha: float) -> None:
        """End the round of the parameters ``indices``: their next round starts from ``theta0`` (fresh fp32 tensors
        owned from now on), and the model's parameters become ``theta0``, or ``α·local + (1 − α)·theta0`` with
        ``merge_alpha`` α (Streaming DiLoCo's merge; the round still starts from ``theta0``)."""
        for i, t in zip(indices, theta0):
            p = self.params[i]
            p.copy_(t if merge_alpha == 0 else torch.lerp(t, p.detach().to(torch.float32), merge_alpha))
        with self._lock:
            self.theta0 = list(self.theta0)  # a new list: the committed snapshot handed to joiners stays as it was
            for i, t in zip(indices, theta0):
                self.theta0[i] = t
            self.round += 1
            self.steps_in_round = 0
            self._committed = (self.round, self.theta0)

    def jump(self, round: int) -> None:
        """Enter ``round`` from where this worker is (its current parameters become the round-start values)."""
        self.set([p.detach() for p in self.params], self.momentum, round, copy_to_params=False)
        self.rejoins += 1

    # ------------------------------------------------------------------ state for joiners
    def committed_state(self) -> tuple[int, bytes]:
        """``(round, payload)``: the last committed round-start parameters and the outer momentum (fp32) as a
        checked frame (authenticated with the job secret), preceded by the round as 8 bytes: what a joining peer
        adopts."""
        with self._lock:
            round_, theta0 = self._committed
        tensors = theta0 + self.momentum
        body, _ = Dense().encode(tensors, stateful=False)
        frame = encode_frame(Dense(), body, sender=self.rank, round=round_, fingerprint=self.fingerprint,
                             secret=self.secret)
        return round_, round_.to_bytes(8, "little") + frame

    def adopt(self, payload: bytes) -> int | None:
        """Take a peer's :meth:`committed_state` payload: its round, parameters and momentum. Returns the round, or
        None (logged) when the frame is rejected or the state is older than this worker's own round (a donor that
        was itself behind: in the pipeline chaos run a replica at round 54 took a state of round 20); then nothing
        changed."""
        import logging

        log = logging.getLogger("fgdiloco")
        try:
            r = int.from_bytes(payload[:8], "little")
            values = decode_frame(payload[8:], Dense(), self.theta0 + self.momentum, fingerprint=self.fingerprint,
                                  round=r, secret=self.secret)
        except FrameError as err:
            log.warning("fgdiloco rank %d: rejected a peer's state (%s); joining with its own", self.rank, err)
            return None
        if r < self.round:
            log.warning("fgdiloco rank %d: a peer's state of round %d is older than this worker's own (round %d); "
                        "joining with its own", self.rank, r, self.round)
            return None
        n = len(self.params)
        self.set(values[:n], values[n:], r)
        self.rejoins += 1
        return r

    # ------------------------------------------------------------------ checkpoints
    def load(self, state: dict[str, Any], checked: dict[str, Any], model: torch.nn.Module) -> None:
        """Restore a validated ``state_dict``: anchor, outer optimizer, model parameters and buffers, counters.
        ``checked``: what :func:`~fgdiloco.outer.checkpoint.validate_state` returned for it (the outer momentum, or
        the torch outer optimizer's state dict to load)."""
        version, momentum = state["version"], checked["momentum"]
        with torch.no_grad():
            if checked["outer_optimizer"] is not None:
                self.optimizer.load_prepared(checked["outer_optimizer"])
                momentum = self.momentum
            self.set(state["anchor"], momentum, int(state["round"]), copy_to_params=False)
            if version >= 3:
                for p, saved in zip(self.params, state["params"]):
                    p.copy_(saved)
                own = dict(model.named_buffers())
                for n, b in state["buffers"].items():
                    own[n].copy_(b)
            elif state["steps_in_round"] == 0:
                for p, t in zip(self.params, self.theta0):
                    p.copy_(t)
        self.steps_in_round = int(state["steps_in_round"])
        self.fresh = False
