"""Who is in the job: the :class:`Membership` interface the transport and the mixer ask, and its static form.

A membership answers, for every peer: is it still there (heartbeat, departure notice), did it come back as a new
process, which outer round did it reach; it posts this worker's own heartbeat and departure, and lets the wrapper
join a running job (:meth:`Membership.before_round`, :meth:`Membership.rejoin`). Three forms:

* :class:`Membership`: knows nothing (a single worker, the in-process :class:`~fgdiloco.gossip.LocalHub`);
* :class:`StoreMembership`: the workers of one ``torch.distributed`` process group, on the group's store: a
  heartbeat counter per worker, bumped every :data:`~fgdiloco.config.HEARTBEAT_SECONDS`; a peer whose counter has not
  moved for ``liveness`` seconds is taken for dead or hung (``SUSPECT_SECONDS`` once another worker saw its
  connections reset, the mark of a dead process); a departure notice (:meth:`leave`) ends every wait for it at once.
  A pipeline stage's membership also watches its peers' *sibling stages* (``siblings``): a peer whose replica has a
  stage without a heartbeat for ``liveness`` is gone too, since a hung stage holds its whole replica (its other
  stages still beat, blocked in a stage-to-stage transfer, and would be waited for as late peers).
  The set of workers is fixed: nobody joins or comes back. The store lives in one of the job's processes (rank 0,
  or torchrun's agent) and dies with it: a worker whose store has been out of reach for ``store_timeout`` raises
  :class:`StoreUnreachable` at its next round start instead of training on alone after its job has ended.
* :class:`fgdiloco.elastic.ElasticMembership`: slots that workers take, leave and take again, on a store that no
  worker hosts (elastic jobs).

Store connections. Each exchange in flight talks to the store over its own connection (:class:`StorePool` of
``Store.clone()``\\ s): a store client serialises its operations, so Mix1's background exchange waiting for its
peer would otherwise hold up Mix2's on the main thread, and two workers could each wait for the other (seen on a
TCPStore).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist

from ..config import HEARTBEAT_SECONDS, FGDiLoCoConfig
from ..runtime import Service

__all__ = ["Membership", "StoreMembership", "StorePool", "StoreUnreachable", "SUSPECT_SECONDS"]

log = logging.getLogger("fgdiloco")

#: Liveness of a peer that another worker already saw reset its connections (a dead process), seconds (4 beats).
SUSPECT_SECONDS = 1.0


class StoreUnreachable(RuntimeError):
    """The job's store has been out of reach for longer than ``store_timeout`` (seconds): the worker stops. In an
    elastic job it checkpoints first (``--resume`` continues once a store is back); in a fixed group the store died
    with the process that served it, and with it the job."""


class StorePool:
    """Store connections handed to one user at a time (a clone costs ~0.2 s on a TCPStore, so they are reused).
    :meth:`replace` swaps in a new connection to a restarted store; connections to the old one are dropped as they
    come back."""

    def __init__(self, store: dist.Store, warm: int = 2):
        self._base = store
        self._free = [store.clone() for _ in range(warm)]
        self._lock = threading.Lock()
        self._old: set[int] = set()  # ids of connections to a store that was replaced

    def acquire(self) -> dist.Store:
        """A free connection, or a new one (raises ``DistNetworkError`` at once when the store's server is gone)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            base = self._base
        _probe(base)
        return base.clone()

    def release(self, store: dist.Store) -> None:
        with self._lock:
            if id(store) in self._old:
                self._old.discard(id(store))
                return
            self._free.append(store)

    def replace(self, store: dist.Store, in_use: list[dist.Store]) -> None:
        """Use ``store`` from now on; ``in_use``: connections leased now, dropped when released."""
        with self._lock:
            self._base = store
            self._free = []
            self._old |= {id(s) for s in in_use}

    @contextlib.contextmanager
    def lease(self) -> Iterator[dist.Store]:
        """A connection for the ``with`` block, given back after it."""
        store = self.acquire()
        try:
            yield store
        finally:
            self.release(store)


def _address(store: dist.Store) -> tuple[str, int] | None:
    """The (host, port) of the TCPStore server behind ``store`` (through any PrefixStores), or None."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def _probe(store: dist.Store) -> None:
    """Raise ``DistNetworkError`` when the TCPStore server behind ``store`` does not accept a connection within 1 s.

    A TCPStore clone retries its connect for the store's whole timeout (30 min for a group that Lightning or
    ``init_process_group`` built), so a thread that needed a new connection after the server died (a launcher's
    rank 0 hosts it) held its worker that long: a rank that should have stopped at ``store_timeout`` hung instead.
    """
    address = _address(store)
    if address is not None and not server_accepts(*address):
        raise dist.DistNetworkError(f"the store's server at {address[0]}:{address[1]} does not accept a connection")


def server_accepts(host: str, port: int) -> bool:
    """Whether a store server at ``host:port`` accepts a plain TCP connection within 1 s (a TCPStore client that
    cannot connect retries for its whole timeout and logs c10d errors every time: look first)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class Membership:
    """The membership of a job nobody joins or leaves and nobody watches (a single worker, in-process tests): every
    question is answered "not known". ``rank`` and ``world_size`` are positions in the gossip group."""

    incarnation = 1
    #: whether exchange keys name each side's process (an elastic job's incarnations): a worker that loads a
    #: checkpoint then meets no exchange of its predecessor without moving its keys to a new generation
    keys_per_process = False

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank = rank
        self.world_size = world_size

    # ---- exchanges
    def prefix(self, peer: int, key: str) -> str:
        """The store prefix of the exchange ``key`` between this worker and ``peer`` (both derive the same)."""
        a, b = sorted((self.rank, peer))
        return f"{key}/{a}-{b}"

    def gone(self, peer: int, since: float) -> str | None:
        """Why ``peer`` will not come (``"left"``, ``"absent"``, ``"restarted"``, or its heartbeat stopped), or
        None when it may still come; ``since`` (``time.monotonic()``) is when the caller started waiting."""
        return None

    def has_left(self, peer: int) -> bool:
        """Whether ``peer`` is known to have posted a departure notice."""
        return False

    def returned(self, peer: int) -> bool:
        """Whether ``peer`` came back as a new process since this was last asked (then its departure notice is
        forgotten)."""
        return False

    def suspect(self, peer: int) -> None:  # noqa: B027 - optional
        """Tell the job that ``peer``'s connection was reset (it is probably dead): others wait less for it."""

    #: whether the job's store is out of reach now (exchanges are skipped at once meanwhile)
    unreachable = False
    #: how many times the store was reconnected to (exchanges set up before a reconnect are set up anew)
    epoch = 0
    #: whether this worker has posted its departure notice (:meth:`leave`): it starts no exchange again, and a set-up
    #: still running with any peer is not waited for (the peer may have seen the notice and never build the group)
    departed = False

    def leave(self) -> None:
        """Post this worker's departure notice: every later exchange a peer attempts with it ends at once."""
        self.departed = True

    # ---- rounds
    def peer_round(self, peer: int) -> int | None:
        """The outer round ``peer`` last said it started, or None (not known). A peer past the round of an
        exchange will never come to it."""
        return None

    def lagging(self, peer: int) -> int | None:
        """How many outer rounds ``peer`` is behind the job's median round, when that is far enough for it to
        catch up (jump to the live round at its next round start) instead of coming to the exchanges of the rounds
        in between; else None. Default: never known (a fixed group does not catch up)."""
        return None

    # ---- joining a running job (elastic memberships; nothing to do in a fixed group)
    def before_round(self, outer: Any, agree: Any = None) -> None:  # noqa: B027 - optional
        """Called by the wrapper before every outer round starts, with its :class:`~fgdiloco.outer.state.OuterState`
        (an elastic membership joins the live round, answers joiners, publishes the round). ``agree``: how the
        stages of a pipeline replica decide together (``[ints] -> [their maxima]``), or None."""

    def rejoin(self, outer: Any, agree: Any = None) -> None:  # noqa: B027 - optional
        """Join the job at its live round now (``FGDiLoCo.rejoin``); ``agree`` as for :meth:`before_round`."""

    def close(self) -> None:  # noqa: B027 - optional
        """Stop the heartbeat and release connections."""


