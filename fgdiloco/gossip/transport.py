"""How gossip bytes move between workers.

:class:`DistributedTransport` runs on ``torch.distributed``. Each pairwise exchange builds a *private* 2-rank Gloo
process group on a :class:`~torch.distributed.PrefixStore` of the job's store, keyed by the mix, the schedule index
and the pair. Why a fresh group per exchange: a Gloo timeout closes every connection of the group it happens in
(measured on Gloo), so a hung peer inside a shared group would break all later gossip; in a private group it breaks
only that one exchange. A fresh key per exchange also means a peer that comes back after a failure can never be
matched against a half-finished exchange. The cost is a few store round trips per exchange (about 2-3 ms on a
TCPStore, about 25 ms on a FileStore), paid once per gossip round, not per inner step.

Every call has a deadline: when it passes, the call raises :class:`ExchangeError` and the caller keeps its own
value. The thread doing the exchange is a daemon and ends when Gloo's own timeout fires.

A pairwise exchange is a conversation on a :class:`Channel` (:meth:`Transport.open`): the codec's messages, then a
one-byte accept/reject from each side, so an exchange is applied by both peers or by neither
(:mod:`fgdiloco.gossip.mix`). Before any Gloo connection is made each side posts a *hello* for the exchange in the
store, ``go`` or ``skip``: a worker that skips an exchange (its peer is in back-off, or it has no use for it) says so
with :meth:`Transport.decline`, and its peer's :meth:`~Transport.open` fails at once with :class:`PeerDeclined`
instead of waiting for the timeout. Once both hellos are there, each side records its decision for the exchange with
an atomic ``compare_set`` on one shared key: the first decision wins, so a side that gives up a prepared exchange
(:meth:`Transport.discard`: a checkpoint was loaded, or the worker is leaving) and a side that is about to build the
pair group can never disagree about whether the group is built.

Who is there. Every worker bumps a heartbeat counter in the store every :data:`HEARTBEAT_SECONDS`; a worker waiting
for a peer's hello gives up as soon as the peer's counter has not moved for :data:`LIVENESS_SECONDS` (a dead or
SIGSTOPped peer costs that, not the timeout; :data:`SUSPECT_LIVENESS_SECONDS` when another worker already saw its
connections reset, the mark of a dead process), and a live peer that is merely late is waited for up to the
timeout (so a peer that lost time to a dead third one never makes a live exchange fail). A side that gives up an
exchange it had started (:meth:`Transport.abandon`) says so, and its peer stops waiting at once. A worker that leaves
(:meth:`Transport.leave`, called by ``FGDiLoCo.close``) posts a departure notice that its peers' waits check at
every poll: an exchange with a departed worker fails at once with :class:`PeerLeft`.

Each exchange in flight talks to the store over its own connection (:class:`_StorePool` of ``Store.clone()``s):
a store client serialises its operations, so Mix1's background exchange waiting for its peer's address would
otherwise hold up Mix2's on the main thread, and two workers could each wait for the other (seen on a TCPStore).

:class:`LocalHub` is the in-process stand-in (threads as workers) used by fast unit tests.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Background", "Channel", "ExchangeError", "PeerDeclined", "PeerLeft", "Transport", "DistributedTransport",
           "LocalHub", "LocalTransport", "HEARTBEAT_SECONDS", "LIVENESS_SECONDS", "gone_error"]

T = TypeVar("T")
MAX_PAYLOAD_BYTES = 1 << 34  # a peer announcing more than 16 GiB is rejected before allocating
HEARTBEAT_SECONDS = 0.25  # how often a worker bumps its heartbeat counter in the store
LIVENESS_SECONDS = 5.0  # a peer whose heartbeat has not moved for this long is taken for dead (or hung)
SUSPECT_LIVENESS_SECONDS = 2.0  # ... or this long when another worker saw its connection reset (a dead process)
_POLL_SECONDS = 0.1  # longest single store wait while waiting for a peer's hello (then departure/liveness checks)


class ExchangeError(RuntimeError):
    """An exchange with a peer failed or timed out; the caller keeps its own value for that round."""


class PeerDeclined(ExchangeError):
    """The peer posted a skip notice for this exchange (it is backing off from us, or leaving): no timeout was
    spent, and the peer is not to blame for a failure."""


class PeerLeft(PeerDeclined):
    """The peer posted a departure notice (``FGDiLoCo.close``): it will not exchange again."""


#: What :meth:`Transport.peer_gone` may answer, and what it means for the exchange: departure notice, skip (no
#: back-off: the peer is fine or will be replaced), or a failure (back-off).
_GONE_MESSAGES = {
    "left": (PeerLeft, "the peer has left (departure notice)"),
    "abandoned": (PeerDeclined, "declined: the peer gave up the exchange"),
    "absent": (PeerDeclined, "skipped: the peer's slot has no worker (it never joined)"),
    "restarted": (PeerDeclined, "skipped: the peer restarted (a new process took its slot)"),
}


def gone_error(gone: str, what: str) -> ExchangeError:
    """The exception for a :meth:`Transport.peer_gone` verdict ``gone`` about the exchange ``what``: one place
    for the mapping, used by the transport's rendezvous and by the mixer's wait."""
    kind, text = _GONE_MESSAGES.get(gone, (ExchangeError, f"failed: the peer is gone ({gone})"))
    return kind(f"{what}: {text}")


class _Discarded(ExchangeError):
    """A prepared exchange given up by this side before the peer committed to it."""


_HELLO_GO, _HELLO_SKIP = b"go", b"skip"


class Channel(abc.ABC):
    """An open pairwise connection for one exchange: a sequence of :meth:`exchange` calls, in lockstep with the
    peer's (each call sends one payload and returns the peer's payload of the same position)."""

    @abc.abstractmethod
    def exchange(self, payload: bytes) -> bytes:
        """Send ``payload`` and return the peer's. Raises :class:`ExchangeError` when the peer is gone or late."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection (nothing to do by default)."""


