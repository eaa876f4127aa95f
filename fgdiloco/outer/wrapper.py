"""``FGDiLoCo``: the optimizer wrapper that runs Factored Gossip DiLoCo around the user's inner optimizer."""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import runtime
from ..config import FGDiLoCoConfig
from ..factor.codec import Codec, resolve_codec
from ..factor.frame import job_secret, layout_fingerprint
from ..factor.lowrank import LowRank
from ..gossip.mix import MAX_RATIO, Mixer, PeerHealth
from ..gossip.staging import HostStaging
from ..gossip.topology import Topology, make_topology
from ..gossip.transport import Transport
from ..mesh import ReplicaMesh
from .checkpoint import load_codecs_and_inner, pack, validate_state
from .connect import open_transport
from .fragments import split_fragments
from .optimizer import TorchOuter, build_outer
from .params import SyncedParameters
from .round import Round
from .state import OuterState
from .stats import RoundStats

__all__ = ["FGDiLoCo"]

_SETTINGS = frozenset(FGDiLoCoConfig.names())
#: the live wrapper of each inner optimizer (one at a time: both would count its steps)
_WRAPPERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, FGDiLoCo] = weakref.WeakKeyDictionary()
#: settings whose resolved form the wrapper keeps under the setting's name (a codec instance, the topology, ...)
_RESOLVED = frozenset({"codec", "mix1_codec", "topology", "fragments"})


