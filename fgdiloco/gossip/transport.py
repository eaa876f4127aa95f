"""How gossip bytes move between workers: exchanges and collectives (who is there is the membership's business,
:mod:`fgdiloco.gossip.membership`).

:class:`DistributedTransport` runs on ``torch.distributed``. Each pairwise exchange builds a *private* 2-rank Gloo
process group on a :class:`~torch.distributed.PrefixStore` of the job's store, keyed by the mix, the schedule index
and the pair. Why a fresh group per exchange: a Gloo timeout closes every connection of the group it happens in
(measured on Gloo/CPU: a hung peer inside a shared group broke every later exchange of that group), so a hung peer
inside a shared group would break all later gossip; in a private group it breaks only that one exchange. A fresh
key per exchange also means a peer that comes back after a failure can never be matched against a half-finished
exchange. The cost is a few store round trips per exchange (about 2-3 ms on a TCPStore, about 25 ms on a
FileStore), paid once per gossip round, not per inner step.

A pair group whose exchange ended cleanly on *both* sides is kept (:class:`_PairGroups`: one per peer and mix
stream, the ``key`` without its schedule index) and reused for the stream's next exchange with that peer, but only
when both sides say so: each side's hello names the group it holds for the stream (its token: the store prefix it
was built under), and the group is reused when the two hellos name the same one; otherwise both build a fresh group
and drop what they held. A side whose exchange failed, timed out or was given up drops its group, so the peers'
tokens differ and a group that saw a timeout (its connections closed) or a half-finished conversation is never used
again; a restarted peer holds nothing. Building a group is a rendezvous through the store and a TCP connect: in
the WAN job (``benchmarks.wan --peers``) reuse cut Mix2's blocking time per round from 43-60 ms to 5-19 ms.

A pairwise exchange is a conversation on a :class:`Channel` (:meth:`Transport.open`): the codec's messages, then a
one-byte accept/reject from each side, so an exchange is applied by both peers or by neither
(:mod:`fgdiloco.gossip.mix`). Before any Gloo connection is made each side posts a *hello* for the exchange in the
store, ``go`` or ``skip``: a worker that skips an exchange (its peer is in back-off, or it has no use for it) says so
with :meth:`Transport.decline`, and its peer's :meth:`~Transport.open` fails at once with :class:`PeerDeclined`
instead of waiting for the deadline. Once both hellos are there, each side records its decision with an atomic
``compare_set`` on one shared key: the first decision wins, so a side that gives up an exchange
(:meth:`Transport.discard` / :meth:`Transport.abandon`) and a side that is about to build the pair group can never
disagree about whether the group is built. A side that gave up says so (:meth:`Transport.abandon`), and its peer
stops waiting at once (:meth:`Transport.abandoned`).

Deadlines: ``join_timeout`` bounds a peer's arrival (its hello and its first payload: the pair group's own Gloo
timeout), the ``deadline`` of :meth:`Transport.open` each later payload, ``collective_timeout`` the exact topology's
collectives. Who watches: the mixer's one supervision loop (:func:`fgdiloco.runtime.supervise`), which asks the
membership whether the peer is still there; :meth:`Transport.open` called directly (not under a supervisor) runs the
same loop itself. The threads doing the work only block on the store and the network.

:class:`LocalHub` is the in-process stand-in (threads as workers) used by fast unit tests.
"""

from __future__ import annotations

import abc
import datetime
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config import FGDiLoCoConfig
from ..runtime import Background, ExchangeError, call_with_deadline, supervise
from .membership import Membership, StoreMembership

log = logging.getLogger("fgdiloco")

__all__ = ["Channel", "ExchangeError", "PeerDeclined", "PeerGone", "PeerLeft", "Transport", "DistributedTransport",
           "LocalHub", "LocalTransport", "gone_error"]

MAX_PAYLOAD_BYTES = 1 << 34  # a peer announcing more than 16 GiB is rejected before allocating
_HELLO_POLL = (0.005, 0.1)  # first and longest sleep between two looks at the peer's hello (then it is there)


class PeerDeclined(ExchangeError):
    """The peer posted a skip notice for this exchange (it is backing off from us, or leaving): no timeout was
    spent, and the peer is not to blame for a failure."""


class PeerLeft(PeerDeclined):
    """The peer posted a departure notice (``FGDiLoCo.close``): it will not exchange again."""


class PeerGone(ExchangeError):
    """The membership found the peer dead or hung (no heartbeat for ``liveness``) while this side waited: a
    failure (back-off), and nothing an exchange thread still inside Gloo with it can finish."""