_RUNNING: set[Background] = set()
_RUNNING_LOCK = threading.Lock()


def running_background() -> list[str]:
    """What each :class:`Background` still running is doing (its ``what``)."""
    with _RUNNING_LOCK:
        return [job.what for job in _RUNNING]


def drain_background(limit: float) -> list[str]:
    """Wait (at most ``limit`` seconds in all) for every :class:`Background` still running, e.g. an exchange
    given up on whose thread is still inside Gloo until its own timeout: a thread inside Gloo when the interpreter
    exits aborts the process ("terminate called without an active exception"). Returns what is still running."""
    t_end = time.monotonic() + limit
    while True:  # until none is left (one started meanwhile included) or the time is up
        with _RUNNING_LOCK:
            running = list(_RUNNING)
        left = t_end - time.monotonic()
        if not running or left <= 0:
            return [job.what for job in running]
        running[0].wait(min(left, 0.5))


class Background:
    """``fn()`` running in a daemon thread (a gossip exchange, or a whole mix).

    :meth:`result` waits for it (at most ``timeout`` seconds when given) and returns its value or re-raises its
    exception. The thread is a daemon: one left behind by a timeout ends when Gloo's own timeout fires.
    """

    def __init__(self, fn: Callable[[], Any], what: str):
        self.what = what
        self._box: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"fgdiloco-{what}", daemon=True)
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._box["error"] = e
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(self)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for ``fn`` to end; True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> Any:
        """The value of ``fn()``; raises its exception, or :class:`ExchangeError` when ``timeout`` passes first."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ExchangeError(f"{self.what} timed out after {timeout:.1f} s")
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]


def call_with_deadline(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Run ``fn`` in a daemon thread and return its result, or raise :class:`ExchangeError` after ``timeout`` s
    (or, wrapped, whatever ``fn`` raised)."""
    try:
        return Background(fn, what).result(timeout)
    except ExchangeError:
        raise
    except BaseException as err:  # noqa: BLE001 - every failure of an exchange is an ExchangeError
        raise ExchangeError(f"{what} failed: {type(err).__name__}: {err}") from err


