"""The process group of one elastic pipeline replica: its stages, one ``torchrun`` job of ``stages`` processes.

torchrun restarts all of a job's processes when one dies, and hands every life the same store: its agent's
``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, with no prefix per restart. The process groups a life builds then meet
the addresses its dead predecessors published under the same keys, and Gloo's full-mesh connect fails ("Connection
refused") on a restart. :func:`init_replica_group` builds the default group on that store under a prefix of its own
for every life (``TORCHELASTIC_RESTART_COUNT``), so a restarted replica's stages meet each other and nothing else.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from ..config import FGDiLoCoConfig

__all__ = ["init_replica_group"]


def init_replica_group(backend: str = "gloo", timeout: float | None = None) -> None:
    """``torch.distributed.init_process_group`` for the stages of one elastic pipeline replica under torchrun.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (a GPU per stage).
        timeout: seconds the group's set-up and collectives may wait (None: the default ``stage_timeout`` of
            :class:`~fgdiloco.FGDiLoCoConfig`; give more than the run's ``stage_timeout``).

    Raises:
        ValueError: ``backend`` is not ``"gloo"`` or ``"nccl"``, or ``timeout`` is not positive.
        RuntimeError: not run by torchrun (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` or ``WORLD_SIZE`` missing), or
            a group is initialised already.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if timeout is None:
        timeout = FGDiLoCoConfig.stage_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_replica_group runs under torchrun: {', '.join(missing)} not set")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is initialised already")
    delta = datetime.timedelta(seconds=float(timeout))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=delta)
    life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"fgdiloco/life{life}", agent), rank=rank,
                            world_size=world, timeout=delta)
