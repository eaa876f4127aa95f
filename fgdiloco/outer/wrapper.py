"""``FGDiLoCo``: the optimizer wrapper that runs Factored Gossip DiLoCo around the user's inner optimizer."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..factor.codec import Codec, Dense, resolve_codec
from ..factor.frame import FrameError, decode_frame, encode_frame, job_secret, layout_fingerprint
from ..gossip.mix import MAX_RATIO, Mixer, MixResult, PeerHealth
from ..gossip.topology import Topology, make_topology
from ..gossip.transport import (
    Background,
    DistributedTransport,
    Transport,
    call_with_deadline,
    drain_background,
    running_background,
)
from ..mesh import ReplicaMesh
from .stats import RoundStats

__all__ = ["FGDiLoCo"]

log = logging.getLogger("fgdiloco")

# 3: + the model's trainable parameters and buffers ("params", "buffers") and the key "generation";
# 2: fp32 outer momentum owned by the wrapper ("momentum"); 1: outer momentum as a torch.optim.SGD state ("outer")
STATE_VERSION = 3
#: An elastic worker this many outer rounds behind the live round (it hung, or its peers went on without it)
#: rejoins there (:meth:`FGDiLoCo.rejoin`); a round or two behind is normal (its peers wait for it at their next
#: exchange with it, so the job pulls itself back into step).
CATCH_UP_ROUNDS = 3
_STATE_KEYS = ("version", "inner", "anchor", "round", "steps_in_round", "seed", "topology", "world_size", "rank",
               "fingerprint", "codec", "mix1_codec")
_STATE_KEYS_BY_VERSION = {1: ("outer",), 2: ("momentum",), 3: ("momentum", "params", "buffers", "generation")}

# Wrappers whose next round's Mix1 may be in flight. At interpreter exit each one lets its exchange finish (both
# peers do the same, so it ends quickly; a dead peer costs at most the timeout): a daemon thread killed inside a
# Gloo call aborts the process ("terminate called without an active exception").
_LIVE: weakref.WeakSet[FGDiLoCo] = weakref.WeakSet()


_EXIT_WAIT = [0.0]  # the longest timeout of any wrapper built in this process: the most an exchange can still run


@atexit.register
def _drain_at_exit() -> None:
    limit = _EXIT_WAIT[0]
    for opt in list(_LIVE):
        opt.close()
    if limit:  # exchanges given up on may still be inside Gloo: let them end (each within its timeout)
        waiting = running_background()
        if waiting:
            log.warning("fgdiloco: waiting (at most %.0f s) for %d exchange(s) to end before exit: %s", limit,
                        len(waiting), ", ".join(waiting[:5]))
        left = drain_background(limit)
        if left:
            log.warning("fgdiloco: exiting with exchanges still running: %s", ", ".join(left[:5]))


_SIGTERM_PREVIOUS: list[Any] = []  # the handler ours replaced (installed once per process)


def _leave_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (torchrun's agent, a scheduler, ``kill``): post every live wrapper's departure notice (at most 1 s
    each), so peers stop waiting for this worker at once, then do what the previous handler did."""
    for opt in list(_LIVE):
        if opt.transport is not None:
            with contextlib.suppress(Exception):
                call_with_deadline(opt.transport.leave, 1.0, "departure notice")
    previous = _SIGTERM_PREVIOUS[0]
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    """Chain :func:`_leave_on_sigterm` before the current SIGTERM handler, once, from the main thread only (signal
    handlers cannot be set elsewhere); an ignored SIGTERM stays ignored."""
    if _SIGTERM_PREVIOUS or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None):
        return
    _SIGTERM_PREVIOUS.append(previous)
    signal.signal(signal.SIGTERM, _leave_on_sigterm)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_number(name: str, value: Any, *, low: float, low_ok: bool, high: float | None = None,
                  allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number ({allowed}), got {type(value).__name__}")
    ok = (value >= low if low_ok else value > low) and (high is None or value < high) and math.isfinite(value)
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _check_count(name: str, value: Any, *, minimum: int, what: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int >= {minimum} ({what}), got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} ({what}), got {value}")
    return value


class FGDiLoCo:
    """Factored Gossip DiLoCo around an inner optimizer (Hewa Koneputugodage et al., ICML 2026, arXiv 2606.22768).

    Each worker runs its own copy of the model. Every ``sync_every`` (H) inner steps one *outer round* ends:

    1. **Mix1** (non-blocking) gossips the round-start parameters ``θ_i^t`` (and, with ``mix_momentum``, the outer
       momentum buffers) with ``mix1_rounds`` peers. It starts at the round start in a background thread and
       overlaps the H inner steps; it depends only on round-start values, so it is never stale.
    2. The inner optimizer takes H steps from the *unmixed* ``θ_i^t``; the pseudo-gradient is
       ``Δ_i = θ_i^t − θ_i``.
    3. **Mix2** (blocking) gossips ``Δ_i`` through ``codec`` over ``mix2_rounds`` gossip rounds: ``Δ̄_i``. Every
       pairwise round is consensus-safe: the pair's sum (hence the workers' average) is preserved and the
       disagreement never grows beyond the codec's quantisation floor, for every codec (the low-rank codec
       projects both peers onto one basis they agree on; see :mod:`fgdiloco.gossip.mix` and
       :class:`~fgdiloco.factor.LowRank`); an exchange is applied by both peers or by neither. Its pair
       connections are set up in the background at round start.
    4. Wait for Mix1: ``θ̄_i``. The local outer step (SGD with Nesterov momentum) gives
       ``θ_i^{t+1} = θ̄_i − outer_lr · Nesterov(Δ̄_i)``. The round-start parameters and the momentum are kept as
       fp32 master copies, also for bf16/fp16 models. The inner optimizer's state is kept across rounds.

    With ``topology="allreduce"`` both mixes are the exact average and this is DiLoCo (Douillard et al., arXiv
    2311.08105): every worker computes a bit-identical mean, and Mix1 becomes a cheap check (an 8-byte digest of
    parameters and momentum per worker) that re-syncs replicas that differ for any reason (different initial
    weights without ``broadcast_init``, a frame one worker rejected) by averaging them exactly: they are identical
    again one round later. ``mix2_rounds=0`` makes synchronisation fully non-blocking; more Mix2 rounds tighten
    agreement at the price of blocking time.

    Use it like any optimizer::

        opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=3e-4), sync_every=50)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    The round is triggered by a step hook on the inner optimizer, so stepping ``inner_optimizer`` directly (as
    Lightning or a ``GradScaler`` does) counts as well. Attach LR schedulers to the inner optimizer.

    Tuning: raise ``sync_every`` until the inner steps of one round take longer than Mix1 takes on your network
    (utilisation in :attr:`last_round` near 1); ``outer_lr`` 0.7 with momentum 0.9 and Nesterov is DiLoCo's
    setting for long runs (hundreds of rounds); with few rounds, lower momentum (the example job uses 0.3) avoids
    overshooting. Local outer momentum amplifies each worker's own pull by about ``1/(1 − momentum)``;
    ``mix_momentum=True`` (default) gossips the momentum buffers in Mix1 as well, which keeps them from drifting
    apart (measured in ``benchmarks/consensus.py``) at twice Mix1's bytes, which stay hidden behind the inner
    steps while they fit in the round. If ``last_round.consensus_relative`` keeps growing, add Mix2 rounds or use
    the exponential topology. Wrap evaluation between steps in :meth:`paused` to keep it out of ``utilisation``.

    Args:
        model: the worker's model. Its trainable parameters (``requires_grad``) are synchronised.
        inner_optimizer: a ``torch.optim.Optimizer`` over (at least) all trainable parameters of ``model``.
        sync_every: H, inner steps per outer round (int >= 1).
        outer_lr: outer learning rate η (> 0).
        outer_momentum: outer momentum in [0, 1).
        nesterov: Nesterov momentum for the outer step (ignored when ``outer_momentum`` is 0).
        topology: ``"random"`` (default), ``"exponential"``, ``"ring"``, ``"allreduce"`` or a
            :class:`~fgdiloco.gossip.Topology`.
        mix1_rounds: gossip rounds of Mix1 per outer round (int >= 0).
        mix2_rounds: gossip rounds of Mix2 per outer round (int >= 0).
        codec: Mix2's codec (name or :class:`~fgdiloco.factor.Codec`); default lossless ``"dense"`` fp32.
        mix1_codec: Mix1's codec: a stateless value codec (``"dense"``, ``"bf16"``, ``"int8"`` or a Codec with
            ``stateful = False``); default ``"bf16"``, half of dense's bytes. Parameters are mixed in difference
            form, so the rounding never touches a replica's own value, but it sets a floor under the replicas'
            disagreement after a Mix1 round: about ``2⁻⁹·|θ|`` per element for bf16 (half a bf16 step, 2⁻⁸
            relative, on each side), half an int8 step of each block's absmax for int8; ``"dense"`` is lossless.
        mix_momentum: gossip the outer momentum buffers in Mix1 together with the parameters (same codec, twice
            the bytes).
        timeout: seconds each exchange may take before it counts as failed (the worker keeps its own value).
        seed: seed of random gossip schedules (any int; all 64 bits count; must be equal on all workers).
        broadcast_init: copy rank 0's parameters and buffers to every worker at construction.
        process_group: the ``torch.distributed`` group of the workers (default: the default group when
            ``torch.distributed`` is initialised; a single worker otherwise).
        transport: a custom :class:`~fgdiloco.gossip.Transport` (tests, other networks); overrides
            ``process_group`` and disables ``broadcast_init``.
        mesh: a :class:`~fgdiloco.ReplicaMesh` when ``model`` is one pipeline stage (e.g. driven by
            :class:`fgdiloco.pipeline.Pipeline`): gossip then runs among the same stage of the other replicas only
            (over ``mesh.gossip_group``; the topology pairs every stage of a replica with the same peer replica,
            since all stages derive it from the same seed), ``broadcast_init`` copies the first replica's stage,
            and the frame fingerprint includes the stage index, so a frame of another stage is rejected even when
            two stages have the same layout. Exclusive with ``process_group``.
        elastic: join an elastic job (:mod:`fgdiloco.elastic`: each worker its own ``torchrun`` job, all meeting
            on a gossip store no worker hosts, as ``fgdiloco launch`` starts them): the transport is
            :func:`fgdiloco.elastic.connect` (settings from ``FGDILOCO_STORE``, ``FGDILOCO_WORKER``,
            ``FGDILOCO_WORKERS``), no ``broadcast_init`` (seed the model the same on every worker), and the worker
            joins the job at its live round (:meth:`rejoin`) at its first step and whenever it finds itself
            ``CATCH_UP_ROUNDS`` behind. Not with ``process_group``, ``mesh``, ``transport`` or the ``allreduce``
            topology (it needs a group).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument out of range (the message names it and what is allowed), a stateful
            ``mix1_codec``, or an inner optimizer that does not hold all of the model's trainable parameters.

    Construction is collective over the process group: every worker must construct it.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        topology: str | Topology = "random",
        mix1_rounds: int = 1,
        mix2_rounds: int = 1,
        codec: Codec | str | None = None,
        mix1_codec: Codec | str | None = None,
        mix_momentum: bool = True,
        timeout: float = 60.0,
        seed: int = 0,
        broadcast_init: bool = True,
        process_group: dist.ProcessGroup | None = None,
        transport: Transport | None = None,
        mesh: ReplicaMesh | None = None,
        elastic: bool = False,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        checked = self.check_arguments(
            sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
            topology=topology, mix1_rounds=mix1_rounds, mix2_rounds=mix2_rounds, codec=codec, mix1_codec=mix1_codec,
            mix_momentum=mix_momentum, timeout=timeout, seed=seed)
        self.sync_every: int = checked["sync_every"]
        self.outer_lr: float = checked["outer_lr"]
        self.outer_momentum: float = checked["outer_momentum"]
        self.nesterov: bool = checked["nesterov"]
        self.mix1_rounds: int = checked["mix1_rounds"]
        self.mix2_rounds: int = checked["mix2_rounds"]
        self.timeout: float = checked["timeout"]
        self.seed: int = checked["seed"]
        self.codec: Codec = checked["codec"]
        self.mix1_codec: Codec = checked["mix1_codec"]
        self.mix_momentum: bool = checked["mix_momentum"]

        self.model = model
        self.inner_optimizer = inner_optimizer
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model has no trainable parameters (requires_grad=True) to synchronise")
        held = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        missing = [n for n, p in named if id(p) not in held]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"inner_optimizer does not hold {len(missing)} of the model's trainable parameters "
                             f"({shown}); build it from model.parameters()")
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._param_ids = {id(p) for p in self.params}
        extra = self._unsynchronised()
        if extra:
            raise ValueError(f"inner_optimizer holds {len(extra)} trainable parameter(s) that are not trainable "
                             f"parameters of model ({', '.join(extra[:5])}): they would be trained but never "
                             "synchronised; build it from model.parameters()")
        self._n_held = self._count_held()
        layout = [(n, p.shape, p.dtype) for n, p in named]
        if mesh is not None:
            if not isinstance(mesh, ReplicaMesh):
                raise TypeError(f"mesh must be a fgdiloco.ReplicaMesh or None, got {type(mesh).__name__}")
            if process_group is not None:
                raise ValueError("pass either mesh (gossip over mesh.gossip_group) or process_group, not both")
            layout.insert(0, (f"<pipeline stage {mesh.stage} of {mesh.stages}>", (), "stage"))
        self.mesh = mesh
        self.fingerprint = layout_fingerprint(layout)

        # Who the workers are.
        name = topology.name if isinstance(topology, Topology) else topology
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be a bool, got {type(elastic).__name__}")
        if elastic:
            taken = [n for n, v in (("process_group", process_group), ("mesh", mesh), ("transport", transport))
                     if v is not None]
            if taken:
                raise ValueError(f"elastic=True builds its own transport: drop {', '.join(taken)}")
            if (make_topology(name, 1).exact if isinstance(topology, str) else topology.exact):
                raise ValueError(f"elastic=True cannot use the exact topology {name!r} (it needs a process group); "
                                 "use 'random', 'exponential' or 'ring'")
            from ..elastic import connect

            transport = connect(timeout=self.timeout)
            broadcast_init = False
        self.elastic = elastic
        self._owns_transport = transport is None or elastic
        if transport is None and (process_group is not None or mesh is not None
                                  or (dist.is_available() and dist.is_initialized())):
            exact = make_topology(name, 1).exact if isinstance(topology, str) else topology.exact
            if mesh is not None:  # the mesh built the stage's group: no new_group here (collective over all)
                transport = DistributedTransport(mesh.gossip_group, timeout=self.timeout, exact=exact,
                                                 collective_group=mesh.gossip_group)
            else:
                transport = DistributedTransport(process_group, timeout=self.timeout, exact=exact)
            if broadcast_init:
                self._broadcast_from_rank0(transport)
        self.transport = transport
        self.rank = transport.rank if transport else 0
        self.world_size = transport.world_size if transport else 1
        self.topology = make_topology(topology, self.world_size, seed)
        topo2 = topology if isinstance(topology, Topology) else make_topology(name, self.world_size, seed + 1)
        health = PeerHealth()
        secret = job_secret()
        self._mixer1 = Mixer("mix1", self.topology, transport, self.mix1_codec, self.mix1_rounds, self.fingerprint,
                             self.timeout, offset=0, health=health, resync=True, secret=secret,
                             max_ratio=MAX_RATIO)
        self._mixer2 = Mixer("mix2", topo2, transport, self.codec, self.mix2_rounds, self.fingerprint,
                             self.timeout, offset=1, health=health, secret=secret, max_ratio=MAX_RATIO)
        self.authenticated = secret is not None

        with torch.no_grad():  # fp32 master copies: the outer step of a bf16 model runs in fp32
            self._theta0 = [p.detach().to(torch.float32, copy=True) for p in self.params]
            self._momentum = [torch.zeros_like(t) for t in self._theta0]
        self._round = 0
        self._steps_in_round = 0
        self._mix1: Background | None = None
        self._round_t0: float | None = None
        self._paused_seconds = 0.0
        self.last_round: RoundStats | None = None
        self.failed_exchanges_total = 0
        self.skipped_exchanges_total = 0
        self.out_of_scale_total = 0
        self.rejoins = 0
        self._joined = not elastic  # an elastic worker joins at the live round at its first step
        self._fresh = True  # no state loaded: a worker joining a running job takes a live peer's state
        self._generation = 0
        self._hooks = [inner_optimizer.register_step_pre_hook(self._pre_step),
                       inner_optimizer.register_step_post_hook(self._post_step)]
        _LIVE.add(self)
        _EXIT_WAIT[0] = max(_EXIT_WAIT[0], self.timeout)
        if self.world_size > 1:
            _install_sigterm_handler()

    @staticmethod
    def check_arguments(*, sync_every: int, outer_lr: float, outer_momentum: float, nesterov: bool,
                        topology: str | Topology, mix1_rounds: int, mix2_rounds: int, codec: Codec | str | None,
                        mix1_codec: Codec | str | None, mix_momentum: bool, timeout: float,
                        seed: int) -> dict[str, Any]:
        """Check the constructor's scalar arguments without building anything (no model, no communication).

        Every argument is required: the defaults live in the constructor (and in integrations' own signatures).

        Returns the normalised values (floats as float, codecs resolved to instances, ``nesterov`` False when
        there is no momentum). Integrations such as the Lightning strategy call it to fail early, when they are
        built. Raises the same ``TypeError``/``ValueError`` as the constructor.
        """
        out: dict[str, Any] = {
            "sync_every": _check_count("sync_every", sync_every, minimum=1, what="inner steps H per outer round"),
            "outer_lr": _check_number("outer_lr", outer_lr, low=0.0, low_ok=False, allowed="a finite number > 0"),
            "outer_momentum": _check_number("outer_momentum", outer_momentum, low=0.0, low_ok=True, high=1.0,
                                            allowed="in [0, 1)"),
            "mix1_rounds": _check_count("mix1_rounds", mix1_rounds, minimum=0, what="gossip rounds of Mix1"),
            "mix2_rounds": _check_count("mix2_rounds", mix2_rounds, minimum=0, what="gossip rounds of Mix2"),
            "timeout": _check_number("timeout", timeout, low=0.0, low_ok=False, allowed="seconds > 0"),
        }
        if not _is_int(seed):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
        if not isinstance(mix_momentum, bool):
            raise TypeError(f"mix_momentum must be a bool, got {type(mix_momentum).__name__}")
        out["seed"] = seed
        out["mix_momentum"] = mix_momentum
        out["nesterov"] = bool(nesterov) and out["outer_momentum"] > 0
        if not isinstance(topology, Topology):
            make_topology(topology, 1)  # unknown names and wrong types raise here, before any communication
        out["topology"] = topology
        out["codec"] = resolve_codec(codec, default="dense", argument="codec")
        out["mix1_codec"] = resolve_codec(mix1_codec, default="bf16", argument="mix1_codec")
        if out["mix1_codec"].stateful:
            raise ValueError(f"mix1_codec={out['mix1_codec']!r} keeps per-worker state (warm starts or error "
                             "feedback), which is not safe for parameters; use a stateless value codec: 'dense' "
                             "(lossless), 'bf16' (default) or 'int8'")
        if out["codec"] is out["mix1_codec"]:
            raise ValueError("codec and mix1_codec must be different Codec instances: a codec keeps per-tensor "
                             "state (error feedback, warm start) and the two mixes run in different threads")
        return out

    # ------------------------------------------------------------------ set-up
    def _count_held(self) -> int:
        return sum(len(g["params"]) for g in self.inner_optimizer.param_groups)

    def _unsynchronised(self) -> list[str]:
        """Trainable parameters (``requires_grad``) of the model or the inner optimizer that are not synchronised
        (added with ``add_param_group``, unfrozen, or never part of the model), by name or shape."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out, seen = [], set()
        candidates = [p for g in self.inner_optimizer.param_groups for p in g["params"]]
        candidates += list(self.model.parameters())
        for p in candidates:
            if p.requires_grad and id(p) not in self._param_ids and id(p) not in seen:
                seen.add(id(p))
                out.append(names.get(id(p), f"<tensor of shape {tuple(p.shape)} not in model>"))
        return out

    def _check_parameters(self) -> None:
        extra = self._unsynchronised()
        if extra:
            raise RuntimeError(
                f"{len(extra)} trainable parameter(s) are not synchronised by FGDiLoCo ({', '.join(extra[:5])}): "
                "a parameter added to the inner optimizer (add_param_group) or unfrozen after the wrapper was built "
                "would train on this worker only. Build the wrapper after the model and inner optimizer are "
                "complete, or freeze the parameter (requires_grad=False)")

    def _broadcast_from_rank0(self, transport: DistributedTransport) -> None:
        src = transport.global_ranks[0]
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                dist.broadcast(t.data, src=src, group=transport.group)

    # ------------------------------------------------------------------ the user's API
    @property
    def round(self) -> int:
        """Outer rounds completed so far."""
        return self._round

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups."""
        return self.inner_optimizer.param_groups

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One inner optimizer step; every ``sync_every``-th one ends with the outer round. Returns the closure's
        loss, like ``torch.optim.Optimizer.step``."""
        return self.inner_optimizer.step(closure) if closure is not None else self.inner_optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside out of this round's clock (``round_seconds``, ``inner_seconds``).

        Use it around work between inner steps that is not training, such as evaluation or checkpointing, so that
        ``utilisation`` measures training only. Mix1 keeps running in the background meanwhile::

            with opt.paused():
                val_loss = evaluate(model)
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ the round state machine
    @property
    def _momentum_in_mix1(self) -> bool:
        # the exact topology's Mix1 is a digest check: momentum costs nothing there and is re-synced with the rest
        return self.mix_momentum or self.topology.exact

    def _mix1_values(self) -> list[torch.Tensor]:
        """What Mix1 moves: the round-start parameters, then (``mix_momentum``) the outer momentum buffers."""
        values = [t.clone() for t in self._theta0]
        if self._momentum_in_mix1:
            values += [m.clone() for m in self._momentum]
        return values

    def _start_round(self) -> None:
        """Round start: Mix1 of the round-start values in the background, and Mix2's exchanges set up. An elastic
        worker first joins the live round if it is new or has fallen behind."""
        self._check_parameters()
        if self.elastic:
            if self._joined:  # a worker that has not joined yet has nothing to give
                self._serve_state_requests()
            self._catch_up(1 if not self._joined else CATCH_UP_ROUNDS, adopt=not self._joined and self._fresh)
            self._joined = True
            with contextlib.suppress(Exception):  # a store we cannot reach: peers see an older round
                self.transport.publish_round(self._round)
        values, outer_round = self._mix1_values(), self._round
        self._mix1 = Background(lambda: self._run_mix1(values, outer_round), f"mix1-{outer_round}")
        self._mixer2.prepare(self._round)

    def rejoin(self) -> int:
        """Join the job at its live round: the newest outer round a peer has started
        (:meth:`~fgdiloco.gossip.Transport.live_round`), when that is ahead of this worker's. Returns the round
        this worker is in afterwards.

        For a worker that restarted (after loading its own checkpoint, or fresh) or hung and came back: it skips
        the rounds it missed, starting the live round from its own parameters, outer momentum and inner optimizer
        state (Mix1 of that round pulls the parameters and momentum toward its peers at once); its peers reset
        their back-off for it as soon as they see it is a new process. Counted in :attr:`rejoins` and in
        ``RoundStats.rejoins``, logged. An elastic wrapper (``elastic=True``) does it by itself at its first step
        and whenever it is ``CATCH_UP_ROUNDS`` behind; a Mix1 in flight is waited for and dropped first.
        Without a transport that knows the live round (not elastic) it changes nothing.
        """
        if self._mix1 is not None:
            with contextlib.suppress(Exception):
                self._mix1.result()
            self._mix1 = None
            self._mixer1.discard_prepared()
            self._mixer2.discard_prepared()
        self._catch_up(1, adopt=self._fresh)
        self._joined = True
        return self._round

    @torch.no_grad()
    def _catch_up(self, behind: int, adopt: bool = False) -> None:
        """Join the live round (the newest a peer has started) when it is at least ``behind`` rounds ahead (see
        :meth:`rejoin`); for ``behind > 1`` (has this worker fallen behind?) the lag is measured against the
        peers' median round, so a worker that lost a few seconds to a dead peer while two others went on is
        waited for, not moved. ``adopt``: take a live peer's round-start parameters and outer momentum first (a
        worker with no state of its own)."""
        if self.transport is None:
            return
        try:
            if behind <= 1:
                live = self.transport.live_round()
            else:
                rounds = sorted(self.transport.peer_rounds().values())
                live = rounds[(len(rounds) - 1) // 2] if rounds else None
        except Exception as err:  # noqa: BLE001 - a store we cannot reach: stay where we are
            log.debug("fgdiloco: could not read the peers' rounds: %s", err)
            return
        if live is None or live - self._round < behind:
            return
        if adopt and self._adopt():
            return
        log.warning("fgdiloco rank %d: joining the job at outer round %d (this worker was at round %d, step %d "
                    "of it)", self.rank, live, self._round, self._steps_in_round)
        for p, t in zip(self.params, self._theta0):  # the live round starts from where this worker is
            t.copy_(p.detach().to(torch.float32))
        self._round = live
        self._steps_in_round = 0
        self._round_t0 = time.perf_counter()
        self._paused_seconds = 0.0
        self.rejoins += 1

    def _state_payload(self) -> bytes:
        """This worker's round-start parameters and outer momentum (fp32), as a checked frame (authenticated
        with the job secret), preceded by the round as 8 bytes: what a joining peer adopts."""
        codec = Dense()
        body, _ = codec.encode(self._theta0 + self._momentum, stateful=False)
        frame = encode_frame(codec, body, sender=self.rank, round=self._round, fingerprint=self.fingerprint,
                             secret=self._mixer1.secret)
        return self._round.to_bytes(8, "little") + frame

    def _serve_state_requests(self) -> None:
        """Answer the state requests of joining peers (one store read when there are none)."""
        try:
            for peer, incarnation in self.transport.state_requests():
                if self.transport.offer_state(peer, incarnation, self._state_payload()):
                    log.info("fgdiloco rank %d: sent round %d's state to joining rank %d", self.rank, self._round,
                             peer)
        except Exception as err:  # noqa: BLE001 - a store we cannot reach: the joiner falls back to its own
            log.debug("fgdiloco: could not answer state requests: %s", err)

    @torch.no_grad()
    def _adopt(self) -> bool:
        """Join with a live peer's state (see :meth:`rejoin`); False when none came within ``timeout`` or it was
        rejected (then the worker joins with its own)."""
        try:
            self.transport.request_state()
            payload = self.transport.await_state(self.timeout)
        except Exception as err:  # noqa: BLE001 - a store we cannot reach: join with our own state
            log.warning("fgdiloco rank %d: could not ask for a peer's state (%s); joining with its own", self.rank,
                        err)
            return False
        if payload is None:
            log.warning("fgdiloco rank %d: no peer sent its state (within %.0f s, or none is left); joining with "
                        "its own", self.rank, self.timeout)
            return False
        try:
            r = int.from_bytes(payload[:8], "little")
            values = decode_frame(payload[8:], Dense(), self._theta0 + self._momentum, fingerprint=self.fingerprint,
                                  round=r, secret=self._mixer1.secret)
        except FrameError as err:
            log.warning("fgdiloco rank %d: rejected a peer's state (%s); joining with its own", self.rank, err)
            return False
        n = len(self.params)
        self._theta0 = [v.to(device=t.device, dtype=torch.float32) for v, t in zip(values[:n], self._theta0)]
        self._momentum = [v.to(device=t.device, dtype=torch.float32) for v, t in zip(values[n:], self._momentum)]
        for p, t in zip(self.params, self._theta0):
            p.copy_(t)
        log.warning("fgdiloco rank %d: joined the job at outer round %d with a live peer's parameters and outer "
                    "momentum (this worker was at round %d)", self.rank, r, self._round)
        self._round, self._steps_in_round = r, 0
        self._round_t0 = time.perf_counter()
        self._paused_seconds = 0.0
        self.rejoins += 1
        return True

    @torch.no_grad()
    def _run_mix1(self, values: list[torch.Tensor], outer_round: int) -> MixResult:
        return self._mixer1.run(values, outer_round)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._count_held() != self._n_held:  # cheap: add_param_group is caught at the next step
            self._check_parameters()
        if self._mix1 is None:
            if self._round_t0 is None:
                self._round_t0 = time.perf_counter()
            self._start_round()

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._steps_in_round += 1
        if self._steps_in_round >= self.sync_every:
            self.sync()

    @torch.no_grad()
    def _outer_step(self, theta: list[torch.Tensor], delta: list[torch.Tensor],
                    momentum: list[torch.Tensor]) -> None:
        """``m ← μ·m + Δ̄``; ``θ ← θ̄ − η·(Δ̄ + μ·m)`` (Nesterov) or ``θ̄ − η·m``: ``torch.optim.SGD``'s rule (no
        dampening), on the fp32 masters."""
        mu, lr = self.outer_momentum, self.outer_lr
        for k, (t, d, m) in enumerate(zip(theta, delta, momentum)):
            if mu > 0:
                m = m.mul(mu).add_(d)
                step = d.add(m, alpha=mu) if self.nesterov else m
                self._momentum[k] = m
            else:
                step = d
            self._theta0[k] = t.sub(step, alpha=lr)

    @torch.no_grad()
    def sync(self) -> RoundStats:
        """End the current outer round now (Mix2, wait for Mix1, outer step) and start the next one.

        Called automatically after every ``sync_every``-th inner step; call it yourself only to end a round early.
        Every worker must end the same rounds.
        """
        t_sync = time.perf_counter()
        if self._mix1 is None:
            self._start_round()
        if self._round_t0 is None:
            self._round_t0 = t_sync
        if self.topology.exact:
            # Group steps of both mixes use the same collective group: Mix1's (tiny digest check) must be done
            # before Mix2's starts, on every worker, or the collectives of the two threads could interleave.
            self._mix1.result()
        delta = [t - p.detach().to(torch.float32) for t, p in zip(self._theta0, self.params)]
        mix2 = self._mixer2.run(delta, self._round)
        t_mix2 = time.perf_counter()
        mix1 = self._mix1.result()
        t_mix1 = time.perf_counter()
        n = len(self.params)
        theta = mix1.values[:n]
        momentum = mix1.values[n:] if self._momentum_in_mix1 else self._momentum
        self._outer_step(theta, mix2.values, momentum)
        for t, p in zip(self._theta0, self.params):
            p.copy_(t)
        t_end = time.perf_counter()

        round_seconds = t_end - self._round_t0 - self._paused_seconds
        blocked = t_end - t_sync
        inner_seconds = max(round_seconds - blocked, 0.0)
        cons = mix1.distance(range(n))
        cons_m = mix1.distance(range(n, 2 * n)) if self._momentum_in_mix1 else None
        cons_d = mix2.distance()
        stats = RoundStats(
            round=self._round,
            inner_steps=self._steps_in_round,
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
            rejoins=self.rejoins,
            mix1_peers=mix1.peers,
            mix2_peers=mix2.peers,
            errors=mix1.errors + mix2.errors,
        )
        self.failed_exchanges_total += stats.failed_exchanges
        self.skipped_exchanges_total += stats.skipped_exchanges
        self.out_of_scale_total += stats.out_of_scale
        self.last_round = stats
        self._round += 1
        self._steps_in_round = 0
        self._round_t0 = t_end
        self._paused_seconds = 0.0
        self._start_round()
        return stats

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same trajectory: inner optimizer state, fp32 outer momentum, the fp32
        round-start parameters (``anchor``), the model's trainable parameters and buffers as they are now (so the
        order of loading the model and building the wrapper does not matter, see :meth:`load_state_dict`), round
        and step counters, schedule seed and topology, rank and world size, codec states."""
        return {
            "version": STATE_VERSION,
            "inner": self.inner_optimizer.state_dict(),
            "momentum": [m.detach().clone() for m in self._momentum],
            "anchor": [t.detach().clone() for t in self._theta0],
            "params": [p.detach().clone() for p in self.params],
            "buffers": {n: b.detach().clone() for n, b in self.model.named_buffers()},
            "round": self._round,
            "steps_in_round": self._steps_in_round,
            "generation": self._generation,
            "sync_every": self.sync_every,
            "seed": self.seed,
            "topology": self.topology.name,
            "world_size": self.world_size,
            "rank": self.rank,
            "fingerprint": self.fingerprint,
            "codec": {"name": self.codec.name, "state": self.codec.state_dict()},
            "mix1_codec": {"name": self.mix1_codec.name, "state": self.mix1_codec.state_dict()},
        }

    def _check_tensors(self, key: str, saved: Any, like: list[torch.Tensor], names: list[str]) -> None:
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

    def _validate_state(self, state: Any) -> int:
        """Check a state dict against this wrapper without changing anything; returns its version."""
        if not isinstance(state, dict) or state.get("version") not in _STATE_KEYS_BY_VERSION:
            got = f"version {state.get('version')!r}" if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not an FGDiLoCo state dict of version {', '.join(map(str, _STATE_KEYS_BY_VERSION))} "
                             f"(got {got})")
        version = state["version"]
        for key in _STATE_KEYS + _STATE_KEYS_BY_VERSION[version]:
            if key not in state:
                raise ValueError(f"state dict (version {version}) lacks the key {key!r}")
        if state["fingerprint"] != self.fingerprint:
            raise ValueError("state dict was saved for another model layout (parameter names, shapes or dtypes)")
        for key in ("rank", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state dict was saved by {key}={state[key]!r}, this worker has {key}="
                                 f"{getattr(self, key)}: load each worker's own state dict"
                                 + (" into the same number of workers" if key == "world_size" else ""))
        for key, codec in (("codec", self.codec), ("mix1_codec", self.mix1_codec)):
            entry = state[key]
            if not isinstance(entry, dict) or not isinstance(entry.get("state"), dict):
                raise ValueError(f"state dict {key!r} must be a dict with 'name' and 'state'")
            if entry.get("name") != codec.name:
                raise ValueError(f"state dict was saved with {key}={entry.get('name')!r}, this run uses "
                                 f"{codec.name!r}")
        if state["seed"] != self.seed:
            raise ValueError(f"state dict was saved with seed={state['seed']}, this run uses seed={self.seed}; "
                             "the gossip schedule would change")
        if state["topology"] != self.topology.name:
            raise ValueError(f"state dict was saved with topology={state['topology']!r}, this run uses "
                             f"{self.topology.name!r}")
        if not _is_int(state["round"]) or state["round"] < 0:
            raise ValueError(f"state dict 'round' must be an int >= 0, got {state['round']!r}")
        steps = state["steps_in_round"]
        if not _is_int(steps) or not 0 <= steps < self.sync_every:
            raise ValueError(f"state dict 'steps_in_round' must be an int in [0, sync_every={self.sync_every}), "
                             f"got {steps!r}")
        self._check_tensors("anchor", state["anchor"], self._theta0, self.param_names)
        if version == 1:
            outer = state["outer"]
            if not isinstance(outer, dict) or not isinstance(outer.get("state"), dict):
                raise ValueError("state dict 'outer' (version 1) must be a torch.optim.SGD state dict")
            momentum = [outer["state"].get(i, {}).get("momentum_buffer") for i in range(len(self.params))]
            momentum = [torch.zeros_like(t) if m is None else m for m, t in zip(momentum, self._theta0)]
            self._check_tensors("outer", momentum, self._theta0, self.param_names)
        else:
            self._check_tensors("momentum", state["momentum"], self._theta0, self.param_names)
        if version >= 3:
            self._check_tensors("params", state["params"], self.params, self.param_names)
            if not _is_int(state["generation"]) or state["generation"] < 0:
                raise ValueError(f"state dict 'generation' must be an int >= 0, got {state['generation']!r}")
            buffers, own = state["buffers"], dict(self.model.named_buffers())
            if not isinstance(buffers, dict) or set(buffers) != set(own):
                got = sorted(buffers) if isinstance(buffers, dict) else type(buffers).__name__
                raise ValueError(f"state dict 'buffers' must hold the model's buffers {sorted(own)}, got {got}")
            for n, b in buffers.items():
                if not isinstance(b, torch.Tensor) or tuple(b.shape) != tuple(own[n].shape):
                    raise ValueError(f"state dict buffer {n!r} must be a tensor of shape {tuple(own[n].shape)}")
        inner = state["inner"]
        if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) \
                or not isinstance(inner.get("param_groups"), list):
            raise ValueError("state dict 'inner' must be the inner optimizer's state_dict()")
        sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in inner["param_groups"]]
        own_sizes = [len(g["params"]) for g in self.inner_optimizer.param_groups]
        if sizes != own_sizes:
            raise ValueError(f"state dict 'inner' has parameter groups of sizes {sizes}, the inner optimizer "
                             f"{own_sizes}")
        return version

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on every worker, each its own (resume in new processes, or rewind a wrapper
        that has already stepped).

        Everything is checked before anything changes. The model's trainable parameters and buffers are restored
        from the state dict, so both resume orders give the same trajectory: loading the model's weights before
        building the wrapper (whose ``broadcast_init`` would otherwise overwrite them with rank 0's) or after.

        The wrapper may have stepped already: a Mix1 in flight is waited for and dropped, Mix2's exchanges prepared
        for the pre-load round are discarded (their peers are not left waiting), and the exchange keys move to a
        new *generation* (``max(own, saved) + 1``), so the restarted rounds never meet the old rounds' keys in
        the store. Workers that train together must load states of the same generation with the same history
        (every worker of a resumed job loads, once): then they agree on it without talking.

        States of version 1 and 2 (older formats, without the model's weights) are accepted with a warning; their
        model weights are taken from the anchor when the state was saved at a round boundary
        (``steps_in_round == 0``, where parameters equal the anchor), else left as they are (load the model's
        weights after building the wrapper).

        Raises:
            ValueError: not a state dict of a known version, a missing key (named), another model layout, rank,
                world size, codec, seed or topology, tensors of the wrong type or shape, or inner optimizer
                parameter groups that do not match. Nothing has changed when it is raised.
        """
        version = self._validate_state(state)
        if version < STATE_VERSION:
            warnings.warn(f"FGDiLoCo state dict of an older format (version {version}, this build writes "
                          f"{STATE_VERSION}) without the model's weights: "
                          + ("the model's parameters are set from the saved round-start anchor" if
                             state["steps_in_round"] == 0 else "load the model's weights after building the "
                             "wrapper (broadcast_init overwrites them with rank 0's)"), stacklevel=2)
        if version == 1:
            per = state["outer"]["state"]
            momentum = [per.get(i, {}).get("momentum_buffer") for i in range(len(self.params))]
            momentum = [torch.zeros_like(t) if m is None else m for m, t in zip(momentum, self._theta0)]
        else:
            momentum = state["momentum"]
        # Things that can still fail on their own (codec and inner optimizer internals) go first, undone on failure.
        backup = (self.codec.state_dict(), self.mix1_codec.state_dict(), self.inner_optimizer.state_dict())
        try:
            self.codec.load_state_dict(state["codec"]["state"])
            self.mix1_codec.load_state_dict(state["mix1_codec"]["state"])
            self.inner_optimizer.load_state_dict(state["inner"])
        except Exception as e:
            self.codec.load_state_dict(backup[0])
            self.mix1_codec.load_state_dict(backup[1])
            self.inner_optimizer.load_state_dict(backup[2])
            raise ValueError(f"state dict's codec or inner optimizer state does not load: {type(e).__name__}: "
                             f"{e}") from e
        if self._mix1 is not None:  # a Mix1 of the pre-load round may be in flight: let it end, then drop it
            with contextlib.suppress(Exception):
                self._mix1.result()
            self._mix1 = None
        self._mixer1.discard_prepared()
        self._mixer2.discard_prepared()
        # an elastic job's exchange keys name each side's incarnation and a loaded worker rejoins at the live
        # round: its keys are new without a generation (which would have to agree with the peers')
        if not self.elastic:
            self._generation = max(self._generation, int(state.get("generation", 0))) + 1
        self._mixer1.generation = self._mixer2.generation = self._generation
        with torch.no_grad():
            self._theta0 = [saved.detach().to(device=t.device, dtype=torch.float32, copy=True)
                            for t, saved in zip(self._theta0, state["anchor"])]
            self._momentum = [saved.detach().to(device=t.device, dtype=torch.float32, copy=True)
                              for t, saved in zip(self._theta0, momentum)]
            if version >= 3:
                for p, saved in zip(self.params, state["params"]):
                    p.copy_(saved)
                own = dict(self.model.named_buffers())
                for n, b in state["buffers"].items():
                    own[n].copy_(b)
            elif state["steps_in_round"] == 0:
                for p, t in zip(self.params, self._theta0):
                    p.copy_(t)
        self._round = int(state["round"])
        self._steps_in_round = int(state["steps_in_round"])
        self._fresh = False
        self._round_t0 = None
        self._paused_seconds = 0.0

    def close(self) -> None:
        """Leave the job: wait for an in-flight Mix1, discard the next round's prepared Mix2 exchanges (their peers
        fail them at once), post a departure notice (every later exchange a peer attempts with this worker fails
        at once instead of waiting for a deadline), release the transport and remove the step hooks; the
        wrapper cannot step afterwards.

        Call it after the last round (or when the worker stops early, e.g. out of data, or on SIGTERM) and before
        ``destroy_process_group()``; it also runs at interpreter exit."""
        if self._mix1 is not None:
            with contextlib.suppress(Exception):
                self._mix1.result()
            self._mix1 = None
        if self.transport is not None:
            with contextlib.suppress(Exception):  # a store that is gone: peers find out through the heartbeat
                self.transport.leave()
            self._mixer1.discard_prepared()
            self._mixer2.discard_prepared()
        if self._owns_transport and self.transport is not None:
            self.transport.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _LIVE.discard(self)

    def __repr__(self) -> str:
        return (f"FGDiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum}, nesterov={self.nesterov}, topology={self.topology.name!r}, "
                f"mix1_rounds={self.mix1_rounds}, mix2_rounds={self.mix2_rounds}, codec={self.codec!r}, "
                f"mix1_codec={self.mix1_codec!r}, mix_momentum={self.mix_momentum}, world_size={self.world_size}, "
                f"rank={self.rank})")