class _StorePool:
    """Store connections handed to one exchange at a time (a clone costs ~0.2 s on a TCPStore, so they are
    reused). A timed-out exchange gives its connection back only when its thread really ends."""

    def __init__(self, store: dist.Store, warm: int = 2):
        self._base = store
        self._free = [store.clone() for _ in range(warm)]
        self._lock = threading.Lock()

    def acquire(self) -> dist.Store:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._base.clone()

    def release(self, store: dist.Store) -> None:
        with self._lock:
            self._free.append(store)

    @contextlib.contextmanager
    def lease(self) -> Iterator[dist.Store]:
        """A connection for the ``with`` block, given back after it."""
        store = self.acquire()
        try:
            yield store
        finally:
            self.release(store)


class Transport(abc.ABC):
    """Moves gossip payloads. ``rank`` and ``world_size`` are positions in the gossip group."""

    rank: int
    world_size: int
    timeout: float = 60.0  # seconds, for calls that give none

    @abc.abstractmethod
    def open(self, peer: int, *, key: str, timeout: float, deadline: float | None = None) -> Channel:
        """Meet ``peer`` for the exchange ``key`` (both call it with the same key) and return the channel.

        ``timeout`` bounds the wait for a live peer to arrive, up to its first payload on the channel;
        ``deadline`` (default ``timeout``) bounds each later payload.

        Raises:
            PeerLeft: the peer posted a departure notice.
            PeerDeclined: the peer posted a skip notice for ``key``.
            ExchangeError: the peer did not arrive within ``timeout`` seconds, or is dead.
        """

    @abc.abstractmethod
    def decline(self, peer: int, *, key: str) -> None:
        """Post a skip notice for the exchange ``key`` with ``peer``: its :meth:`open` fails at once."""

    def discard(self, peer: int, *, key: str) -> None:
        """Give up the exchange ``key`` with ``peer`` prepared by :meth:`prepare` (or never opened): the peer's
        :meth:`open` fails at once (or, when it had already committed, on a connection that is closed).
        Default: :meth:`decline`."""
        self.decline(peer, key=key)

    def leave(self) -> None:  # noqa: B027 - optional hook
        """Post a departure notice: every later exchange a peer attempts with this worker fails at once."""

    def has_left(self, peer: int) -> bool:
        """Whether ``peer`` is known to have posted a departure notice (default: never known)."""
        return False

    def returned(self, peer: int) -> bool:
        """Whether ``peer`` came back as a new process (a restarted or rejoined worker) since this was last
        asked; forgets its departure notice when it did. Default: never."""
        return False

    def publish_round(self, outer_round: int) -> None:  # noqa: B027 - optional hook
        """Tell the job that this worker is starting outer round ``outer_round`` (see :meth:`live_round`)."""

    def peer_round(self, peer: int) -> int | None:
        """The outer round ``peer`` last said it started (:meth:`publish_round`), or None when not known. A peer
        past the round of an exchange will never come to it."""
        return None

    def peer_rounds(self) -> dict[int, int]:
        """The outer round each peer in the job (joined, not departed) last said it started
        (:meth:`publish_round`). Default: none known."""
        return {}

    def live_round(self) -> int | None:
        """The newest outer round a peer of the job has started (None: not known), departed peers included: a
        worker that restarted, or hung and came back, joins the job there (``FGDiLoCo.rejoin``), and one that
        restarts after every peer finished joins at the job's end instead of training the remaining rounds alone.
        (Falling behind is judged against :meth:`peer_rounds`, the peers still in the job.)"""
        rounds = self.peer_rounds()
        return max(rounds.values()) if rounds else None

    def request_state(self) -> None:  # noqa: B027 - optional hook
        """Ask the live peers for their state (a worker that joins without one of its own): the first peer to
        see the request at its next round start answers with :meth:`offer_state`; :meth:`await_state` gets it."""

    def state_requests(self) -> list[tuple[int, int]]:
        """``(peer, incarnation)`` of the state requests not answered yet (cheap when there are none)."""
        return []

    def offer_state(self, peer: int, incarnation: int, payload: bytes) -> bool:
        """Answer ``peer``'s state request with ``payload``; False when another peer answered first."""
        return False

    def await_state(self, timeout: float) -> bytes | None:
        """The answer to this worker's :meth:`request_state`, or None when none came within ``timeout`` s."""
        return None

    def peer_gone(self, peer: int, since: float, key: str | None = None) -> str | None:
        """Why ``peer`` will not come (``"left"``, ``"abandoned"`` the exchange ``key``, or its heartbeat
        stopped), or None when it may still come. ``since`` (``time.monotonic()``) is when the caller started
        waiting for it. Default: never known."""
        return None

    def abandon(self, peer: int, *, key: str, suspect: bool = False) -> None:  # noqa: B027 - optional hook
        """Say that this side gave up the exchange ``key`` with ``peer`` (its wait for us ends at once);
        ``suspect``: the connection was reset, ``peer`` is probably dead. Default: nothing."""

    def exchange(self, peer: int, payload: bytes, *, key: str, timeout: float | None = None) -> bytes:
        """One payload each way under ``key``: :meth:`open`, one :meth:`Channel.exchange`, close, within
        ``timeout`` seconds in all (default: :attr:`timeout`).

        Raises:
            ExchangeError: the peer is dead, hung, declined, or the exchange did not finish within ``timeout``.
        """
        timeout = self.timeout if timeout is None else timeout

        def run() -> bytes:
            channel = self.open(peer, key=key, timeout=timeout)
            try:
                return channel.exchange(payload)
            finally:
                channel.close()

        return call_with_deadline(run, timeout, f"exchange {key} with rank {peer}")

    def prepare(self, peer: int, *, key: str, timeout: float) -> None:  # noqa: B027 - optional hook
        """Optionally start setting up a later :meth:`open` with ``peer`` under ``key`` (default: nothing)."""

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
        """Release resources; a closed transport must not be used again (nothing to do by default)."""
        return None


