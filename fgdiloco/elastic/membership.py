"""Membership of an elastic job: slots that workers take, leave and take again, on a store no worker hosts.

* **Slots.** The job has ``world_size`` slots; a worker takes one. The gossip schedule is the same matching over the
  slots on every worker, so it stays doubly stochastic over whoever is live: a worker whose partner slot is empty
  (never joined, or departed with a notice) skips that gossip round at once; a partner that died costs one
  ``liveness`` wait and then back-off.
* **Incarnations.** Each process that takes a slot is a new incarnation (a counter in the store). Exchange keys name
  both sides' incarnations (:meth:`ElasticMembership.prefix`), so a restarted worker never meets what its dead
  predecessor left behind, and its peers reset their back-off for it as soon as they see the new incarnation
  (:meth:`ElasticMembership.returned`).
* **Joining.** A process that took a slot counts as *joining* until it starts its first outer round (it may be
  importing, loading its checkpoint or waiting for a peer's state for seconds): once the job is past round 0, its
  peers skip their exchanges with it at once instead of waiting their join deadline for a worker that will enter a
  later round (``joined``: the incarnation that started a round). At round 0 everyone is joining and is waited for.
  The job's *first workers* (those that registered before any worker passed the start barrier of
  :func:`~fgdiloco.elastic.connect`; the job's ``begun`` key) are joined from their registration on, whatever
  round they start at: a resumed job starts at its checkpoints' round, and a first worker that passed the barrier
  and started that round before its partner had looked must not take the partner for a late joiner.
* **Published rounds.** Every worker publishes the outer round it starts; the *live round* is the newest any slot
  reached. A worker that restarted, hung, or joins late enters the job there (:mod:`fgdiloco.elastic.rejoin`).
* **State for joiners.** A worker without state of its own asks for one (:meth:`ElasticMembership.request_state`);
  every live worker's heartbeat looks for requests (one store read per beat) and the first to claim one answers it
  with its last committed round-start state. When the claimer dies before sending, the joiner asks again and
  another live peer answers.

* **Owners.** A slot is held by one torchrun job at a time (its ``TORCHELASTIC_RUN_ID``: a restart of the same job
  takes the slot back at once). A second process claiming a slot whose holder is alive is refused
  (:class:`SlotTaken`); one whose holder is dead (no heartbeat for ``liveness``) or departed takes it over.
* **The store is soft state.** When the store stops answering, gossip stops (exchanges are skipped at once) and the
  worker trains on; every heartbeat tries to reconnect, and on success the worker re-publishes what is its own
  (slot counters, incarnation, round, owner, the job's admission keys), so a restarted store is whole again after a
  beat. After ``store_timeout`` seconds out of reach the next round start raises :class:`StoreUnreachable`.

Every slot's keys are created by the first worker to connect, so a round start reads all slots at once
(``multi_get``: one store round trip whatever the slot count).
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ..config import HEARTBEAT_SECONDS, FGDiLoCoConfig
from ..gossip.membership import StoreMembership, StoreUnreachable, server_accepts

__all__ = ["ElasticMembership", "SlotTaken", "StoreUnreachable"]

log = logging.getLogger("fgdiloco")


class SlotTaken(RuntimeError):
    """Another live process holds this worker's slot (a second process started with an index already in use)."""


class StoreNotReached(StoreUnreachable, TimeoutError):
    """:func:`~fgdiloco.elastic.connect` could not reach the gossip store at all within its ``timeout``: a
    :class:`StoreUnreachable` (a life of ``fgdiloco launch`` stops for good instead of being restarted by torchrun
    to wait again) and, as documented before, a ``TimeoutError``."""

#: A slot whose heartbeat has not moved for this long (seconds; 4 beats) is left out of the job's median round
#: (:meth:`ElasticMembership.front`).
BEATING_SECONDS = 4 * HEARTBEAT_SECONDS

_KINDS = ("alive", "left", "incarnation", "round", "suspect", "joined")  # per-slot counters, made for every slot


def read_counters(store: dist.Store, keys: Sequence[str]) -> list[int]:
    """The values of the counters ``keys`` (``store.add``-keys that exist), in one round trip where the store has
    ``multi_get``."""
    if not keys:
        return []
    if getattr(store, "has_extended_api", lambda: False)():
        return [int(v) for v in store.multi_get(list(keys))]
    return [store.add(k, 0) for k in keys]