#: What a membership's :meth:`~fgdiloco.gossip.membership.Membership.gone` (or :meth:`Transport.abandoned`) may
#: answer, and what it means for the exchange: departure notice, skip (no back-off: the peer is fine or will be
#: replaced), or a failure (back-off).
_GONE_MESSAGES = {
    "left": (PeerLeft, "the peer has left (departure notice)"),
    "abandoned": (PeerDeclined, "declined: the peer gave up the exchange"),
    "absent": (PeerDeclined, "skipped: the peer's slot has no worker (it never joined)"),
    "restarted": (PeerDeclined, "skipped: the peer restarted (a new process took its slot)"),
    "joining": (PeerDeclined, "skipped: the peer is joining the job (it has not started an outer round yet)"),
}


def gone_error(gone: str, what: str) -> ExchangeError:
    """The exception for the verdict ``gone`` about the exchange ``what`` (one place for the mapping)."""
    kind, text = _GONE_MESSAGES.get(gone, (PeerGone, f"failed: the peer is gone ({gone})"))
    return kind(f"{what}: {text}")


class _Discarded(ExchangeError):
    """A prepared exchange given up by this side before the peer committed to it."""


_HELLO_GO, _HELLO_SKIP = b"go", b"skip"
_TOKEN_SEP = b"="  # a hello that names a kept pair group: b"go=" + its token

#: Pair groups kept for reuse per transport (least recently used dropped first): one per peer and mix stream.
PAIR_GROUPS = 32


class _PairGroups:
    """Pair groups kept after an exchange that ended cleanly, one per ``(peer, stream)``, for reuse by the stream's
    next exchange with that peer (both sides must name the same group in their hellos, :meth:`DistributedTransport.
    _build`). A group is taken out while an exchange uses it, so two live conversations never share one."""

    def __init__(self, capacity: int = PAIR_GROUPS):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._idle: OrderedDict[tuple[int, str], tuple[str, Any, int]] = OrderedDict()
        self._closed = False
        self.built = 0  # groups built (fresh) and reused, for tests and benchmarks
        self.reused = 0

    def take(self, peer: int, stream: str) -> tuple[str, Any, int] | None:
        """The group kept for ``(peer, stream)``, removed (``(token, group, its other rank)``), or None."""
        with self._lock:
            return self._idle.pop((peer, stream), None)

    def give(self, peer: int, stream: str, kept: tuple[str, Any, int]) -> None:
        """Keep ``kept`` for ``(peer, stream)`` (after a clean exchange); the least recently used beyond the
        capacity, and anything given after :meth:`clear`, are dropped."""
        with self._lock:
            if self._closed:
                return
            self._idle[(peer, stream)] = kept
            self._idle.move_to_end((peer, stream))
            while len(self._idle) > self.capacity:
                self._idle.popitem(last=False)

    def drop_peer(self, peer: int) -> None:
        """Forget every group kept for ``peer`` (it restarted, left or was found gone)."""
        with self._lock:
            for k in [k for k in self._idle if k[0] == peer]:
                del self._idle[k]

    def clear(self) -> None:
        with self._lock:
            self._closed = True
            self._idle.clear()


class Channel(abc.ABC):
    """An open pairwise connection for one exchange: a sequence of :meth:`exchange` calls, in lockstep with the
    peer's (each call sends one payload and returns the peer's payload of the same position)."""

    @abc.abstractmethod
    def exchange(self, payload: bytes) -> bytes:
        """Send ``payload`` and return the peer's. Raises :class:`ExchangeError` when the peer is gone or late."""

    def reuse(self) -> None:  # noqa: B027 - optional hook
        """Say that the conversation ended cleanly on this side (every payload of it sent and received): the
        connection may serve this mix stream's next exchange with the same peer, if the peer says so too. Call it
        before :meth:`close`; without it the connection is dropped."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection (nothing to do by default)."""


