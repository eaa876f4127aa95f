"""Joining a running elastic job at its live round: after a restart, a hang, or as a new worker.

Called by :class:`~fgdiloco.elastic.ElasticMembership` before every outer round (:func:`before_round`) and by
``FGDiLoCo.rejoin`` (:func:`rejoin`), with the wrapper's :class:`~fgdiloco.outer.state.OuterState`:

* a worker that has not joined yet (a restart, a late joiner; the job's first workers joined at the start barrier,
  :meth:`~fgdiloco.elastic.ElasticMembership.mark_joined`) enters at the live round (the
  newest any slot started) when that is ahead of its own; without state of its own (``outer.fresh``: no checkpoint
  loaded), or with a checkpoint :data:`ADOPT_ROUNDS` or more rounds older than the live round (it restarted late, its
  peers trained on), it first adopts a live peer's round-start parameters and outer momentum (one checked, authenticated
  frame, answered by the first live peer to claim the request), so it does not pull its partners back to an older model;
  its own inner optimizer state and data position stay. A checkpoint a round or two old is kept: its rounds are not
  lost;
* a joined worker that finds itself :data:`CATCH_UP_ROUNDS` behind the peers' *median* round (it hung, or its peers
  went on without it) jumps to that round with a live peer's state (its own is ``CATCH_UP_ROUNDS`` >=
  :data:`ADOPT_ROUNDS` rounds old: mixed back in, it would pull its partners back; in the chaos job adopting took the
  held-out loss from 1.017x to 1.010x the clean run's). A stage of a pipeline replica keeps its own state here: each
  stage would adopt from whichever replica answers first, and stages of different replicas were not trained
  together (the pipeline chaos job ended 1.045-1.050x its clean loss so, 1.018x without). Its partners skip it at
  once meanwhile (:meth:`~fgdiloco.elastic.ElasticMembership.lagging`). The median counts only peers whose
  heartbeat moves (:meth:`~fgdiloco.elastic.ElasticMembership.front`), and the median, not the newest: a worker
  that lost a few seconds to a dead peer while two others went on is waited for, not moved;
* after the gossip store came back (``membership.resync``), when every worker trained on alone at its own pace, a
  worker behind the live round at all jumps there, so the workers meet again at once instead of the ahead ones
  waiting out their join deadline for the others.

Every jump is counted (``outer.rejoins``, ``RoundStats.rejoins``) and logged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ADOPT_ROUNDS", "CATCH_UP_ROUNDS", "before_round", "rejoin"]

log = logging.getLogger("fgdiloco")

#: A joined worker this many outer rounds behind the peers' median round jumps to the live round; a round or two
#: behind is normal (its peers wait for it at their next exchange with it, so the job pulls itself back into step).
CATCH_UP_ROUNDS = 3

#: A worker joining (a restart, a resume) whose own state is this many outer rounds older than the live round takes
#: a live peer's state instead: a replica restarted from a checkpoint 10-20 rounds old and mixed back in from there
#: cost the 2-replica pipeline job 2.2 % of held-out loss (its partner spent rounds pulling it forward).
ADOPT_ROUNDS = 3


def before_round(membership: Any, outer: Any, agree: Callable[[list[int]], list[int]] | None = None) -> None:
    """Before an outer round starts: stop when the store has been away too long, join (or catch up with) the live
    round, then publish the round and answer joiners from now on.

    ``agree``: the stages of one pipeline replica decide together (``[values] -> [their maxima]`` over the
    replica's stages, every stage calls it at every round start): they stop together, and they enter the same round,
    so their pipeline steps stay in step. Raises :class:`~fgdiloco.elastic.StoreUnreachable` to stop.
    """
    replica = bool(getattr(membership, "siblings", ()))  # a stage of a pipeline replica
    agree = agree or (lambda values: values)
    joined = getattr(membership, "_joined", False)
    stop = membership.too_long_away()
    target = -1 if stop or membership.unreachable else _catch_up_target(membership, outer, _behind(membership))
    stop_all, target = agree([int(stop), target])
    if stop_all:
        membership.check_reachable(force=True)
    if target >= 0:
        _enter(membership, outer, target, adopt=_stale(outer, target) and not (replica and joined))
    (final,) = agree([outer.round])
    if final > outer.round:  # another stage of this replica entered a later round (its donor was further on)
        outer.jump(final)
    if membership.unreachable:
        return
    membership.resync = False
    membership.serve(outer.committed_state)
    with contextlib.suppress(Exception):  # a store we cannot reach: peers see an older round
        membership.publish_round(outer.round)
    if not joined:
        _mark_joined(membership)


def rejoin(membership: Any, outer: Any, agree: Callable[[list[int]], list[int]] | None = None) -> None:
    """Join the live round now (``FGDiLoCo.rejoin``) when this worker has not joined yet, or when it has and is
    :data:`CATCH_UP_ROUNDS` behind the peers' median round (a first worker whose set-up ended rounds after its
    partners' is waited for, as at every round start): adopt a live peer's state first when ``outer`` has none or
    its own is :data:`ADOPT_ROUNDS` or more rounds old. ``agree``: as for :func:`before_round` (the stages of a
    pipeline replica end in the same round)."""
    live = _catch_up_target(membership, outer, _behind(membership))
    if live >= 0:
        _enter(membership, outer, live, adopt=_stale(outer, live))
    if agree is not None:
        (final,) = agree([outer.round])
        if final > outer.round:  # another stage of this pipeline replica entered a later round
            outer.jump(final)
    _mark_joined(membership)


def _behind(membership: Any) -> int:
    """How many rounds behind the others this worker enters the live round: any (1) before it has joined and after
    the store came back; :data:`CATCH_UP_ROUNDS` behind the median once joined."""
    return 1 if not getattr(membership, "_joined", False) or getattr(membership, "resync", False) else CATCH_UP_ROUNDS


def _mark_joined(membership: Any) -> None:
    """This process starts its rounds now: its peers stop skipping it (a store we cannot reach: the next round
    start tries again)."""
    try:
        membership.mark_joined()
    except Exception as err:  # noqa: BLE001 - retried at the next round start
        log.debug("fgdiloco: could not post that this worker joined: %s", err)
        membership._joined = False


def _stale(outer: Any, live: int) -> bool:
    """Should a joining worker take a live peer's state rather than enter round ``live`` with its own? Yes without
    state of its own, or when its own is :data:`ADOPT_ROUNDS` or more rounds older."""
    return outer.fresh or live - outer.round >= ADOPT_ROUNDS


def _target(membership: Any, behind: int) -> int | None:
    """The live round (``behind <= 1``), or the peers' median round (has this worker fallen behind?)."""
    if behind <= 1:
        return membership.live_round()
    return membership.front()


def _catch_up_target(membership: Any, outer: Any, behind: int) -> int:
    """The round to enter now, or -1 to stay."""
    try:
        live = _target(membership, behind)
    except Exception as err:  # noqa: BLE001 - a store we cannot reach: stay where we are
        log.debug("fgdiloco: could not read the peers' rounds: %s", err)
        return -1
    return -1 if live is None or live - outer.round < behind else live


def _enter(membership: Any, outer: Any, live: int, adopt: bool) -> None:
    """Enter round ``live``: with a live peer's state when ``adopt`` (and one comes), else with this worker's own."""
    if adopt and _adopt(membership, outer):
        return
    log.warning("fgdiloco rank %d: joining the job at outer round %d (this worker was at round %d, step %d of it)",
                outer.rank, live, outer.round, outer.steps_in_round)
    if _job_over(membership, outer.fresh):
        log.warning("fgdiloco rank %d: every other worker of this job has left the gossip store: the job ended at "
                    "outer round %d, and this worker joins it there, with nothing left to train. A new job on a "
                    "store that served an earlier one needs a name of its own (fgdiloco launch --job NAME, or "
                    "FGDILOCO_JOB)", outer.rank, live)
        from .life import note

        try:  # fgdiloco launch's last line names the worker (its lives file; nothing when not under the launcher)
            note({"event": "ended", "round": live, "time": time.time()})
        except OSError as err:
            log.debug("fgdiloco rank %d: could not note the late join: %s", outer.rank, err)
    outer.jump(live)


def _job_over(membership: Any, fresh: bool) -> bool:
    """Whether the job had ended: every other slot that ever held a worker has posted its departure notice, or, for a
    ``fresh`` worker (no state of its own), the job's last worker left and said so. The second holds when another
    new worker has already taken a slot of the ended job (it then counts as in the job: two workers of a second job
    under a finished job's name, started together, each saw the other there). A worker with a checkpoint does not
    look at it: after a stop and a ``--resume`` on the same store it continues the job. False when the store cannot
    tell."""
    try:
        if fresh and membership.ended() is not None:
            return True
        return bool(membership.slot_rounds(departed=True)) and not membership.peer_rounds()
    except Exception:  # noqa: BLE001 - a store we cannot reach, a membership without slots: say nothing
        return False


def _adopt(membership: Any, outer: Any) -> bool:
    """Take a live peer's state (False when none came within ``join_timeout`` or it was rejected: then the worker
    joins with its own)."""
    try:
        membership.request_state()
        payload = membership.await_state(outer.join_timeout)
    except Exception as err:  # noqa: BLE001 - a store we cannot reach: join with our own state
        log.warning("fgdiloco rank %d: could not ask for a peer's state (%s); joining with its own", outer.rank, err)
        return False
    if payload is None:
        log.warning("fgdiloco rank %d: no peer sent its state (within %.0f s, or none is left); joining with its "
                    "own", outer.rank, outer.join_timeout)
        return False
    was = outer.round
    taken = outer.adopt(payload)
    if taken is None:
        return False
    log.warning("fgdiloco rank %d: joined the job at outer round %d with a live peer's parameters and outer momentum "
                "(this worker was at round %d)", outer.rank, taken, was)
    return True
