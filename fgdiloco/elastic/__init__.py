"""Elastic jobs: workers that die, hang, come back and join without stopping anyone.

torchelastic (``torchrun``) restarts or fails its workers as one group: when one local worker dies, the agent stops
the others. Gossip needs no group, so in an elastic job **each worker is its own torchrun job** (with
``--max-restarts``), and the workers meet on a **gossip store that no worker hosts**: a ``TCPStore`` served by
``fgdiloco store`` (or by ``fgdiloco launch``, which starts the workers too). torchft does the same for DiLoCo (one
torchrun job per replica group and a Lighthouse); fgdiloco needs no quorum, only membership on the store:

* **slots**: the job has ``FGDILOCO_WORKERS`` worker slots; worker ``FGDILOCO_WORKER`` takes one. The gossip schedule
  is the same random matching over the slots on every worker (:class:`~fgdiloco.gossip.Topology`), so it stays
  doubly stochastic over whoever is live: a worker whose partner slot is empty (never joined, or departed with a
  notice) skips that gossip round at once; a partner that died costs one liveness timeout (2 s) and then back-off,
  and one that fell rounds behind the job (it hung) is skipped at once until it catches up.
* **incarnations**: each process that takes a slot is a new incarnation (a counter in the store). Exchange keys name
  both sides' incarnations, so a restarted worker never meets what its dead predecessor left behind, and its peers
  reset their back-off for it as soon as they see the new incarnation.
* **the live round**: every worker publishes the outer round it starts. A restarted worker (from its own checkpoint,
  or fresh) or one that hung and came back joins the job at the newest round a peer has started
  (:meth:`fgdiloco.FGDiLoCo.rejoin`), and is mixed with again at once.

A worker's script needs one change: ``FGDiLoCo(..., elastic=True)`` (settings come from the environment the
launcher sets). Launch on one machine::

    fgdiloco launch --workers 4 --max-restarts 3 train.py --my-args

or by hand, on several machines::

    fgdiloco store --port 29400                                   # on one machine (no worker)
    FGDILOCO_STORE=host:29400 FGDILOCO_WORKERS=8 FGDILOCO_WORKER=k torchrun --standalone --nproc-per-node 1 \\
        --max-restarts 3 train.py                                 # once per worker k = 0..7, anywhere
"""

from .launch import (
    JOB_ENV,
    LIVES_ENV,
    MIN_WORKERS_ENV,
    RESUME_ENV,
    STORE_ENV,
    WORKER_ENV,
    WORKERS_ENV,
    AdmissionError,
    connect,
    launch,
    settings,
    torchrun_command,
)
from .membership import ElasticMembership, SlotTaken, StoreNotReached, StoreUnreachable
from .rejoin import CATCH_UP_ROUNDS
from .replica import init_replica_group
from .store import GossipStore, SupervisedStore

__all__ = ["AdmissionError", "CATCH_UP_ROUNDS", "JOB_ENV", "LIVES_ENV", "MIN_WORKERS_ENV", "RESUME_ENV", "STORE_ENV",
           "WORKER_ENV", "WORKERS_ENV", "ElasticMembership", "GossipStore", "SlotTaken", "StoreNotReached",
           "StoreUnreachable", "SupervisedStore", "connect", "init_replica_group", "launch", "settings",
           "torchrun_command"]