class Transport(abc.ABC):
    """Moves gossip payloads: pairwise exchanges (:meth:`open`, :meth:`prepare`, :meth:`decline`,
    :meth:`discard`, :meth:`abandon`, :meth:`abandoned`, :meth:`exchange`) and the exact topology's collectives
    (:meth:`all_gather`, :meth:`all_reduce_mean`). ``rank`` and ``world_size`` are positions in the gossip group;
    :attr:`membership` says who is there."""

    rank: int
    world_size: int
    join_timeout: float = FGDiLoCoConfig.join_timeout  # seconds, for calls that give none

    @property
    def membership(self) -> Membership:
        """Who is in the job (default: a membership that knows nothing)."""
        found = self.__dict__.get("_membership")
        if found is None:
            found = self.__dict__["_membership"] = Membership(self.rank, self.world_size)
        return found

    @membership.setter
    def membership(self, value: Membership) -> None:
        self.__dict__["_membership"] = value

    @abc.abstractmethod
    def open(self, peer: int, *, key: str, timeout: float | None = None, deadline: float | None = None,
             supervised: bool = False) -> Channel:
        """Meet ``peer`` for the exchange ``key`` (both call it with the same key) and return the channel.

        ``timeout`` (default :attr:`join_timeout`) bounds the wait for the peer to arrive, up to its first payload
        on the channel; ``deadline`` (default ``timeout``) bounds each later payload. ``supervised``: the caller
        watches the peer's liveness itself (:func:`fgdiloco.runtime.supervise`) and calls :meth:`abandon` when it
        gives up; otherwise this call watches it.

        Raises:
            PeerLeft: the peer posted a departure notice.
            PeerDeclined: the peer posted a skip notice for ``key``, gave it up, or its slot is empty.
            ExchangeError: the peer did not arrive within ``timeout`` seconds, or is dead.
        """

    @abc.abstractmethod
    def decline(self, peer: int, *, key: str) -> None:
        """Post a skip notice for the exchange ``key`` with ``peer``: its :meth:`open` fails at once."""

    def prepare(self, peer: int, *, key: str, timeout: float | None = None) -> None:  # noqa: B027 - optional
        """Optionally start setting up a later :meth:`open` with ``peer`` under ``key`` (default: nothing)."""

    def discard(self, peer: int, *, key: str) -> None:
        """Give up the exchange ``key`` with ``peer`` prepared by :meth:`prepare` (or never opened): the peer's
        :meth:`open` fails at once (or, when it had already committed, on a connection that is closed).
        Default: :meth:`decline`."""
        self.decline(peer, key=key)

    def abandon(self, peer: int, *, key: str, suspect: bool = False) -> None:  # noqa: B027 - optional hook
        """Say that this side gave up the exchange ``key`` with ``peer`` (its wait for us ends at once, and this
        side's own set-up of it stops); ``suspect``: the connection was reset, ``peer`` is probably dead."""

    def abandoned(self, peer: int, key: str) -> bool:
        """Whether ``peer`` gave up the exchange ``key`` (:meth:`abandon`). Default: never known."""
        return False

    def exchange(self, peer: int, payload: bytes, *, key: str, timeout: float | None = None) -> bytes:
        """One payload each way under ``key``: :meth:`open`, one :meth:`Channel.exchange`, close, within
        ``timeout`` seconds in all (default: :attr:`join_timeout`).

        Raises:
            ExchangeError: the peer is dead, hung, declined, or the exchange did not finish within ``timeout``.
        """
        timeout = self.join_timeout if timeout is None else timeout

        def run() -> bytes:
            channel = self.open(peer, key=key, timeout=timeout)
            try:
                return channel.exchange(payload)
            finally:
                channel.close()

        return call_with_deadline(run, timeout, f"exchange {key} with rank {peer}")

    @abc.abstractmethod
    def all_gather(self, payload: bytes, *, key: str, timeout: float) -> list[bytes]:
        """Every worker's payload, indexed by rank (the exact-average topology's exchange)."""

    def all_reduce_mean(self, flat: torch.Tensor, *, key: str, timeout: float) -> None:
        """Replace the 1-D float32 ``flat`` by the average over all workers, in place."""
        frames = self.all_gather(flat.detach().cpu().numpy().tobytes(), key=key, timeout=timeout)
        total = torch.zeros_like(flat, dtype=torch.float64, device="cpu")
        for f in frames:
            total += torch.frombuffer(bytearray(f), dtype=torch.float32).to(torch.float64)
        flat.copy_((total / len(frames)).to(flat.dtype))

    def close(self) -> None:
        """Release resources; a closed transport must not be used again."""
        self.membership.close()


