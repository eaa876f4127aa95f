"""The outer loop's state on one worker (:class:`OuterState`) and its checkpoint format (``state_dict``).

The state is what the next outer round starts from: the round-start parameters ``θ_i^t`` and the outer momentum
(fp32 master copies, also for bf16/fp16 models), the round and step counters and the exchange keys' generation.
A committed round replaces the lists as a whole (tensors are never changed in place), so
:attr:`OuterState.committed_state` can hand a consistent snapshot to a joining peer from another thread without a
copy.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from ..factor.codec import Dense
from ..factor.frame import FrameError, decode_frame, encode_frame
from .optimizer import OuterOptimizer

__all__ = ["OuterState", "STATE_VERSION", "validate_state"]

# 4: + "fragments", "outer_optimizer" (a torch outer optimizer's state_dict, or None) and "overlap_delta" (the
#    pseudo-gradient an overlapped Mix2 was mixing when the state was saved, or None);
# 3: + the model's trainable parameters and buffers ("params", "buffers") and the key "generation";
# 2: fp32 outer momentum owned by the wrapper ("momentum"); 1: outer momentum as a torch.optim.SGD state ("outer")
STATE_VERSION = 4
_STATE_KEYS = ("version", "inner", "anchor", "round", "steps_in_round", "seed", "topology", "world_size", "rank",
               "fingerprint", "codec", "mix1_codec")
_STATE_KEYS_BY_VERSION = {1: ("outer",), 2: ("momentum",), 3: ("momentum", "params", "buffers", "generation"),
                          4: ("momentum", "params", "buffers", "generation", "fragments", "outer_optimizer",
                              "overlap_delta")}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
        None (logged) when the frame is rejected (then nothing changed)."""
        import logging

        try:
            r = int.from_bytes(payload[:8], "little")
            values = decode_frame(payload[8:], Dense(), self.theta0 + self.momentum, fingerprint=self.fingerprint,
                                  round=r, secret=self.secret)
        except FrameError as err:
            logging.getLogger("fgdiloco").warning("fgdiloco rank %d: rejected a peer's state (%s); joining with its "
                                                  "own", self.rank, err)
            return None
        n = len(self.params)
        self.set(values[:n], values[n:], r)
        self.rejoins += 1
        return r

    # ------------------------------------------------------------------ checkpoints
    def load(self, state: dict[str, Any], momentum: list[torch.Tensor], model: torch.nn.Module) -> None:
        """Restore a validated ``state_dict`` (:func:`validate_state`): anchor, outer optimizer, model parameters
        and buffers, counters."""
        version = state["version"]
        with torch.no_grad():
            if state.get("outer_optimizer") is not None:
                self.optimizer.load_state_dict(state["outer_optimizer"])
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


# ---------------------------------------------------------------------------------------------------- validation
def _check_tensors(key: str, saved: Any, like: list[torch.Tensor], names: list[str]) -> None:
    if not isinstance(saved, (list, tuple)) or len(saved) != len(like):
        n = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
        raise ValueError(f"state dict {key!r} must be a list of {len(like)} tensors (one per trainable "
                         f"parameter), got {n}")
    for name, t, ref in zip(names, saved, like):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"state dict {key!r} entry for {name} must be a floating-point tensor, got "
                             f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"state dict {key!r} entry for {name} has shape {tuple(t.shape)}, the model's "
                             f"parameter has {tuple(ref.shape)}")


def _check_header(state: Any, expect: dict[str, Any]) -> int:
    if not isinstance(state, dict) or state.get("version") not in _STATE_KEYS_BY_VERSION:
        got = f"version {state.get('version')!r}" if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not an FGDiLoCo state dict of version {', '.join(map(str, _STATE_KEYS_BY_VERSION))} "
                         f"(got {got})")
    version = state["version"]
    for key in _STATE_KEYS + _STATE_KEYS_BY_VERSION[version]:
        if key not in state:
            raise ValueError(f"state dict (version {version}) lacks the key {key!r}")
    if state["fingerprint"] != expect["fingerprint"]:
        raise ValueError("state dict was saved for another model layout (parameter names, shapes or dtypes)")
    for key in ("rank", "world_size"):
        if state[key] != expect[key]:
            raise ValueError(f"state dict was saved by {key}={state[key]!r}, this worker has {key}="
                             f"{expect[key]}: load each worker's own state dict"
                             + (" into the same number of workers" if key == "world_size" else ""))
    for key in ("codec", "mix1_codec"):
        entry = state[key]
        if not isinstance(entry, dict) or not isinstance(entry.get("state"), dict):
            raise ValueError(f"state dict {key!r} must be a dict with 'name' and 'state'")
        if entry.get("name") != expect[key]:
            raise ValueError(f"state dict was saved with {key}={entry.get('name')!r}, this run uses "
                             f"{expect[key]!r}")
    if state["seed"] != expect["seed"]:
        raise ValueError(f"state dict was saved with seed={state['seed']}, this run uses seed={expect['seed']}; "
                         "the gossip schedule would change")
    if state["topology"] != expect["topology"]:
        raise ValueError(f"state dict was saved with topology={state['topology']!r}, this run uses "
                         f"{expect['topology']!r}")
    return version