class StoreMembership(Membership):
    """The workers of one ``torch.distributed`` group on its store (see the module docstring).

    Args:
        store: the job's store (every member uses the same one).
        rank, world_size: this worker's position and the number of workers.
        namespace: the keys' prefix (unique per job and run).
        liveness: heartbeat silence (seconds) after which a peer is taken for dead or hung.
        store_timeout: how long (seconds) the worker trains on without gossip while the store is out of reach;
            then :meth:`before_round` raises :class:`StoreUnreachable`.
        siblings: for a stage of a pipeline replica, the namespaces of its replica's other stages (the same store;
            in each, a peer's position is the same replica's stage): a peer counts as gone when one of its
            replica's other stages has had no heartbeat for ``liveness`` seconds.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, namespace: str, *,
                 liveness: float = FGDiLoCoConfig.liveness, store_timeout: float = FGDiLoCoConfig.store_timeout,
                 siblings: Sequence[str] = ()):
        super().__init__(rank, world_size)
        self.namespace = namespace
        self.siblings = tuple(siblings)
        self.liveness = float(liveness)
        self.store_timeout = float(store_timeout)
        self.stores = StorePool(store)
        self._seen: dict[object, tuple[int, float]] = {}  # peer (or (sibling, peer)) -> (heartbeat, when it changed)
        self.down_since: float | None = None  # when the store stopped answering (None: it answers)
        self._misses, self._last_try = 0, 0.0
        self._left: set[int] = set()
        self._lock = threading.Lock()
        self._beat_store = self.stores.acquire()
        self._register(self._beat_store)
        self._beat_store.add(self._key("alive", self.rank), 1)
        self._service = Service(self._tick, HEARTBEAT_SECONDS, "heartbeat")

    def _register(self, store: dist.Store) -> None:
        """Hook for subclasses: keys to set before the first heartbeat."""

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.namespace}/{kind}/{rank}"

    def _tick(self) -> None:
        if self.down_since is not None:  # a store that is gone: try again less and less often (each failed call
            wait = min(HEARTBEAT_SECONDS * 2 ** self._misses, 5.0)  # logs a c10d warning), at most every 5 s
            if time.monotonic() - self._last_try < wait:
                return
        self._last_try = time.monotonic()
        try:
            self._beat_store.add(self._key("alive", self.rank), 1)
        except Exception as err:  # noqa: BLE001 - c10d raises DistNetworkError/RuntimeError for a store that is gone
            self._misses += 1
            self._store_failed(err)
            return
        self._misses = 0
        self._store_ok()

    def _store_failed(self, err: BaseException) -> None:
        """The store did not answer: gossip stops (exchanges are skipped at once) until it answers again."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("fgdiloco rank %d: the gossip store does not answer (%s: %s); training on without gossip "
                        "while it is away", self.rank, type(err).__name__, str(err).splitlines()[0][:200])

    def _store_ok(self) -> None:
        if self.down_since is not None:
            log.warning("fgdiloco rank %d: the gossip store answers again after %.1f s", self.rank,
                        time.monotonic() - self.down_since)
            self.down_since = None

    @property
    def unreachable(self) -> bool:
        """Whether the store did not answer this worker's last heartbeat (exchanges are skipped meanwhile)."""
        return self.down_since is not None

    def too_long_away(self) -> bool:
        """Whether the store has been out of reach for more than ``store_timeout`` seconds."""
        return self.down_since is not None and time.monotonic() - self.down_since > self.store_timeout

    def _store_name(self) -> str:
        """How :class:`StoreUnreachable`'s message names the store."""
        return "the job's store (served by rank 0's process or the launcher: the job has ended)"

    def _who(self) -> str:
        """How :class:`StoreUnreachable`'s message names the worker that stops."""
        return f"rank {self.rank}"

    def check_reachable(self, force: bool = False) -> None:
        """Raise :class:`StoreUnreachable` once the store has been out of reach for ``store_timeout`` seconds
        (``force``: now, another stage of this worker's replica found it so)."""
        if force or self.too_long_away():
            away = f"{time.monotonic() - self.down_since:.0f} s" if self.down_since is not None else "too long"
            raise StoreUnreachable(f"{self._store_name()} has been out of reach for {away} (store_timeout "
                                   f"{self.store_timeout:g} s): stopping {self._who()}")

    def before_round(self, outer: Any, agree: Any = None) -> None:
        """A fixed group has nobody to join: only stop when the store has been away for ``store_timeout``."""
        self.check_reachable()

    def prefix(self, peer: int, key: str) -> str:
        return f"{self.namespace}/{super().prefix(peer, key)}"

    def gone(self, peer: int, since: float) -> str | None:
        with self.stores.lease() as store:
            return self._gone(store, peer, since) or self._replica_stalled(store, peer, since)

    def _replica_stalled(self, store: dist.Store, peer: int, since: float) -> str | None:
        """Why ``peer``'s pipeline replica is stuck (one of its other stages has had no heartbeat for ``liveness``),
        or None."""
        # add(key, 0), not a batched multi_get: a sibling job whose slots are not made yet must not block the check
        for ns in self.siblings:
            beat = store.add(f"{ns}/alive/{peer}", 0)
            silent = self._silent_for((ns, peer), beat, since)
            if silent > self.liveness:
                return f"its replica's {ns.rsplit('/', 1)[-1]} has had no heartbeat for {silent:.1f} s"
        return None

    def _silent_for(self, who: object, beat: int, since: float) -> float:
        """Seconds the heartbeat counter ``who`` has kept the value ``beat`` (0 on a change; counted at the earliest
        from ``since``, when the caller started waiting)."""
        now = time.monotonic()
        with self._lock:
            value, seen = self._seen.get(who, (None, since))
            if value != beat:
                self._seen[who] = (beat, now)
                return 0.0
        return now - seen

    def _gone(self, store: dist.Store, peer: int, since: float) -> str | None:
        if self._departed(store, peer):
            return "left"
        beat = store.add(self._key("alive", peer), 0)
        verdict = self._slot_verdict(store, peer, beat)
        if verdict is not None:
            return verdict
        limit = SUSPECT_SECONDS if store.add(self._key("suspect", peer), 0) > 0 else self.liveness
        silent = self._silent_for(peer, beat, since)
        if silent > limit:
            return f"no heartbeat for {silent:.1f} s"
        return None

    def _slot_verdict(self, store: dist.Store, peer: int, beat: int) -> str | None:
        """Hook for subclasses (an empty or re-taken slot); a fixed group has none."""
        return None

    def _departed(self, store: dist.Store, peer: int) -> bool:
        if peer in self._left:
            return True
        if store.add(self._key("left", peer), 0) > 0:
            with self._lock:
                self._left.add(peer)
            return True
        return False

    def has_left(self, peer: int) -> bool:
        return peer in self._left

    def suspect(self, peer: int) -> None:
        with self.stores.lease() as store:
            store.add(self._key("suspect", peer), 1)

    def leave(self) -> None:
        super().leave()
        with self.stores.lease() as store:
            store.add(self._key("left", self.rank), 1)

    def close(self) -> None:
        self._service.stop()