class _Pending:
    """One exchange being set up (prepared, or being opened): its job and the event that stops it."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.job: Background | None = None


class DistributedTransport(Transport):
    """Gossip over ``torch.distributed`` with fault-isolated pairwise exchanges.

    Args:
        process_group: the group whose members gossip (default: the default group). Gossip ranks are ranks in
            this group. Works under ``torchrun``, a plain ``init_process_group`` with any init method, and with a
            user-supplied group. Payloads always travel over Gloo on CPU, so CUDA/NCCL jobs work too.
        timeout: shorthand for ``join_timeout`` and ``collective_timeout`` (seconds).
        join_timeout: seconds a peer may take to arrive for an exchange (default
            :attr:`FGDiLoCoConfig.join_timeout`).
        collective_timeout: seconds one collective of the exact topology may take.
        liveness: heartbeat silence (seconds) after which a peer is taken for dead or hung.
        store_timeout: how long (seconds) a worker trains on without gossip while the group's store is out of
            reach; then the next round start raises :class:`~fgdiloco.gossip.membership.StoreUnreachable`.
        exact: also build a Gloo group over all members for the exact-average topology (collective: every member
            must construct the transport).
        collective_group: an already-built Gloo group over the same ranks as ``process_group`` to run the exact
            topology's collectives on, instead of building one with ``new_group`` (e.g.
            :attr:`fgdiloco.ReplicaMesh.gossip_group`). Without it the members alone build one
            (``use_local_synchronization``, named after its ranks), so transports over disjoint subgroups may be
            built at the same time.
        membership: an already-built membership on its own store (an elastic job:
            :class:`fgdiloco.elastic.ElasticMembership`); then there is no process group and no collective, and
            ``process_group``, ``exact`` and ``collective_group`` must be left out.

    Construction over a process group is collective (a broadcast of a run nonce, so stale keys in a reused store
    can never match, and optionally a ``new_group``).

    Raises:
        ValueError: a ``collective_group`` over other ranks than ``process_group``, or not on Gloo.
        RuntimeError: ``torch.distributed`` is not initialised (and no ``membership`` is given).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, timeout: float | None = None,
                 join_timeout: float | None = None, collective_timeout: float | None = None,
                 liveness: float | None = None, store_timeout: float | None = None, exact: bool = False,
                 collective_group: dist.ProcessGroup | None = None, membership: Membership | None = None):
        d = FGDiLoCoConfig.build(**{k: v for k, v in (("timeout", timeout), ("join_timeout", join_timeout),
                                                      ("collective_timeout", collective_timeout),
                                                      ("liveness", liveness), ("store_timeout", store_timeout))
                                    if v is not None})
        self.join_timeout = d.join_timeout
        self.collective_timeout = d.collective_timeout
        self._pending: dict[tuple[int, str], _Pending] = {}
        self._pending_lock = threading.Lock()
        self.pair_groups = _PairGroups()
        self._coll_lock = threading.Lock()
        self._coll = None
        if membership is not None:
            if process_group is not None or exact or collective_group is not None:
                raise ValueError("a transport over a membership of its own has no process group: drop "
                                 "process_group, exact and collective_group")
            self.group = None
            self.membership = membership
            self.rank, self.world_size = membership.rank, membership.world_size
            self.global_ranks = list(range(self.world_size))
            return
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group (or use torchrun) "
                               "before building a DistributedTransport")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.global_ranks = dist.get_process_group_ranks(self.group)
        if collective_group is not None:
            if dist.get_process_group_ranks(collective_group) != self.global_ranks:
                raise ValueError("collective_group must hold the same ranks as process_group, in the same order")
            if dist.get_backend(collective_group) != "gloo":
                raise ValueError(f"collective_group must be a Gloo group, got backend "
                                 f"{dist.get_backend(collective_group)!r}")
        nonce = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            nonce = nonce.cuda()
        dist.broadcast(nonce, src=self.global_ranks[0], group=self.group)
        self._coll = collective_group
        if exact and self.world_size > 1 and collective_group is None:
            # only the group's members call it (a subgroup's transport is built on its members alone), and the
            # group's name (its store prefix) comes from its ranks: with the default counter-named groups, two
            # subgroups built at once took the same name and crossed their collectives
            self._coll = dist.new_group(self.global_ranks, backend="gloo", use_local_synchronization=True,
                                        timeout=datetime.timedelta(seconds=self.collective_timeout))
        self.membership = StoreMembership(dist.distributed_c10d._get_default_store(), self.rank, self.world_size,
                                          f"fgdiloco/{int(nonce.item()):x}", liveness=d.liveness,
                                          store_timeout=d.store_timeout)

    # ------------------------------------------------------------------ meeting a peer
    def _check_peer(self, peer: int) -> None:
        if peer == self.rank or not 0 <= peer < self.world_size:
            raise ValueError(f"peer must be another rank in [0, {self.world_size}), got {peer}")

    def _stores(self) -> Any:
        return self.membership.stores.lease()  # type: ignore[attr-defined]

    def _pending_for(self, peer: int, key: str) -> _Pending:
        with self._pending_lock:
            return self._pending.setdefault((peer, key), _Pending())

    def _build(self, peer: int, key: str, timeout: float, cancel: threading.Event) -> tuple[Any, int, str, str]:
        """Post our hello, wait for the peer's (or for ``cancel``: this side gave up), agree on the decision, then
        build the private 2-rank Gloo group (both sides do the same), or reuse the one both hellos name (see the
        module's docstring). Returns ``(group, the peer's rank in it, stream, token)``. Only waits: liveness is the
        supervisor's."""
        stream = key.rsplit("/", 1)[0]
        held = self.pair_groups.take(peer, stream)  # dropped unless the peer names it too
        hello = _HELLO_GO if held is None else _HELLO_GO + _TOKEN_SEP + held[0].encode()
        with self._stores() as store:
            prefix = self.membership.prefix(peer, key)
            store.set(f"{prefix}/hello/{self.rank}", hello)
            theirs = f"{prefix}/hello/{peer}"
            t_end = time.monotonic() + timeout
            poll = _HELLO_POLL[0]  # a peer that is already there is met within milliseconds
            while True:
                if cancel.is_set():
                    if store.compare_set(f"{prefix}/decision", "", _HELLO_SKIP) != _HELLO_GO:
                        raise _Discarded(f"{key} with rank {peer} discarded")
                    break  # the peer committed first: build the group (it is there), the caller drops it
                left = t_end - time.monotonic()
                if left <= 0:
                    raise ExchangeError(f"rank {peer} did not arrive for {key} within {timeout:.1f} s")
                # check() and a local sleep, not store.wait with a short timeout: a timed-out TCPStore wait logs a
                # c10d warning every time
                if not store.check([theirs]):
                    time.sleep(min(poll, left))
                    poll = min(2 * poll, _HELLO_POLL[1])
                    continue
                said = store.get(theirs)
                if said == _HELLO_SKIP:
                    raise PeerDeclined(f"rank {peer} declined {key}")
                if self.membership.has_left(peer) or self.membership.gone(peer, time.monotonic()) == "left":
                    # its hello predates its departure: a group with it would wait out its rendezvous
                    store.compare_set(f"{prefix}/decision", "", _HELLO_SKIP)
                    raise PeerLeft(f"rank {peer} has left (departure notice) before {key}")
                if store.compare_set(f"{prefix}/decision", "", _HELLO_GO) != _HELLO_GO:
                    raise PeerDeclined(f"rank {peer} discarded {key}")
                break
            if held is not None and said == hello:  # both sides hold the same group, unused since it ended cleanly
                self.pair_groups.reused += 1
                return held[1], held[2], stream, held[0]
            me = 0 if self.rank < peer else 1
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), me, 2, datetime.timedelta(seconds=timeout))
            self.pair_groups.built += 1
            return pg, 1 - me, stream, prefix

    def prepare(self, peer: int, *, key: str, timeout: float | None = None) -> None:
        """Start meeting ``peer`` for a later ``open(peer, key=key)`` in the background (hello and Gloo pair group).

        Setting up a Gloo pair costs a few store round trips and TCP connects; done during the inner steps, Mix2's
        blocking exchange is left with the transfer itself. Both sides should prepare the same keys (they do: the
        schedule is shared). A preparation that failed makes :meth:`open` raise its error; one that is not
        needed after all is given up with :meth:`discard`.
        """
        self._check_peer(peer)
        timeout = self.join_timeout if timeout is None else timeout
        pending = self._pending_for(peer, key)
        pending.job = Background(lambda: self._build(peer, key, timeout, pending.cancel),
                                 f"prepare {key} with rank {peer}")

    def discard(self, peer: int, *, key: str) -> None:
        """Give up a prepared exchange: before the peer committed, its :meth:`open` fails at once
        (:class:`PeerDeclined`); after, the pair group is built and dropped, so the peer's first operation on it
        meets a closed connection. An exchange that was never prepared is declined."""
        self._check_peer(peer)
        with self._pending_lock:
            pending = self._pending.pop((peer, key), None)
        if pending is None or pending.job is None:
            self.decline(peer, key=key)
            return
        self._release(peer, pending)

    def _release(self, peer: int, pending: _Pending) -> bool:
        """Give up a set-up (:meth:`discard`, :meth:`close`): a set-up still waiting for the peer's hello ends at
        its next look (the peer's open is declined); one whose peer had committed builds its group, which is
        dropped. It is waited for while the peer may still come; one inside Gloo with a peer that is gone is left
        to Gloo's own deadline (forsaken). Returns whether it ended."""
        pending.cancel.set()
        if pending.job is None:
            return True
        since = time.monotonic()
        while not pending.job.wait(_HELLO_POLL[1]):  # whatever it ends with, the exchange is not used
            # after two looks of the hello loop, what still runs is inside Gloo
            if time.monotonic() - since > 2 * _HELLO_POLL[1] and self._never_ends_soon(peer, since):
                pending.job.forsake()
                return False
        pending.job.settle()
        return True

    def _never_ends_soon(self, peer: int, since: float) -> bool:
        """Whether a set-up with ``peer`` still running is inside Gloo waiting for a peer that is gone (or whose
        state the store cannot tell): a discard does not wait for it (it ended after Gloo's own deadline, the
        exchange timeout, and held a leaving worker's ``close()`` that long), nor for any set-up once this worker
        has posted its departure notice: a peer that committed to the exchange and then saw the notice never builds
        its end (the leaving worker's ``close()`` took the 20 s Gloo deadline so, answering joiners meanwhile)."""
        if self.membership.departed:
            return True
        try:
            return self.membership.gone(peer, since) is not None
        except Exception:  # noqa: BLE001 - a store we cannot reach: the thread ends with Gloo's deadline
            return True

    def open(self, peer: int, *, key: str, timeout: float | None = None, deadline: float | None = None,
             supervised: bool = False) -> Channel:
        self._check_peer(peer)
        timeout = self.join_timeout if timeout is None else timeout
        deadline = timeout if deadline is None else deadline
        pending = self._pending_for(peer, key)
        if pending.job is None:  # not prepared: meet the peer now
            pending.job = Background(lambda: self._build(peer, key, timeout, pending.cancel),
                                     f"meet rank {peer} for {key}")
        try:
            if supervised:
                pg, other, stream, token = pending.job.result()
            else:
                pg, other, stream, token = supervise(
                    pending.job, join_deadline=timeout, exchange_deadline=timeout, met=[],
                    watch=lambda t0, _: self._watch(peer, key, t0), what=f"{key} with rank {peer}")
        except ExchangeError:
            if not supervised:
                pending.cancel.set()
            raise
        except Exception as err:  # noqa: BLE001 - every failure to meet the peer is an ExchangeError
            if type(err).__name__ in ("DistNetworkError", "DistStoreError"):  # the store, not the peer: no blame
                raise PeerDeclined(f"{key} with rank {peer}: skipped: the gossip store did not answer "
                                   f"({type(err).__name__}: {str(err).splitlines()[0][:120]})") from err
            raise ExchangeError(f"meeting rank {peer} for {key} failed: {type(err).__name__}: {err}") from err
        finally:
            with self._pending_lock:
                self._pending.pop((peer, key), None)
        if self.membership.gone(peer, time.monotonic()) == "left":  # it dropped its end of a prepared group
            raise PeerLeft(f"rank {peer} has left (departure notice) before {key}")
        keep = lambda: self.pair_groups.give(peer, stream, (token, pg, other))  # noqa: E731
        return _GlooChannel(pg, other, peer, key, deadline, keep)

    def _watch(self, peer: int, key: str, since: float) -> None:
        """Raise when ``peer`` will not come to ``key`` (the check an unsupervised :meth:`open` polls)."""
        gone = "abandoned" if self.abandoned(peer, key) else self.membership.gone(peer, since)
        if gone is not None:
            raise gone_error(gone, f"{key} with rank {peer}")

    def decline(self, peer: int, *, key: str) -> None:
        self._check_peer(peer)
        with self._stores() as store:
            prefix = self.membership.prefix(peer, key)
            store.compare_set(f"{prefix}/decision", "", _HELLO_SKIP)
            store.set(f"{prefix}/hello/{self.rank}", _HELLO_SKIP)

    def abandon(self, peer: int, *, key: str, suspect: bool = False) -> None:
        self._check_peer(peer)
        with self._pending_lock:
            pending = self._pending.get((peer, key))
        if pending is not None:  # our own set-up of it stops waiting
            pending.cancel.set()
        with self._stores() as store:
            prefix = self.membership.prefix(peer, key)
            store.compare_set(f"{prefix}/decision", "", _HELLO_SKIP)
            store.add(f"{prefix}/abandoned/{self.rank}", 1)
        if suspect:
            self.membership.suspect(peer)
            self.pair_groups.drop_peer(peer)

    def abandoned(self, peer: int, key: str) -> bool:
        with self._stores() as store:
            return store.add(f"{self.membership.prefix(peer, key)}/abandoned/{peer}", 0) > 0

    def close(self) -> None:
        """Give up every exchange being set up and release it; stop the membership's heartbeat. Runs before exit
        (``FGDiLoCo.close``, also called at exit), each set-up released as :meth:`discard` does (:meth:`_release`).
        A pair group whose peer died between agreeing to meet and connecting can leave Gloo's listening side waiting
        past the group's timeout (seen with torch 2.13): that set-up is left to the process's exit, not waited for.

        A thread left polling the store for a hello that never comes (an empty slot's, at the last round) was
        forsaken here; still running at interpreter exit, it aborted the process ("terminate called without an
        active exception", exit -6), which torchrun counted as a death and restarted."""
        with self._pending_lock:
            pending, self._pending = list(self._pending.items()), {}
        for _, p in pending:  # every hello loop stops at once, not one after the other
            p.cancel.set()
        for (peer, _), p in pending:
            if not self._release(peer, p):
                log.warning("fgdiloco rank %d: %s is still inside Gloo; not waiting for it", self.rank, p.job.what)
        self.pair_groups.clear()
        super().close()

    # ------------------------------------------------------------------ collectives (the exact topology)
    def _collective(self, run: Callable[[], Any], key: str, timeout: float | None) -> Any:
        if self._coll is None:
            raise RuntimeError("this transport was built without exact=True")
        timeout = self.collective_timeout if timeout is None else timeout

        def locked() -> Any:
            with self._coll_lock:
                return run()

        return call_with_deadline(locked, timeout, key)

    def all_gather(self, payload: bytes, *, key: str, timeout: float | None = None) -> list[bytes]:
        if self.world_size == 1:
            return [payload]

        def run() -> list[bytes]:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self._coll)
            n = max(int(s.item()) for s in sizes)
            if n > MAX_PAYLOAD_BYTES:
                raise ExchangeError(f"a peer announced a payload of {n} bytes")
            mine = torch.zeros(n, dtype=torch.uint8)
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            outs = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(outs, mine, group=self._coll)
            return [o[: int(s.item())].numpy().tobytes() for o, s in zip(outs, sizes)]

        return self._collective(run, f"all_gather {key}", timeout)

    def all_reduce_mean(self, flat: torch.Tensor, *, key: str, timeout: float | None = None) -> None:
        if self.world_size == 1:
            return
        work = flat.detach().to("cpu", torch.float32, copy=True)
        self._collective(lambda: dist.all_reduce(work, group=self._coll), f"all_reduce {key}", timeout)
        flat.copy_((work / self.world_size).to(device=flat.device, dtype=flat.dtype))