class DistributedTransport(Transport):
    """Gossip over ``torch.distributed`` with fault-isolated pairwise exchanges.

    Args:
        process_group: the group whose members gossip (default: the default group). Gossip ranks are ranks in
            this group. Works under ``torchrun``, a plain ``init_process_group`` with any init method, and with a
            user-supplied group. Payloads always travel over Gloo on CPU, so CUDA/NCCL jobs work too.
        timeout: default per-exchange timeout in seconds.
        exact: also build a Gloo group over all members for the exact-average topology (collective: every member
            must construct the transport).
        collective_group: an already-built Gloo group over the same ranks as ``process_group`` to run the exact
            topology's collectives on, instead of building one with ``new_group`` (e.g.
            :attr:`fgdiloco.ReplicaMesh.gossip_group`). Needed when several transports are built over different
            groups (one per pipeline stage): ``new_group`` is collective over the whole default group, so calling it
            for one's own stage only fails to connect.

    Construction is collective over ``process_group`` (a broadcast of a run nonce, so stale keys in a reused store
    can never match, and optionally a ``new_group``).

    Raises:
        ValueError: a ``collective_group`` over other ranks than ``process_group``, or not on Gloo.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, timeout: float = 60.0,
                 exact: bool = False, collective_group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group (or use torchrun) "
                               "before building a DistributedTransport")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.global_ranks = dist.get_process_group_ranks(self.group)
        self.timeout = float(timeout)
        if collective_group is not None:
            if dist.get_process_group_ranks(collective_group) != self.global_ranks:
                raise ValueError("collective_group must hold the same ranks as process_group, in the same order")
            if dist.get_backend(collective_group) != "gloo":
                raise ValueError(f"collective_group must be a Gloo group, got backend "
                                 f"{dist.get_backend(collective_group)!r}")
        nonce = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        backend = dist.get_backend(self.group)
        if backend == "nccl":
            nonce = nonce.cuda()
        dist.broadcast(nonce, src=self.global_ranks[0], group=self.group)
        self._coll = collective_group
        if exact and self.world_size > 1 and collective_group is None:
            self._coll = dist.new_group(self.global_ranks, backend="gloo",
                                        timeout=datetime.timedelta(seconds=self.timeout))
        self._start(dist.distributed_c10d._get_default_store(), f"fgdiloco/{int(nonce.item()):x}", elastic=False)

    @classmethod
    def over_store(cls, store: dist.Store, rank: int, world_size: int, *, namespace: str,
                   timeout: float = 60.0) -> DistributedTransport:
        """A transport for an elastic job (:mod:`fgdiloco.elastic`): no process group, no collective; the
        workers are the ``world_size`` *slots* of the job and meet on ``store`` (a ``TCPStore`` that no worker
        hosts) under ``namespace``. The exact topology is not available (it needs a group).

        Membership: each construction is a new *incarnation* of the slot (a counter in the store); every
        exchange key names both sides' incarnations, so a restarted worker never meets what its dead
        predecessor left in the store, and a peer waiting for the dead one stops as soon as the new one
        registers. A slot that never registered is *absent*: exchanges with it are skipped at once.

        Raises:
            ValueError: ``rank`` not in ``[0, world_size)``, ``world_size`` < 1, or an empty ``namespace``.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1 (the job's worker slots), got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        self = cls.__new__(cls)
        self.group = None
        self.rank, self.world_size, self.global_ranks = rank, world_size, list(range(world_size))
        self.timeout = float(timeout)
        self._coll = None
        self._start(store, f"fgdiloco/{namespace}", elastic=True)
        return self

    def _start(self, store: dist.Store, namespace: str, *, elastic: bool) -> None:
        """The part of construction shared by both kinds: store connections, membership and heartbeat."""
        self.namespace = namespace
        self.elastic = elastic
        self._stores = _StorePool(store)
        self._coll_lock = threading.Lock()
        self._prepared: dict[tuple[int, str], tuple[Background, threading.Event]] = {}
        self._prepared_lock = threading.Lock()
        # liveness: our heartbeat, and what we last saw of each peer's (value, when we saw it change)
        self._seen: dict[int, tuple[int, float]] = {}
        self._seen_lock = threading.Lock()
        self._left: set[int] = set()
        self._incarnations: dict[int, int] = {}  # the incarnation of each peer our exchange keys name
        self._wants_seen = 0  # the store's count of state requests when this worker last looked
        self._stop = threading.Event()
        beat_store = self._stores.acquire()
        self.incarnation = beat_store.add(self._incarnation_key(self.rank), 1)
        if beat_store.add(self._left_key(self.rank), 0) > 0:  # a predecessor's departure notice is not ours
            beat_store.set(self._left_key(self.rank), "0")
        self._published = beat_store.add(self._round_key(self.rank), 0)
        beat_store.add(self._alive_key(self.rank), 1)
        self._heartbeat = threading.Thread(target=self._beat, args=(beat_store,), name="fgdiloco-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _alive_key(self, rank: int) -> str:
        return f"{self.namespace}/alive/{rank}"

    def _left_key(self, rank: int) -> str:
        return f"{self.namespace}/left/{rank}"

    def _incarnation_key(self, rank: int) -> str:
        return f"{self.namespace}/incarnation/{rank}"

    def _round_key(self, rank: int) -> str:
        return f"{self.namespace}/round/{rank}"

    def _incarnation_of(self, peer: int) -> int:
        with self._seen_lock:
            return self._incarnations.get(peer, 1)

    def returned(self, peer: int) -> bool:
        if not self.elastic:  # a process group's members never come back as new processes
            return False
        with self._stores.lease() as store:
            now = store.add(self._incarnation_key(peer), 0)
        with self._seen_lock:
            before = self._incarnations.get(peer)
            self._incarnations[peer] = now
            if before is None or now == before:
                return False
            self._left.discard(peer)
            self._seen.pop(peer, None)
        return True

    def publish_round(self, outer_round: int) -> None:
        if not self.elastic:
            return
        with self._stores.lease() as store:
            self._published = store.add(self._round_key(self.rank), int(outer_round) - self._published)

    # A joiner's state comes through the store: a request per incarnation, answered once (compare_set claim).
    def _want_key(self, rank: int) -> str:
        return f"{self.namespace}/want/{rank}"

    def _state_key(self, rank: int, incarnation: int) -> str:
        return f"{self.namespace}/state/{rank}.{incarnation}"

    def request_state(self) -> None:
        if not self.elastic:
            return
        with self._stores.lease() as store:
            store.set(self._want_key(self.rank), str(self.incarnation))
            store.add(f"{self.namespace}/wants", 1)

    def state_requests(self) -> list[tuple[int, int]]:
        if not self.elastic:
            return []
        with self._stores.lease() as store:
            wants = store.add(f"{self.namespace}/wants", 0)
            if wants == self._wants_seen:
                return []
            self._wants_seen = wants
            out = []
            for r in range(self.world_size):
                if r != self.rank and store.check([self._want_key(r)]):
                    inc = int(store.get(self._want_key(r)))
                    if not store.check([self._state_key(r, inc) + "/claim"]):
                        out.append((r, inc))
            return out

    def offer_state(self, peer: int, incarnation: int, payload: bytes) -> bool:
        if not self.elastic:
            return False
        with self._stores.lease() as store:
            key = self._state_key(peer, incarnation)
            mine = str(self.rank).encode()
            if store.compare_set(key + "/claim", "", mine) != mine:
                return False
            store.set(key, payload)
            return True

    def await_state(self, timeout: float) -> bytes | None:
        if not self.elastic:
            return None
        with self._stores.lease() as store:
            key, t0 = self._state_key(self.rank, self.incarnation), time.monotonic()
            while not store.check([key]):
                if time.monotonic() - t0 > timeout or not self._anyone_there(store, t0):
                    return None
                time.sleep(_POLL_SECONDS)
            return store.get(key)

    def peer_round(self, peer: int) -> int | None:
        if not self.elastic:
            return None
        with self._stores.lease() as store:
            return store.add(self._round_key(peer), 0)

    def _anyone_there(self, store: dist.Store, since: float) -> bool:
        """Whether some other slot holds a live worker (joined, not departed, heartbeat moving): one that may
        still answer a state request."""
        return any(self._peer_gone(store, r, since) is None for r in range(self.world_size) if r != self.rank)

    def _slot_rounds(self, *, departed: bool) -> dict[int, int]:
        """The published round of every other slot that ever held a worker; ``departed``: with those that left."""
        if not self.elastic:
            return {}
        with self._stores.lease() as store:
            return {r: store.add(self._round_key(r), 0) for r in range(self.world_size)
                    if r != self.rank and store.add(self._alive_key(r), 0) > 0
                    and (departed or store.add(self._left_key(r), 0) == 0)}

    def live_round(self) -> int | None:
        rounds = self._slot_rounds(departed=True)
        return max(rounds.values()) if rounds else None

    def peer_rounds(self) -> dict[int, int]:
        return self._slot_rounds(departed=False)

    def _beat(self, store: dist.Store) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(Exception):  # a store that is slow or gone: try again at the next beat
                store.add(self._alive_key(self.rank), 1)

    def _peer_gone(self, store: dist.Store, peer: int, since: float, key: str | None = None) -> str | None:
        """Why ``peer`` will not come (it left, abandoned ``key``, or its heartbeat stood still for
        ``LIVENESS_SECONDS``), or None. ``since`` is when we started waiting: a peer never seen before gets
        ``LIVENESS_SECONDS`` from then."""
        if peer in self._left:
            return "left"
        if store.add(self._left_key(peer), 0) > 0:
            self._left.add(peer)
            return "left"
        if key is not None and store.add(f"{self._prefix(peer, key)}/abandoned/{peer}", 0) > 0:
            return "abandoned"
        beat = store.add(self._alive_key(peer), 0)
        if self.elastic:
            if beat == 0:
                return "absent"
            if store.add(self._incarnation_key(peer), 0) != self._incarnation_of(peer):
                return "restarted"
        limit = SUSPECT_LIVENESS_SECONDS if store.add(self._suspect_key(peer), 0) > 0 else LIVENESS_SECONDS
        now = time.monotonic()
        with self._seen_lock:
            value, seen = self._seen.get(peer, (None, since))
            if value != beat:
                self._seen[peer] = (beat, now)
                return None
        if now - seen > limit:
            return f"no heartbeat for {now - seen:.1f} s"
        return None

    def _suspect_key(self, rank: int) -> str:
        return f"{self.namespace}/suspect/{rank}"

    def abandon(self, peer: int, *, key: str, suspect: bool = False) -> None:
        self._check_peer(peer)
        with self._stores.lease() as store:
            prefix = self._prefix(peer, key)
            store.compare_set(f"{prefix}/decision", "", _HELLO_SKIP)
            store.add(f"{prefix}/abandoned/{self.rank}", 1)
            if suspect:
                store.add(self._suspect_key(peer), 1)

    def has_left(self, peer: int) -> bool:
        return peer in self._left

    def peer_gone(self, peer: int, since: float, key: str | None = None) -> str | None:
        with self._stores.lease() as store:
            return self._peer_gone(store, peer, since, key)

    def _prefix(self, peer: int, key: str) -> str:
        if self.elastic:  # both sides' incarnations: a new process never meets its predecessor's exchanges
            (a, ia), (b, ib) = sorted(((self.rank, self.incarnation), (peer, self._incarnation_of(peer))))
            return f"{self.namespace}/{key}/{a}.{ia}-{b}.{ib}"
        a, b = sorted((self.rank, peer))
        return f"{self.namespace}/{key}/{a}-{b}"

    def _build(self, peer: int, key: str, timeout: float, cancel: threading.Event | None = None) -> tuple[Any, int]:
        """Post our hello, wait for the peer's (polling its departure notice and heartbeat between short waits),
        agree on the decision, then build the private 2-rank Gloo group (both sides do the same)."""
        with self._stores.lease() as store:
            prefix = self._prefix(peer, key)
            store.set(f"{prefix}/hello/{self.rank}", _HELLO_GO)
            theirs = f"{prefix}/hello/{peer}"
            t0 = time.monotonic()
            poll = 0.005  # grows to _POLL_SECONDS: a peer that is already there is met within milliseconds
            while True:
                if cancel is not None and cancel.is_set():
                    if store.compare_set(f"{prefix}/decision", "", _HELLO_SKIP) != _HELLO_GO:
                        raise _Discarded(f"{key} with rank {peer} discarded")
                    break  # the peer committed first: build the group (it is there), the caller drops it
                gone = self._peer_gone(store, peer, t0, key)
                if gone is not None:
                    raise gone_error(gone, f"{key} with rank {peer}")
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    raise ExchangeError(f"rank {peer} did not arrive for {key} within {timeout:.1f} s")
                # check() and a local wait, not store.wait with a short timeout: a timed-out TCPStore wait logs a
                # c10d warning every time
                if not store.check([theirs]):
                    time.sleep(min(poll, left))
                    poll = min(2 * poll, _POLL_SECONDS)
                    continue
                if store.get(theirs) == _HELLO_SKIP:
                    raise PeerDeclined(f"rank {peer} declined {key}")
                if store.compare_set(f"{prefix}/decision", "", _HELLO_GO) != _HELLO_GO:
                    raise PeerDeclined(f"rank {peer} discarded {key}")
                break
            me = 0 if self.rank < peer else 1
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), me, 2, datetime.timedelta(seconds=timeout))
            return pg, 1 - me

    def prepare(self, peer: int, *, key: str, timeout: float | None = None) -> None:
        """Start meeting ``peer`` for a later ``open(peer, key=key)`` in the background (hello and Gloo pair group).

        Setting up a Gloo pair costs a few store round trips and TCP connects; done during the inner steps, Mix2's
        blocking exchange is left with the transfer itself. Both sides should prepare the same keys (they do: the
        schedule is shared). A preparation that failed makes :meth:`open` raise its error; one that is not
        needed after all is given up with :meth:`discard`.
        """
        self._check_peer(peer)
        timeout = self.timeout if timeout is None else timeout
        cancel = threading.Event()
        job = Background(lambda: self._build(peer, key, timeout, cancel), f"prepare {key} with rank {peer}")
        with self._prepared_lock:
            self._prepared[(peer, key)] = (job, cancel)

    def discard(self, peer: int, *, key: str) -> None:
        """Give up a prepared exchange: before the peer committed, its :meth:`open` fails at once
        (:class:`PeerDeclined`); after, the pair group is built and dropped, so the peer's first operation on it
        meets a closed connection. An exchange that was never prepared is declined."""
        self._check_peer(peer)
        with self._prepared_lock:
            entry = self._prepared.pop((peer, key), None)
        if entry is None:
            self.decline(peer, key=key)
            return
        job, cancel = entry
        cancel.set()
        with contextlib.suppress(Exception):  # whatever it ended with, the exchange is not used
            job.result()

    def leave(self) -> None:
        """Post this worker's departure notice (``FGDiLoCo.close`` does): peers waiting for it, or about to,
        fail their exchanges with it at once."""
        with self._stores.lease() as store:
            store.add(self._left_key(self.rank), 1)

    def close(self) -> None:
        """Let every prepared pair group finish setting up (each bounded by its timeout) and release them; stop
        the heartbeat.

        A daemon thread still inside Gloo when the interpreter exits aborts the process ("terminate called without
        an active exception"), so this runs before exit (``FGDiLoCo.close``, also called at exit).
        """
        with self._prepared_lock:
            pending, self._prepared = list(self._prepared.values()), {}
        for job, _ in pending:
            with contextlib.suppress(Exception):  # a failed preparation has nothing left to release
                job.result()
        self._stop.set()
        if self._heartbeat is not threading.current_thread():  # not inside a store call when the process exits
            self._heartbeat.join(timeout=2 * HEARTBEAT_SECONDS + 5.0)

    def _check_peer(self, peer: int) -> None:
        if peer == self.rank or not 0 <= peer < self.world_size:
            raise ValueError(f"peer must be another rank in [0, {self.world_size}), got {peer}")

    def open(self, peer: int, *, key: str, timeout: float | None = None, deadline: float | None = None) -> Channel:
        self._check_peer(peer)
        timeout = self.timeout if timeout is None else timeout
        deadline = timeout if deadline is None else deadline
        with self._prepared_lock:
            entry = self._prepared.pop((peer, key), None)
        if entry is not None:
            try:
                pg, other = entry[0].result(timeout)
            except ExchangeError:
                raise
            except Exception as err:  # noqa: BLE001 - every failure to meet the peer is an ExchangeError
                raise ExchangeError(f"meeting rank {peer} for {key} failed: {type(err).__name__}: {err}") from err
            with self._stores.lease() as store:  # a peer that left after the group was prepared dropped its end
                if self._peer_gone(store, peer, time.monotonic()) == "left":
                    raise PeerLeft(f"rank {peer} has left (departure notice) before {key}")
        else:
            pg, other = self._build(peer, key, timeout)
        return _GlooChannel(pg, other, peer, key, deadline)

    def decline(self, peer: int, *, key: str) -> None:
        self._check_peer(peer)
        with self._stores.lease() as store:
            prefix = self._prefix(peer, key)
            store.compare_set(f"{prefix}/decision", "", _HELLO_SKIP)
            store.set(f"{prefix}/hello/{self.rank}", _HELLO_SKIP)

    def all_gather(self, payload: bytes, *, key: str, timeout: float | None = None) -> list[bytes]:
        timeout = self.timeout if timeout is None else timeout
        if self.world_size == 1:
            return [payload]
        if self._coll is None:
            raise RuntimeError("this transport was built without exact=True")

        def run() -> list[bytes]:
            with self._coll_lock:
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

        return call_with_deadline(run, timeout, f"all_gather {key}")

    def all_reduce_mean(self, flat: torch.Tensor, *, key: str, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        if self.world_size == 1:
            return
        if self._coll is None:
            raise RuntimeError("this transport was built without exact=True")
        work = flat.detach().to("cpu", torch.float32, copy=True)

        def run() -> None:
            with self._coll_lock:
                dist.all_reduce(work, group=self._coll)

        call_with_deadline(run, timeout, f"all_reduce {key}")
        flat.copy_((work / self.world_size).to(device=flat.device, dtype=flat.dtype))


class _GlooChannel(Channel):
    """A channel on a private 2-rank Gloo group: each payload travels as its length, then its bytes."""

    def __init__(self, pg: Any, other: int, peer: int, key: str, deadline: float):
        self.pg, self.other, self.peer, self.key = pg, other, peer, key
        self._tag = 0
        self._deadline = datetime.timedelta(seconds=deadline)

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
            raise ExchangeError(f"exchange {self.key} with rank {self.peer} failed: {type(err).__name__}: "
                                f"{err}") from err
        return buf.numpy().tobytes()


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

    def open(self, peer: int, *, key: str, timeout: float = 60.0, deadline: float | None = None) -> Channel:
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

    def all_gather(self, payload: bytes, *, key: str, timeout: float = 60.0) -> list[bytes]:
        for dst in range(self.world_size):
            if dst != self.rank:
                self.hub._put(key, self.rank, dst, payload)
        return [payload if src == self.rank else self.hub._take(key, src, self.rank, timeout)
                for src in range(self.world_size)]