def _own(codec: Codec, given: Any) -> Codec:
    """``codec`` itself when it was built from a name; a copy of the user's instance ``given`` with a fresh state."""
    if codec is not given:
        return codec
    mine = copy.deepcopy(codec)
    mine.load_state_dict({})
    return mine


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
       projects both peers onto one basis they agree on; see ``docs/gossip.md``); an exchange is applied by both
       peers or by neither. Its pair connections are set up in the background at round start.
    4. Wait for Mix1: ``θ̄_i``. The local outer step (SGD with Nesterov momentum) gives
       ``θ_i^{t+1} = θ̄_i − outer_lr · Nesterov(Δ̄_i)``. The round-start parameters and the momentum are kept as
       fp32 master copies, also for bf16/fp16 models. The inner optimizer's state is kept across rounds.

    With ``topology="allreduce"`` both mixes are the exact average and this is DiLoCo (Douillard et al., arXiv
    2311.08105): every worker computes a bit-identical mean, and Mix1 becomes a cheap check (an 8-byte digest of
    parameters and momentum per worker) that re-syncs replicas that differ for any reason (different initial
    weights without ``broadcast_init``, a frame one worker rejected) by averaging them exactly.

    Use it like any optimizer::

        opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=3e-4), sync_every=50)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    The round is triggered by a step hook on the inner optimizer, so stepping ``inner_optimizer`` directly (as
    Lightning or a ``GradScaler`` does) counts as well. Attach LR schedulers to the inner optimizer. Wrap
    evaluation between steps in :meth:`paused` to keep it out of ``utilisation``.

    Args:
        model: the worker's model. Its trainable parameters (``requires_grad``) are synchronised.
        inner_optimizer: a ``torch.optim.Optimizer`` over (at least) all trainable parameters of ``model``.
        config: the settings (:class:`fgdiloco.FGDiLoCoConfig`; default: its defaults); ``**settings`` given by
            name override it (``sync_every=20``, ``codec="lowrank"``, ``timeout=30``, ...). The settings, their
            defaults, units and tuning advice: :class:`~fgdiloco.FGDiLoCoConfig` and ``docs/settings.md``. Each is
            readable as an attribute (``opt.sync_every``).
        broadcast_init: copy rank 0's parameters and buffers to every worker at construction.
        process_group: the ``torch.distributed`` group of the workers (default: the default group when
            ``torch.distributed`` is initialised; a single worker otherwise).
        transport: a custom :class:`~fgdiloco.gossip.Transport` (tests, other networks); overrides
            ``process_group`` and disables ``broadcast_init``.
        mesh: a :class:`~fgdiloco.ReplicaMesh` when ``model`` is one pipeline stage: gossip then runs among the same
            stage of the other replicas only (over ``mesh.gossip_group``; every stage of a replica pairs with the
            same peer replica, since all stages derive the schedule from the same seed), ``broadcast_init`` copies
            the first replica's stage, and the frame fingerprint includes the stage index. Exclusive with
            ``process_group``.
        elastic: join an elastic job (``docs/faults.md``: each worker its own ``torchrun`` job, all meeting on a
            gossip store no worker hosts, as ``fgdiloco launch`` starts them): the transport is
            :func:`fgdiloco.elastic.connect` (settings from ``FGDILOCO_STORE``, ``FGDILOCO_WORKER``,
            ``FGDILOCO_WORKERS``), no ``broadcast_init`` (seed the model the same on every worker), and the worker
            joins the job at its live round at its first step and whenever it has fallen behind. Not with
            ``process_group``, ``mesh``, ``transport`` or the ``allreduce`` topology (it needs a group).

    Raises:
        TypeError: an argument of the wrong type, or an unknown setting name.
        ValueError: an argument out of range (the message names it and what is allowed), a stateful
            ``mix1_codec``, an inner optimizer that does not hold all of the model's trainable parameters, or one
            that another FGDiLoCo drives (not closed).

    Construction is collective over the process group: every worker must construct it.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 config: FGDiLoCoConfig | None = None, *, broadcast_init: bool = True,
                 process_group: dist.ProcessGroup | None = None, transport: Transport | None = None,
                 mesh: ReplicaMesh | None = None, elastic: bool = False, **settings: Any):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        if transport is not None and not isinstance(transport, Transport):
            raise TypeError(f"transport must be a fgdiloco.gossip.Transport or None, got {type(transport).__name__}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(process_group).__name__}")
        other = _WRAPPERS.get(inner_optimizer)
        if other is not None and other._hooks:
            raise ValueError("inner_optimizer already drives another FGDiLoCo (each inner step would count in both "
                             "wrappers' rounds); close() that one first")
        self.config = FGDiLoCoConfig.build(config, **settings)
        self.codec, self.mix1_codec = self.resolve_codecs(self.config)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.synced = SyncedParameters(model, inner_optimizer)  # raises before anything is built
        self.param_names, self.params = self.synced.names, self.synced.params
        self._warn_if_rank_factors_nothing()
        note = self.config.outer_lr_note()
        if note:
            warnings.warn(note, UserWarning, stacklevel=2)
        layout = [(n, p.shape, p.dtype) for n, p in zip(self.param_names, self.params)]
        if mesh is not None:
            if not isinstance(mesh, ReplicaMesh):
                raise TypeError(f"mesh must be a fgdiloco.ReplicaMesh or None, got {type(mesh).__name__}")
            if process_group is not None:
                raise ValueError("pass either mesh (gossip over mesh.gossip_group) or process_group, not both")
            layout.insert(0, (f"<pipeline stage {mesh.stage} of {mesh.stages}>", (), "stage"))
        self.mesh = mesh
        self.fingerprint = layout_fingerprint(layout)
        self.elastic = self._check_elastic(elastic, process_group, mesh, transport)
        self._owns_transport = transport is None or elastic
        self.transport = open_transport(self.config, model, transport=transport, process_group=process_group,
                                        mesh=mesh, elastic=self.elastic, broadcast_init=broadcast_init,
                                        fingerprint=self.fingerprint, exact=self._exact)
        self.rank = self.transport.rank if self.transport else 0
        self.world_size = self.transport.world_size if self.transport else 1
        self.fragments = split_fragments(self.config.fragments, self.param_names, self.params)
        self._build_mixers()
        self.outer = OuterState(self.params, build_outer(self.config, self.params), self.fingerprint,
                                self._mixer1.secret, self.rank, self.config.join_timeout)
        self._rounds: dict[int, Round] = {}  # fragment -> its round in flight
        #: host buffers of what the mixes send (CUDA parameters: pinned, reused per round; CPU ones pass through)
        self.staging = HostStaging()
        self._resume_delta: list[torch.Tensor] | None = None  # a checkpoint's pseudo-gradient already in Mix2
        self._clock: tuple[float | None, float] = (None, 0.0)  # since the last outer round: (t0, paused)
        self.last_round: RoundStats | None = None
        self.failed_exchanges_total = 0
        self.skipped_exchanges_total = 0
        self.out_of_scale_total = 0
        self._hooks = [inner_optimizer.register_step_pre_hook(self._pre_step),
                       inner_optimizer.register_step_post_hook(self._post_step)]
        _WRAPPERS[inner_optimizer] = self
        runtime.on_exit(self, self.config.exit_wait)
        if self.world_size > 1:
            runtime.on_sigterm(self)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def resolve_codecs(config: FGDiLoCoConfig) -> tuple[Codec, Codec]:
        """Mix2's and Mix1's codec instances for ``config``: a name builds a new instance, an instance is copied
        with its state reset (``load_state_dict({})``). A codec's state (warm starts, error feedback) belongs to one
        wrapper's layout and run, so a config that builds a second wrapper, at once or after the first, starts
        each from a fresh state, as a name would."""
        codec = resolve_codec(config.codec, default=FGDiLoCoConfig.codec, argument="codec", rank=config.codec_rank)
        mix1 = resolve_codec(config.mix1_codec, default=FGDiLoCoConfig.mix1_codec, argument="mix1_codec")
        return _own(codec, config.codec), _own(mix1, config.mix1_codec)

    def _warn_if_rank_factors_nothing(self) -> None:
        """Warn when the user chose the rank (``codec_rank``, or a ``LowRank`` instance) and no matrix of the model
        is factored at it: Mix2 then sends every tensor whole, which the run would not otherwise show. (The default
        rank on a toy model is not worth a warning.)"""
        chosen = self.config.codec_rank is not None or isinstance(self.config.codec, LowRank)
        note = self.codec.factors_none_of(self.params) \
            if chosen and isinstance(self.codec, LowRank) else None
        if note:
            warnings.warn(note, UserWarning, stacklevel=3)

    @staticmethod
    def check_arguments(**settings: Any) -> dict[str, Any]:
        """Deprecated: ``FGDiLoCoConfig(**settings)`` validates the settings (same errors). Returns them as a
        dict."""
        warnings.warn("FGDiLoCo.check_arguments is deprecated: build a fgdiloco.FGDiLoCoConfig(**settings) "
                      "(it validates the same way)", DeprecationWarning, stacklevel=2)
        return FGDiLoCoConfig.build(**settings).as_dict()

    def __getattr__(self, name: str) -> Any:
        if name in _SETTINGS and "config" in self.__dict__:  # the settings, read-only: opt.sync_every
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # an assignment would only shadow the setting: opt.sync_every = 1 read back 1 and changed nothing
        if name in _SETTINGS and name not in _RESOLVED:
            raise AttributeError(f"{name} is a setting, fixed at construction: build the wrapper with {name}=... "
                                 "(or a FGDiLoCoConfig) instead of assigning it")
        super().__setattr__(name, value)

    def _check_elastic(self, elastic: Any, process_group: Any, mesh: Any, transport: Any) -> bool:
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be a bool, got {type(elastic).__name__}")
        if elastic:
            taken = [n for n, v in (("process_group", process_group), ("transport", transport)) if v is not None]
            if taken:
                raise ValueError(f"elastic=True builds its own transport: drop {', '.join(taken)}")
            if mesh is not None and mesh.replicas != 1:
                raise ValueError(f"elastic=True takes the mesh of one replica (ReplicaMesh(1, stages): each replica "
                                 f"its own torchrun job), got {mesh.replicas} replicas")
            if self._exact:
                raise ValueError(f"elastic=True cannot use the exact topology {self._topology_name!r} (it needs a "
                                 "process group); use 'random', 'exponential' or 'ring'")
        return elastic

    @property
    def _topology_name(self) -> str:
        t = self.config.topology
        return t.name if isinstance(t, Topology) else t

    @property
    def _exact(self) -> bool:
        t = self.config.topology
        return t.exact if isinstance(t, Topology) else make_topology(t, 1).exact

    def _build_mixers(self) -> None:
        c = self.config
        self.topology = make_topology(c.topology, self.world_size, c.seed)
        topo2 = c.topology if isinstance(c.topology, Topology) else make_topology(c.topology, self.world_size,
                                                                                c.seed + 1)
        health, secret = PeerHealth(), job_secret()
        deadlines = dict(join_timeout=c.join_timeout, exchange_timeout=c.exchange_timeout,
                         collective_timeout=c.collective_timeout, health=health, secret=secret, max_ratio=MAX_RATIO)
        self._mixer1 = Mixer("mix1", self.topology, self.transport, self.mix1_codec, c.mix1_rounds, self.fingerprint,
                             offset=0, resync=True, **deadlines)
        # one Mix2 per fragment: a codec keeps per-tensor state (warm starts, error feedback) for one layout
        self._mixer2s = [Mixer("mix2", topo2, self.transport, self.codec if f == 0 else copy.deepcopy(self.codec),
                               c.mix2_rounds, self.fingerprint, offset=1, **deadlines)
                         for f in range(len(self.fragments))]
        self._mixer2 = self._mixer2s[0]
        self.authenticated = secret is not None

    # ------------------------------------------------------------------ the user's API
    @property
    def round(self) -> int:
        """Outer rounds completed so far."""
        return self.outer.round

    @property
    def rejoins(self) -> int:
        """Times this worker has (re)joined the job at its live round (elastic jobs)."""
        return self.outer.rejoins

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups."""
        return self.inner_optimizer.param_groups

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One inner optimizer step; every ``sync_every``-th one ends with the outer round. Returns the closure's
        loss, like ``torch.optim.Optimizer.step``.

        Raises:
            RuntimeError: the wrapper was closed (:meth:`close`).
        """
        if not self._hooks:
            raise RuntimeError("this FGDiLoCo was closed (it left the job): it cannot step; build a new one to train "
                               "on")
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
            # only the part after the round's clock started: a pause before it (the first round starts at its first
            # step) is outside the round already, and subtracting it made round_seconds negative
            start, paused = self._clock
            if start is not None:
                self._clock = (start, paused + time.perf_counter() - max(t0, start))

    # ------------------------------------------------------------------ rounds
    @property
    def steps_per_round(self) -> int:
        """Inner steps between two outer rounds: ``sync_every``, or ``sync_every / fragments`` (each fragment's
        round still spans ``sync_every`` steps)."""
        return self.config.sync_every // len(self.fragments)

    @property
    def _round(self) -> Round | None:
        """The round that ends next (the current fragment's)."""
        return self._rounds.get(self.outer.round % len(self.fragments))

    def _begin_round(self) -> None:
        """Start every fragment's next outer round that is not in flight: the one place rounds start. The
        membership first lets a worker joining a running job enter its live round."""
        self.synced.check()
        rejoins = self.outer.rejoins
        if self.transport is not None:
            self.transport.membership.before_round(self.outer, self._agree)
        if self.outer.rejoins != rejoins:  # it jumped: its rounds in flight were for other rounds; a fresh clock
            self._end_round()
            self._clock = (time.perf_counter(), 0.0)
        if self._clock[0] is None:
            self._clock = (time.perf_counter(), self._clock[1])
        c, count, exact = self.config, len(self.fragments), self.topology.exact
        for f, indices in enumerate(self.fragments):
            if f not in self._rounds:
                index = self.outer.round + (f - self.outer.round) % count  # this fragment's next outer round
                after = max(self._rounds.values(), key=lambda r: r.index) if exact and self._rounds else None
                self._rounds[f] = Round(self.outer, f, indices, index, self._mixer1, self._mixer2s[f],
                                        momentum_in_mix1=c.mix_momentum or exact, exact=exact,
                                        merge_alpha=c.merge_alpha, after=after, staging=self.staging)
        if self._resume_delta is not None:  # the loaded checkpoint was taken while this round's Mix2 ran
            self._wait_mix1s()
            self._round.start_mix2(self._resume_delta)
            self._resume_delta = None

    def _agree(self, values: list[int]) -> list[int]:
        """The maxima of ``values`` over this replica's pipeline stages (the membership of an elastic pipeline
        replica decides its joins and stops with it; a fixed group's never calls it); ``values`` itself without
        stages (a collective over ``mesh.pipeline_group`` otherwise)."""
        if self.mesh is None or self.mesh.stages == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.mesh.pipeline_group)
        return [int(v) for v in t.tolist()]

    def _end_round(self, *, keep_clock: bool = False) -> None:
        """Give up the rounds in flight (their mixes waited for and dropped, their prepared exchanges declined)."""
        for r in self._rounds.values():
            r.discard()
        self._rounds = {}
        if not keep_clock:
            self._clock = (None, 0.0)

    def _wait_mix1s(self) -> None:
        """The exact topology: every Mix1 collective ends before a Mix2 collective starts (on every worker alike)."""
        if self.topology.exact:
            for r in self._rounds.values():
                r.wait_mix1()

    def rejoin(self) -> int:
        """Join the job at its live round (the newest outer round a peer has started), when that is ahead of this
        worker's. Returns the round this worker is in afterwards.

        For a worker that restarted (after loading its own checkpoint, or fresh) or hung and came back: it skips
        the rounds it missed, starting the live round from its own parameters, outer momentum and inner optimizer
        state, or, without state of its own or with state ``ADOPT_ROUNDS`` (3) or more rounds older than the live
        round (:mod:`fgdiloco.elastic.rejoin`), from a live peer's parameters and outer momentum. Counted in
        :attr:`rejoins` and in ``RoundStats.rejoins``, logged. An elastic wrapper does it by itself at its first
        step and whenever it has fallen behind; a round in flight is discarded first. Without a membership that
        knows the live round (not elastic) it changes nothing.
        """
        self._end_round(keep_clock=True)
        if self.transport is not None:
            rejoins = self.outer.rejoins
            self.transport.membership.rejoin(self.outer, self._agree)
            if self.outer.rejoins != rejoins:
                self._clock = (time.perf_counter(), 0.0)
        return self.outer.round

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.synced.check_if_added()  # add_param_group is caught at the next step
        if self._round is None:
            self._begin_round()

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.outer.steps_in_round += 1
        tau = self.config.overlap_steps
        if tau and self.outer.steps_in_round == self.steps_per_round - tau and self._round is not None:
            self._wait_mix1s()
            self._round.start_mix2()
        if self.outer.steps_in_round >= self.steps_per_round:
            self.sync()

    def sync(self) -> RoundStats:
        """End the current outer round now (Mix2, wait for Mix1, outer step) and start the next one.

        Called automatically after every ``sync_every``-th inner step (every ``sync_every / fragments``-th with
        fragments: then it ends the current fragment's round); call it yourself only to end a round early. Every
        worker must end the same rounds.
        """
        if self._round is None:
            self._begin_round()
        self._wait_mix1s()
        t0, paused = self._clock
        stats = self._rounds.pop(self.outer.round % len(self.fragments)).finish(t0, paused)
        self.failed_exchanges_total += stats.failed_exchanges
        self.skipped_exchanges_total += stats.skipped_exchanges
        self.out_of_scale_total += stats.out_of_scale
        self.last_round = stats
        self._clock = (time.perf_counter(), 0.0)
        self._begin_round()
        return stats

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same trajectory: inner optimizer state, fp32 outer momentum, the fp32
        round-start parameters (``anchor``), the model's trainable parameters and buffers as they are now (so the
        order of loading the model and building the wrapper does not matter, see :meth:`load_state_dict`), round
        and step counters, schedule seed and topology, rank and world size, codec states. Every tensor is a copy
        (the optimizers' states included): training on leaves the state dict as it was."""
        r = self._round
        return pack(self.outer, self.inner_optimizer, self.model, self.params, header=self._header(),
                    codecs=[m.codec for m in self._mixer2s], mix1_codec=self.mix1_codec,
                    overlap_delta=None if r is None else r.overlap_delta)

    def _header(self) -> dict[str, Any]:
        """What a state dict records of this run, and what one must match to load."""
        return {"fingerprint": self.fingerprint, "rank": self.rank, "world_size": self.world_size,
                "codec": self.codec.name, "mix1_codec": self.mix1_codec.name, "seed": self.config.seed,
                "topology": self.topology.name, "fragments": len(self.fragments), "sync_every": self.config.sync_every,
                "torch_outer": isinstance(self.outer.optimizer, TorchOuter)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on every worker, each its own (resume in new processes, or rewind a wrapper
        that has already stepped).

        Everything is checked before anything changes. The model's trainable parameters and buffers are restored
        from the state dict, so both resume orders give the same trajectory: loading the model's weights before
        building the wrapper (whose ``broadcast_init`` would otherwise overwrite them with rank 0's) or after.

        The wrapper may have stepped already: the round in flight is discarded (its Mix1 waited for and dropped,
        its prepared exchanges given up, so their peers are not left waiting), and the exchange keys move to a new
        *generation* (``max(own, saved) + 1``), so the restarted rounds never meet the old rounds' keys in the
        store. Workers that train together must load states of the same generation with the same history (every
        worker of a resumed job loads, once): then they agree on it without talking.

        The inner optimizer's state is checked in full before it is loaded: its parameter groups, and every
        parameter's state against the one a step of the inner optimizer creates (the same keys, tensors of the same
        shapes), then a trial load and step of a copy of it. Its hyperparameters (learning rate...) are the saved
        ones, as ``torch.optim.Optimizer.load_state_dict`` does.

        A torch outer optimizer (``outer_optimizer=``) loads only a state saved by the same optimizer class, checked
        in the same way; its state (moments, step counts) comes from the state dict and its hyperparameters
        (``outer_lr``, ``outer_momentum``, what a factory sets) from this wrapper's construction, as the built-in
        Nesterov outer step's do: a run resumed with another ``outer_lr`` steps with the new one.

        The wrapper keeps copies of the loaded tensors: training on leaves ``state`` as it was, so the same state
        dict can rewind the wrapper again.

        States of version 1 and 2 (older formats, without the model's weights) are accepted with a warning; their
        model weights are taken from the anchor when the state was saved at a round boundary
        (``steps_in_round == 0``, where parameters equal the anchor), else left as they are.

        Raises:
            ValueError: not a state dict of a known version, a missing key (named), another model layout, rank,
                world size, codec, seed, topology or number of fragments, tensors of the wrong type or shape
                (``overlap_delta`` included), an inner or torch outer optimizer state that does not match its
                optimizer (parameter groups, a missing state key, a state tensor of the wrong type or shape, one
                that does not load), or a state saved with another outer optimizer (the built-in one or another
                torch optimizer class, both named). Nothing has changed when it is raised.
        """
        checked = validate_state(state, expect=self._header(), outer=self.outer, names=self.param_names,
                                 model=self.model, inner=self.inner_optimizer, sync_every=self.steps_per_round,
                                 fragments=self.fragments)
        # what can still fail on its own (codec and inner optimizer internals) goes first, undone on failure
        load_codecs_and_inner(state, [m.codec for m in self._mixer2s], self.mix1_codec, self.inner_optimizer)
        self._end_round()
        # an elastic job's exchange keys name each side's incarnation and a loaded worker rejoins at the live
        # round: its keys are new without a generation (which would have to agree with the peers')
        if self.transport is None or not self.transport.membership.keys_per_process:
            self.outer.generation = max(self.outer.generation, int(state.get("generation", 0))) + 1
        for m in [self._mixer1, *self._mixer2s]:
            m.generation = self.outer.generation
        self.outer.load(state, checked, self.model)
        saved = state.get("overlap_delta")
        self._resume_delta = None if saved is None else [
            d.detach().to(device=self.params[i].device, dtype=torch.float32, copy=True)
            for d, i in zip(saved, self.fragments[self.outer.round % len(self.fragments)])]

    def close(self) -> None:
        """Leave the job: wait for an in-flight Mix1, post a departure notice (every later exchange a peer attempts
        with this worker fails at once instead of waiting for a deadline), discard the next round's prepared Mix2
        exchanges (their peers fail them at once), release the transport and remove the step hooks; the wrapper
        cannot step afterwards.

        Call it after the last round (or when the worker stops early, e.g. out of data, or on SIGTERM) and before
        ``destroy_process_group()``; it also runs at interpreter exit."""
        for r in self._rounds.values():
            r.wait_mix1()
        if self.transport is not None:
            with contextlib.suppress(Exception):  # a store that is gone: peers find out through the heartbeat
                self.transport.membership.leave()
        self._end_round()
        if self._owns_transport and self.transport is not None:
            self.transport.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if _WRAPPERS.get(self.inner_optimizer) is self:
            del _WRAPPERS[self.inner_optimizer]
        runtime.forget(self)

    def leave(self) -> None:
        """Post this worker's departure notice only (what SIGTERM does before the process ends)."""
        if self.transport is not None:
            self.transport.membership.leave()

    def __repr__(self) -> str:
        c = self.config
        return (f"FGDiLoCo(sync_every={c.sync_every}, outer_lr={c.outer_lr}, outer_momentum={c.outer_momentum}, "
                f"nesterov={c.nesterov}, topology={self.topology.name!r}, mix1_rounds={c.mix1_rounds}, "
                f"mix2_rounds={c.mix2_rounds}, codec={self.codec!r}, mix1_codec={self.mix1_codec!r}, "
                f"mix_momentum={c.mix_momentum}, world_size={self.world_size}, rank={self.rank})")