class _GlooChannel(Channel):
    """A channel on a private 2-rank Gloo group: each payload travels as its length, then its bytes. ``keep``
    gives the group back for reuse (:meth:`reuse`, then :meth:`close`)."""

    def __init__(self, pg: Any, other: int, peer: int, key: str, deadline: float,
                 keep: Callable[[], None] | None = None):
        self.pg, self.other, self.peer, self.key = pg, other, peer, key
        self._tag = 0
        self._deadline = datetime.timedelta(seconds=deadline)
        self._keep = keep
        self._clean = False

    def reuse(self) -> None:
        self._clean = True

    def close(self) -> None:
        keep, self._keep = self._keep, None
        if self._clean and keep is not None:
            keep()

    def exchange(self, payload: bytes) -> bytes:
        tag, self._tag = self._tag, self._tag + 2
        # the first payload waits for the peer to arrive (the group's timeout), later ones for the deadline only
        wait = {} if tag == 0 else {"timeout": self._deadline}
        n_out = torch.tensor([len(payload)], dtype=torch.int64)
        n_in = torch.zeros(1, dtype=torch.int64)
        try:
            # receive posted before send: send-first ran at about half the link rate on shaped links (WAN benchmark)
            works = [self.pg.recv([n_in], self.other, tag), self.pg.send([n_out], self.other, tag)]
            for w in works:
                w.wait(**wait)
            size = int(n_in.item())
            if not 0 < size <= MAX_PAYLOAD_BYTES:
                raise ExchangeError(f"rank {self.peer} announced a payload of {size} bytes in {self.key}")
            buf = torch.empty(size, dtype=torch.uint8)
            out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            works = [self.pg.recv([buf], self.other, tag + 1), self.pg.send([out], self.other, tag + 1)]
            for w in works:
                w.wait(**wait)
        except ExchangeError:
            raise
        except Exception as err:  # noqa: BLE001 - Gloo raises RuntimeError for a dead or late peer
            raise ExchangeError(f"exchange {self.key} with rank {self.peer} failed: {gloo_reason(err)}") from err
        return buf.numpy().tobytes()