def _saved_momentum(state: dict[str, Any], like: list[torch.Tensor]) -> list[torch.Tensor]:
    if state["version"] != 1:
        return state["momentum"]
    outer = state["outer"]
    if not isinstance(outer, dict) or not isinstance(outer.get("state"), dict):
        raise ValueError("state dict 'outer' (version 1) must be a torch.optim.SGD state dict")
    momentum = [outer["state"].get(i, {}).get("momentum_buffer") for i in range(len(like))]
    return [torch.zeros_like(t) if m is None else m for m, t in zip(momentum, like)]


def _check_buffers(state: dict[str, Any], model: torch.nn.Module) -> None:
    if not _is_int(state["generation"]) or state["generation"] < 0:
        raise ValueError(f"state dict 'generation' must be an int >= 0, got {state['generation']!r}")
    buffers, own = state["buffers"], dict(model.named_buffers())
    if not isinstance(buffers, dict) or set(buffers) != set(own):
        got = sorted(buffers) if isinstance(buffers, dict) else type(buffers).__name__
        raise ValueError(f"state dict 'buffers' must hold the model's buffers {sorted(own)}, got {got}")
    for n, b in buffers.items():
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != tuple(own[n].shape):
            raise ValueError(f"state dict buffer {n!r} must be a tensor of shape {tuple(own[n].shape)}")


def _check_inner(state: dict[str, Any], inner: torch.optim.Optimizer) -> None:
    saved = state["inner"]
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise ValueError("state dict 'inner' must be the inner optimizer's state_dict()")
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in saved["param_groups"]]
    own_sizes = [len(g["params"]) for g in inner.param_groups]
    if sizes != own_sizes:
        raise ValueError(f"state dict 'inner' has parameter groups of sizes {sizes}, the inner optimizer "
                         f"{own_sizes}")


def validate_state(state: Any, *, expect: dict[str, Any], outer: OuterState, names: list[str],
                   model: torch.nn.Module, inner: torch.optim.Optimizer, sync_every: int) -> list[torch.Tensor]:
    """Check a ``state_dict`` against this worker without changing anything; returns its outer momentum (version
    1 states keep it as an SGD state). ``expect``: this worker's ``fingerprint``, ``rank``, ``world_size``,
    ``codec`` and ``mix1_codec`` names, ``seed``, ``topology`` name, ``fragments`` count and ``torch_outer`` (a torch
    outer optimizer, whose state is its own ``state_dict``).

    Raises:
        ValueError: not a state dict of a known version, a missing key (named), another model layout, rank, world
            size, codec, seed or topology, tensors of the wrong type or shape, or inner optimizer parameter groups
            that do not match.
    """
    version = _check_header(state, expect)
    if not _is_int(state["round"]) or state["round"] < 0:
        raise ValueError(f"state dict 'round' must be an int >= 0, got {state['round']!r}")
    steps = state["steps_in_round"]
    if not _is_int(steps) or not 0 <= steps < sync_every:
        raise ValueError(f"state dict 'steps_in_round' must be an int in [0, {sync_every}) (inner steps between "
                         f"outer rounds), got {steps!r}")
    _check_tensors("anchor", state["anchor"], outer.theta0, names)
    torch_outer = state.get("outer_optimizer") is not None
    if version >= 4:
        if state["fragments"] != expect["fragments"]:
            raise ValueError(f"state dict was saved with fragments={state['fragments']!r}, this run uses "
                             f"{expect['fragments']!r}")
        if torch_outer != expect["torch_outer"]:
            raise ValueError("state dict was saved with another kind of outer optimizer (a torch optimizer's state "
                             "and the built-in Nesterov momentum do not load into each other)")
    momentum = [] if torch_outer else _saved_momentum(state, outer.theta0)
    if not torch_outer:
        _check_tensors("outer" if version == 1 else "momentum", momentum, outer.theta0, names)
    if version >= 3:
        _check_tensors("params", state["params"], outer.params, names)
        _check_buffers(state, model)
    _check_inner(state, inner)
    if version < STATE_VERSION:
        warnings.warn(f"FGDiLoCo state dict of an older format (version {version}, this build writes "
                      f"{STATE_VERSION}) without the model's weights: "
                      + ("the model's parameters are set from the saved round-start anchor" if
                         state["steps_in_round"] == 0 else "load the model's weights after building the "
                         "wrapper (broadcast_init overwrites them with rank 0's)"), stacklevel=3)
    return momentum