class ElasticMembership(StoreMembership):
    """The slot ``rank`` of an elastic job of ``world_size`` slots on ``store`` (a ``TCPStore`` no worker hosts).

    Args:
        store: the job's gossip store.
        rank: this worker's slot, in ``[0, world_size)``.
        world_size: the job's slots.
        namespace: the job's keys' prefix (``fgdiloco/<job>``).
        liveness: heartbeat silence (seconds) after which a peer is taken for dead or hung.
        address: the store's ``(host, port)``, to reconnect to a restarted store.
        store_timeout: seconds out of reach of the store before the worker stops (:class:`StoreUnreachable`).
        job_keys: keys every worker of the job agrees on (re-published to a restarted store).
        siblings: a pipeline stage's: the namespaces of its replica's other stages (``fgdiloco/<job>.stage<t>``);
            a peer whose replica has a stage without a heartbeat for ``liveness`` is gone (a hung stage holds its
            replica).
        first: :func:`~fgdiloco.elastic.connect`'s: when no worker has passed the job's start barrier yet
            (:meth:`begin`), this process is one of the job's first workers and joined from its registration on
            (:attr:`first` says whether it was).

    Raises:
        ValueError: ``rank`` or ``world_size`` out of range, or an empty ``namespace``.
    """

    keys_per_process = True  # prefix() names both sides' incarnations

    def __init__(self, store: dist.Store, rank: int, world_size: int, namespace: str, *,
                 liveness: float = FGDiLoCoConfig.liveness, address: tuple[str, int] | None = None,
                 store_timeout: float = FGDiLoCoConfig.store_timeout, job_keys: dict[str, bytes] | None = None,
                 siblings: Sequence[str] = (), first: bool = False):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1 (the job's worker slots), got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        self._incarnations: dict[int, int] = {}  # the incarnation of each peer our exchange keys name
        self._wants_seen = 0  # the store's count of state requests when this worker last looked
        self._source: Callable[[], tuple[int, bytes] | None] | None = None
        self._serve_lock = threading.Lock()
        self._request = 0  # the sequence number of this worker's newest state request
        self._address = address
        self._job_keys = dict(job_keys or {})  # key -> value every worker of the job agrees on (re-published)
        self._owner = os.environ.get("TORCHELASTIC_RUN_ID") or secrets.token_hex(8)
        self._last_attempt = 0.0
        #: set on reconnecting: the next round start joins the live round even one round behind
        self.resync = False
        self.round_now = 0  # the round this worker is in (published again to a restarted store)
        self._joined = False  # whether this process has joined the job's rounds (see mark_joined)
        self._may_be_first, self.first, self._began = bool(first), False, False
        super().__init__(store, rank, world_size, namespace, liveness=liveness, store_timeout=store_timeout,
                         siblings=siblings)

    # ------------------------------------------------------------------ slots and incarnations
    def _make_slots(self, store: dist.Store) -> None:
        if store.add(f"{self.namespace}/slots-made", 1) == 1:  # the first worker creates every slot's counters
            for r in range(self.world_size):
                for kind in _KINDS:
                    store.add(self._key(kind, r), 0)
            store.set(f"{self.namespace}/slots-ready", b"1")
        else:
            store.wait([f"{self.namespace}/slots-ready"])

    def _register(self, store: dist.Store) -> None:
        self._make_slots(store)
        self._claim(store)
        self.incarnation = store.add(self._key("incarnation", self.rank), 1)
        if store.add(self._key("left", self.rank), 0) > 0:  # a predecessor's departure notice is not ours
            store.set(self._key("left", self.rank), "0")
        self._published = store.add(self._key("round", self.rank), 0)
        # before the first heartbeat: no one passes the start barrier without this slot once it beats, so a worker
        # that finds the job not begun here is waited for at the barrier, and joined before anyone can see it
        if self._may_be_first and store.add(self._begun_key, 0) == 0:
            self.first = True
            self._post_joined(store)

    @property
    def _begun_key(self) -> str:
        """A counter, nonzero once a worker has passed the job's start barrier."""
        return f"{self.namespace}/begun"

    def begin(self) -> None:
        """This worker passed the job's start barrier (:func:`~fgdiloco.elastic.connect`): processes that register
        from now on are not first workers (they join at their first round start). Re-posted to a restarted
        store."""
        self._began = True
        with self.stores.lease() as store:
            store.add(self._begun_key, 1)

    def _claim(self, store: dist.Store) -> None:
        """Take this slot, unless another live process holds it (:class:`SlotTaken`)."""
        key = self._key("owner", self.rank)
        holder = store.compare_set(key, "", self._owner).decode()
        if holder in ("", self._owner):
            return
        alive, left = self._key("alive", self.rank), self._key("left", self.rank)
        if store.add(left, 0) == 0:  # a holder that left with a notice gives the slot up at once
            beat, t_end = store.add(alive, 0), time.monotonic() + self.liveness
            while time.monotonic() < t_end:
                time.sleep(HEARTBEAT_SECONDS)
                if store.add(alive, 0) != beat:
                    raise SlotTaken(f"slot {self.rank} of job {self.namespace.split('/', 1)[-1]!r} is held by a live "
                                    f"worker (torchrun job {holder}): start this one with a free FGDILOCO_WORKER")
        store.set(key, self._owner)  # the holder is gone: take the slot over

    def _incarnation_of(self, peer: int) -> int:
        with self._lock:
            return self._incarnations.get(peer, 1)

    def prefix(self, peer: int, key: str) -> str:
        """Both sides' incarnations in the key: a new process never meets its predecessor's exchanges."""
        (a, ia), (b, ib) = sorted(((self.rank, self.incarnation), (peer, self._incarnation_of(peer))))
        return f"{self.namespace}/{key}/{a}.{ia}-{b}.{ib}"

    def _slot_verdict(self, store: dist.Store, peer: int, beat: int) -> str | None:
        if beat == 0:
            return "absent"
        now = store.add(self._key("incarnation", peer), 0)  # 0: a restarted store the peer has not refilled yet
        if now not in (0, self._incarnation_of(peer)):
            return "restarted"
        if now and self.round_now > 0 and store.add(self._key("joined", peer), 0) != now:
            return "joining"
        return None

    def mark_joined(self) -> None:
        """Tell the job that this process takes part in its rounds: its peers exchange with it from now on (until
        then they skip it at once, see the module docstring). A restart or a late joiner posts it at its first
        round start, once it has entered the live round; one of the job's first workers at its registration (see
        ``first``), so that a set-up ending after its partners' is waited for at every exchange, as at round 0,
        instead of being skipped from round 1 on (its partners not paired with it in round 0 went on to round 1
        without it: the trajectory depended on timing). Idempotent."""
        with self.stores.lease() as store:
            self._post_joined(store)

    def _post_joined(self, store: dist.Store) -> None:
        self._joined = True
        key = self._key("joined", self.rank)
        store.add(key, self.incarnation - store.add(key, 0))

    def returned(self, peer: int) -> bool:
        with self.stores.lease() as store:
            now = store.add(self._key("incarnation", peer), 0)
        if now == 0:  # never joined, or a restarted store it has not refilled yet: nothing new about it
            return False
        with self._lock:
            before = self._incarnations.get(peer)
            self._incarnations[peer] = now
            if before is None or now == before:
                return False
            self._left.discard(peer)
            for who in [peer, *((ns, peer) for ns in self.siblings)]:
                self._seen.pop(who, None)
        return True

    def joined(self) -> list[int]:
        """The slots that have held a worker (one store round trip)."""
        with self.stores.lease() as store:
            beats = read_counters(store, [self._key("alive", r) for r in range(self.world_size)])
        return [r for r, b in enumerate(beats) if b > 0]

    # ------------------------------------------------------------------ rounds
    def publish_round(self, outer_round: int) -> None:
        """Tell the job that this worker starts outer round ``outer_round``."""
        self.round_now = int(outer_round)
        with self.stores.lease() as store:
            self._published = store.add(self._key("round", self.rank), int(outer_round) - self._published)

    def peer_round(self, peer: int) -> int | None:
        with self.stores.lease() as store:
            return store.add(self._key("round", peer), 0)

    def slot_rounds(self, *, departed: bool) -> dict[int, int]:
        """The published round of every other slot that ever held a worker; ``departed``: with those that left.
        One store round trip whatever the slot count; it also notes each slot's heartbeat (:meth:`front`)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [self._key(kind, r) for r in others for kind in ("round", "alive", "left")]
        with self.stores.lease() as store:
            values = read_counters(store, keys)
        out, now = {}, time.monotonic()
        for i, r in enumerate(others):
            rnd, alive, left = values[3 * i: 3 * i + 3]
            self._silent_for(r, alive, now)  # when each heartbeat last moved, as this worker watches it
            if alive > 0 and (departed or left == 0):
                out[r] = rnd
        return out

    def live_round(self) -> int | None:
        """The newest outer round a slot has started, departed workers included (a worker that restarts after every
        peer finished joins at the job's end), or None when no other slot ever held a worker."""
        rounds = self.slot_rounds(departed=True)
        return max(rounds.values()) if rounds else None

    def peer_rounds(self) -> dict[int, int]:
        """The round each peer still in the job (joined, not departed) last started."""
        return self.slot_rounds(departed=False)

    def front(self, rounds: dict[int, int] | None = None, *, without: int | None = None) -> int | None:
        """The job's median round as the worker ``without`` sees it (default: this worker): the lower median of the
        rounds last started by every slot still in the job but ``without`` (this worker included when ``without``
        is another) whose heartbeat moved within the last :data:`BEATING_SECONDS` as this worker watched it. A hung or
        dead worker's round, and its slot, do not hold the median back: with a third of an 8-worker chaos job
        stopped at a time, the median of every slot lagged the workers that trained. None when no such slot.
        ``rounds``: :meth:`peer_rounds` when just read."""
        rounds = self.peer_rounds() if rounds is None else rounds
        now = time.monotonic()
        with self._lock:
            beating = [rnd for r, rnd in rounds.items()
                       if r != without and now - self._seen.get(r, (None, now))[1] <= BEATING_SECONDS]
        if without is not None and without != self.rank:
            beating.append(self.round_now)
        beating.sort()
        return beating[(len(beating) - 1) // 2] if beating else None

    def lagging(self, peer: int) -> int | None:
        """How far ``peer`` is behind the job's median round as it sees it (:meth:`front`), when that is
        :data:`~fgdiloco.elastic.rejoin.CATCH_UP_ROUNDS` or more: then its next round start jumps to the live round
        (it hung, or lost time waiting), so its partners skip it at once instead of waiting for a worker that holds
        them back by rounds. One store round trip."""
        from .rejoin import CATCH_UP_ROUNDS

        rounds = self.peer_rounds()
        front = self.front(rounds, without=peer) if peer in rounds else None
        if front is None or front - rounds[peer] < CATCH_UP_ROUNDS:
            return None
        return front - rounds[peer]

    # ------------------------------------------------------------------ state for joiners
    def _want_key(self, rank: int) -> str:
        return self._key("want", rank)

    def _state_key(self, rank: int, request: str) -> str:
        return f"{self.namespace}/state/{rank}.{request}"

    def serve(self, source: Callable[[], tuple[int, bytes] | None] | None) -> None:
        """Answer joiners' state requests from now on with ``source()``: ``(round, payload)`` of this worker's last
        committed round-start state, or None while it has none (None: stop answering)."""
        self._source = source

    def _tick(self) -> None:
        if self.unreachable and self._address is not None:
            self._reconnect()
            if self.unreachable:  # no beats on a dead connection: each failed store call logs a c10d warning
                return
        super()._tick()
        if self._source is not None and not self.unreachable:
            self.answer_requests(self._beat_store)

    def _reconnect(self) -> None:
        """Connect anew to the store's address (at most once a second) and re-publish this worker's own state."""
        now = time.monotonic()
        if now - self._last_attempt < 1.0:
            return
        self._last_attempt = now
        host, port = self._address
        if not server_accepts(host, port):
            return
        try:
            fresh = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=2), use_libuv=True)
        except Exception:  # noqa: BLE001 - still away: try again at a later beat
            return
        self.stores.replace(fresh, [self._beat_store])
        self._beat_store = self.stores.acquire()
        self.epoch += 1
        self.resync = True  # the workers went on alone meanwhile, each at its own pace: meet at the live round
        try:
            self._republish(self._beat_store)
        except Exception as err:  # noqa: BLE001 - it went away again: the next beat notices
            log.debug("fgdiloco: re-publishing to the gossip store failed: %s", err)
            return
        self._store_ok()

    def _republish(self, store: dist.Store) -> None:
        """Put this worker's soft state back (a restarted store starts empty; one that only was unreachable keeps
        it, and this changes nothing there)."""
        for key, value in self._job_keys.items():
            store.compare_set(key, "", value)
        self._make_slots(store)
        store.compare_set(self._key("owner", self.rank), "", self._owner)
        own = [("incarnation", self.incarnation), ("round", self.round_now)]  # joined first: never seen "joining"
        for kind, value in ([("joined", self.incarnation)] if self._joined else []) + own:
            key = self._key(kind, self.rank)
            self._published = store.add(key, value - store.add(key, 0))
        if self._began:
            store.add(self._begun_key, 1)
        with self._lock:
            self._seen.clear()  # heartbeats restart from 0 on a new store

    def _store_name(self) -> str:
        return "the gossip store" + (f" at {self._address[0]}:{self._address[1]}" if self._address else "")

    def _who(self) -> str:
        return "this worker"

    def answer_requests(self, store: dist.Store) -> int:
        """Answer the state requests not answered yet (one store read when there are none); returns how many this
        worker answered."""
        with self._serve_lock:
            wants = store.add(f"{self.namespace}/wants", 0)
            if wants == self._wants_seen or self._source is None or self.departed:
                return 0
            self._wants_seen = wants
            others = [r for r in range(self.world_size) if r != self.rank]
            asked = [r for r in others if store.check([self._want_key(r)])]
            answered = 0
            for r in asked:
                request = store.get(self._want_key(r)).decode()
                key = self._state_key(r, request)
                if store.check([key + "/claim"]):
                    continue
                state = self._source()
                if state is None:
                    self._wants_seen = -1  # look again at the next beat
                    return answered
                mine = str(self.rank).encode()
                if store.compare_set(key + "/claim", "", mine) != mine:
                    continue
                store.set(key, state[1])
                answered += 1
            return answered

    def request_state(self) -> None:
        """Ask the live peers for their state (a worker joining without one of its own)."""
        self._request += 1
        with self.stores.lease() as store:
            store.set(self._want_key(self.rank), f"{self.incarnation}.{self._request}")
            store.add(f"{self.namespace}/wants", 1)

    def await_state(self, timeout: float) -> bytes | None:
        """The answer to this worker's :meth:`request_state`, or None when none came within ``timeout`` seconds or
        no live peer is left to answer. A peer that claimed the request and died before answering is replaced: the
        request is posted again for the others."""
        t0 = time.monotonic()
        with self.stores.lease() as store:
            while True:
                key = self._state_key(self.rank, f"{self.incarnation}.{self._request}")
                if store.check([key]):
                    return store.get(key)
                if time.monotonic() - t0 > timeout or not self._anyone_there(store, t0):
                    return None
                if store.check([key + "/claim"]):
                    donor = int(store.get(key + "/claim"))
                    if self._gone(store, donor, t0) is not None:
                        self.request_state()
                time.sleep(HEARTBEAT_SECONDS / 2)

    def _anyone_there(self, store: dist.Store, since: float) -> bool:
        """Whether some other slot holds a live worker (joined, not departed, heartbeat moving). Asks on the
        connection the caller holds: a second lease would open a new one when the pool is empty, and each new
        store connection costs a reverse DNS lookup (up to 5 s where the resolver drops a query)."""
        return any(self._gone(store, r, since) is None for r in range(self.world_size) if r != self.rank)

    # ------------------------------------------------------------------ joining a running job
    def before_round(self, outer: Any, agree: Any = None) -> None:
        from .rejoin import before_round

        self.round_now = outer.round  # what a restarted store learns when this worker refills it
        before_round(self, outer, agree)

    def rejoin(self, outer: Any, agree: Any = None) -> None:
        from .rejoin import rejoin

        rejoin(self, outer, agree)

    def leave(self) -> None:
        super().leave()
        # the last worker to leave says that the job ended, and at which round: a worker that joins it later trains
        # nothing and is told so (rejoin). Each posts its notice before it looks, so of two that leave together at
        # least one sees the other's. Another slot's worker that died without a notice keeps it unsaid.
        try:
            if not self.slot_rounds(departed=False):
                with self.stores.lease() as store:
                    store.set(self._ended_key, str(self.round_now))
        except Exception as err:  # noqa: BLE001 - a store we cannot reach: left unsaid, as by a worker that died
            log.debug("fgdiloco rank %d: could not say that the job ended: %s", self.rank, err)

    @property
    def _ended_key(self) -> str:
        return f"{self.namespace}/ended"

    def ended(self) -> int | None:
        """The outer round at which every worker of the job had left (the last to leave posted it), or None."""
        with self.stores.lease() as store:
            return int(store.get(self._ended_key)) if store.check([self._ended_key]) else None

    def close(self) -> None:
        self._source = None
        super().close()
