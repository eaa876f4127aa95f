"""How a wrapper reaches its peers: the transport it is given, an elastic job's, or one over a process group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import FGDiLoCoConfig
from ..factor.frame import job_secret
from ..gossip.transport import DistributedTransport, Transport
from ..mesh import ReplicaMesh

__all__ = ["open_transport"]


def open_transport(config: FGDiLoCoConfig, model: nn.Module, *, transport: Transport | None, process_group: Any,
                   mesh: ReplicaMesh | None, elastic: bool, broadcast_init: bool, fingerprint: bytes,
                   exact: bool) -> Transport | None:
    """The wrapper's transport (None: a single worker, ``torch.distributed`` not initialised).

    * ``elastic``: :func:`fgdiloco.elastic.connect` (a pipeline stage gossips in its own job,
      ``<job>.stage<s>``, and watches its replica's other stages);
    * ``transport`` given: that one;
    * else a :class:`~fgdiloco.gossip.transport.DistributedTransport` over ``mesh.gossip_group``,
      ``process_group`` or the default group; with ``broadcast_init`` the model's parameters and buffers are then
      copied from the group's first rank (a collective).

    Raises:
        TypeError: ``broadcast_init`` is not a bool.
    """
    if not isinstance(broadcast_init, bool):
        raise TypeError(f"broadcast_init must be a bool, got {type(broadcast_init).__name__}")
    c = config
    if elastic:
        from ..elastic import connect, settings

        stage_jobs = [] if mesh is None else [f"{settings()['job']}.stage{s}" for s in range(mesh.stages)]
        job = None if mesh is None else stage_jobs[mesh.stage]  # each stage gossips apart ...
        return connect(job=job, timeout=c.join_timeout, liveness=c.liveness, store_timeout=c.store_timeout,
                       fingerprint=fingerprint, secret=job_secret(),
                       sibling_jobs=[j for j in stage_jobs if j != job])  # ... and watches its replica's others
    if transport is not None or not (process_group is not None or mesh is not None
                                     or (dist.is_available() and dist.is_initialized())):
        return transport
    deadlines = dict(join_timeout=c.join_timeout, collective_timeout=c.collective_timeout, liveness=c.liveness,
                     store_timeout=c.store_timeout, exact=exact)
    if mesh is not None:  # the mesh built the stage's group: no new_group here (collective over all)
        built = DistributedTransport(mesh.gossip_group, collective_group=mesh.gossip_group, **deadlines)
    else:
        built = DistributedTransport(process_group, **deadlines)
    if broadcast_init:
        src = built.global_ranks[0]
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=src, group=built.group)
    return built