def gloo_reason(err: BaseException) -> str:
    """Gloo's error in one short line: ``"the peer closed the connection (it is probably dead)"`` for a reset or
    closed socket, otherwise the first line of its message without Gloo's source location."""
    text = str(err)
    if "closed by peer" in text or "reset by peer" in text:
        return "the peer closed the connection (it is probably dead)"
    if not text.strip():
        return type(err).__name__
    first = text.strip().splitlines()[0]
    if first.startswith("[") and "] " in first:  # "[/path/to/gloo/transport/tcp/pair.cc:553] Timed out ..."
        first = first.split("] ", 1)[1]
    return f"{type(err).__name__}: {first[:200]}"


class LocalHub:
    """An in-process stand-in for a network: ``world_size`` workers that are threads of one process.

    ``hub.transport(rank)`` gives each worker its :class:`LocalTransport`. ``gate`` (a callable taking the key and
    returning a :class:`threading.Event` or None) lets tests hold an exchange open until they release it. ``drop``
    (a callable ``(key, src, dst, position) -> bool``) lets tests lose one message of a conversation: it is never
    delivered, as if the link broke in one direction. ``dead`` holds ranks that are gone.
    """

    def __init__(self, world_size: int, gate: Callable[[str], threading.Event | None] | None = None,
                 drop: Callable[[str, int, int, int], bool] | None = None):
        self.world_size = world_size
        self.gate = gate
        self.drop = drop
        self._slots: dict[tuple[str, int, int], bytes] = {}
        self._cond = threading.Condition()
        self.dead: set[int] = set()

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)

    def _put(self, key: str, src: int, dst: int, payload: bytes) -> None:
        with self._cond:
            self._slots[(key, src, dst)] = payload
            self._cond.notify_all()

    def _take(self, key: str, src: int, dst: int, timeout: float) -> bytes:
        with self._cond:
            ok = self._cond.wait_for(lambda: (key, src, dst) in self._slots or src in self.dead, timeout)
            if not ok or (key, src, dst) not in self._slots:
                raise ExchangeError(f"exchange {key}: no payload from rank {src} within {timeout:.1f} s")
            return self._slots.pop((key, src, dst))


class _LocalChannel(Channel):
    def __init__(self, transport: LocalTransport, peer: int, key: str, timeout: float):
        self.t, self.peer, self.key, self.timeout = transport, peer, key, timeout
        self._pos = 0

    def exchange(self, payload: bytes) -> bytes:
        hub, pos = self.t.hub, self._pos
        self._pos += 1
        if self.t.rank in hub.dead:
            raise ExchangeError("this worker is marked dead")
        slot = f"{self.key}#{pos}"
        if not (hub.drop and hub.drop(self.key, self.t.rank, self.peer, pos)):
            hub._put(slot, self.t.rank, self.peer, payload)
        return hub._take(slot, self.peer, self.t.rank, self.timeout)


class LocalTransport(Transport):
    """One worker's end of a :class:`LocalHub`."""

    def __init__(self, hub: LocalHub, rank: int):
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.membership = Membership(rank, hub.world_size)

    def open(self, peer: int, *, key: str, timeout: float | None = None, deadline: float | None = None,
             supervised: bool = False) -> Channel:
        timeout = self.join_timeout if timeout is None else timeout
        if self.rank in self.hub.dead:
            raise ExchangeError("this worker is marked dead")
        gate = self.hub.gate(key) if self.hub.gate else None
        if gate is not None and not gate.wait(timeout):
            raise ExchangeError(f"exchange {key} held past {timeout:.1f} s")
        self.hub._put(f"{key}/hello", self.rank, peer, _HELLO_GO)
        if self.hub._take(f"{key}/hello", peer, self.rank, timeout) == _HELLO_SKIP:
            raise PeerDeclined(f"rank {peer} declined {key}")
        return _LocalChannel(self, peer, key, timeout)

    def decline(self, peer: int, *, key: str) -> None:
        self.hub._put(f"{key}/hello", self.rank, peer, _HELLO_SKIP)

    def all_gather(self, payload: bytes, *, key: str, timeout: float | None = None) -> list[bytes]:
        timeout = self.join_timeout if timeout is None else timeout
        for dst in range(self.world_size):
            if dst != self.rank:
                self.hub._put(key, self.rank, dst, payload)
        return [payload if src == self.rank else self.hub._take(key, src, self.rank, timeout)
                for src in range(self.world_size)]

