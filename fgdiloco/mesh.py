"""``ReplicaMesh``: the workers as a grid of R replicas × S pipeline stages.

A model too big for one worker is split into S pipeline stages; each *replica* of the model is S ranks that pass
activations to each other every inner step (the *pipeline group*), and gossip runs only among the R ranks that hold
the same stage of different replicas (the *gossip group*). Global rank = ``replica * stages + stage``, so a
replica's stages are neighbours in rank order (on a multi-GPU host they share a machine's fast links).

The groups are built once, by :func:`torch.distributed.device_mesh.init_device_mesh` with dims
``("replica", "stage")``: every rank creates every group, in the same order. Groups must never be created per stage
(each stage calling ``new_group`` for its own ranks only): ``new_group`` is collective over the whole default group,
and Gloo then fails to connect ("connectFullMesh ... Connection refused", measured in 2 of 4 runs on 2 × 2 ranks).

Fault model: a Gloo timeout closes every connection of the rank in the group it happens in, and a dead peer makes
the group's pending operations fail at once. A replica whose stage died or hung is therefore broken as a whole (its
other stages raise, see :class:`fgdiloco.pipeline.PipelineError`), while other replicas keep training: gossip does not
run on these groups' point-to-point paths but on private pair groups (:mod:`fgdiloco.gossip.transport`); the gossip
group serves only the exact (all-reduce) topology's collectives and the wrapper's start-up broadcasts.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import FGDiLoCoConfig, Seconds
from .gossip.staging import pipeline_backend

__all__ = ["ReplicaMesh"]


def _options(backend: str, timeout: datetime.timedelta) -> Any:
    opts = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    return opts


class ReplicaMesh:
    """R replicas × S pipeline stages over the default process group, built collectively once.

    Call it on every rank, after ``init_process_group`` (or under ``torchrun``) and before any other group is built
    for training. Rank ``g`` holds stage ``g % stages`` of replica ``g // stages``.

    Args:
        replicas: R, the number of model replicas (int >= 1); gossip mixes the R copies of each stage.
        stages: S, pipeline stages per replica (int >= 1).
        process_group: the group the mesh covers; ``None`` (default) or a group holding every rank of the default
            group. A mesh over part of the job is not supported: the device mesh builds its groups with
            ``new_group``, which every rank of the default group must call.
        stage_timeout: seconds (> 0) any operation on the mesh's groups may take before it fails: the deadline of
            every stage-to-stage transfer of a pipeline (a hung stage makes its neighbours fail after this long; a
            dead one at once) and of the gossip group's collectives (default
            :attr:`FGDiLoCoConfig.stage_timeout <fgdiloco.FGDiLoCoConfig>`). ``timeout`` is its older name.

    Attributes:
        replica, stage: this rank's coordinates.
        replicas, stages: the grid's shape.
        device_mesh: the underlying :class:`~torch.distributed.device_mesh.DeviceMesh` (dims ``"replica"``,
            ``"stage"``).
        pipeline_group: this replica's S ranks in stage order, on :attr:`pipeline_backend`.
        pipeline_backend: ``"nccl"`` on an NCCL job whose host has a GPU per local rank
            (:func:`fgdiloco.gossip.staging.pipeline_backend`), else ``"gloo"`` (CUDA stages then stage their
            activations through the host).
        gossip_group: this stage's R ranks in replica order, always a Gloo group, so CPU tensors work on it even
            when the default backend is NCCL.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: ``replicas``/``stages`` not ints, ``stage_timeout`` not a number, ``process_group`` not a group.
        ValueError: ``replicas``/``stages`` < 1, ``replicas * stages`` not the world size, ``stage_timeout`` <= 0, or a
            ``process_group`` that does not span the default group. Arguments are checked before any group is
            built.
    """

    def __init__(self, replicas: int, stages: int, process_group: dist.ProcessGroup | None = None, *,
                 stage_timeout: float | None = None, timeout: float | None = None):
        for name, value in (("replicas", replicas), ("stages", stages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value}")
        if stage_timeout is not None and timeout is not None:
            raise ValueError("give stage_timeout or its older name timeout, not both")
        name = "timeout" if timeout is not None else "stage_timeout"
        given = timeout if timeout is not None else stage_timeout
        seconds = FGDiLoCoConfig.stage_timeout if given is None else Seconds()(name, given)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group (or use torchrun) "
                               "before building a ReplicaMesh")
        world = dist.get_world_size()
        if process_group is not None:
            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                                f"{type(process_group).__name__}")
            if dist.get_process_group_ranks(process_group) != list(range(world)):
                raise ValueError("process_group must hold every rank of the default group in order (a mesh over "
                                 "part of the job is not supported); pass None for the default group")
        if replicas * stages != world:
            raise ValueError(f"replicas * stages must equal the world size {world}, got replicas={replicas} x "
                             f"stages={stages} = {replicas * stages}")
        self.replicas = replicas
        self.stages = stages
        self.timeout = float(seconds)
        backend = dist.get_backend()
        self.device_type = "cuda" if "nccl" in backend else "cpu"
        gpus = torch.cuda.device_count() if self.device_type == "cuda" else 0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's ranks on this host
        self.pipeline_backend = pipe_backend = pipeline_backend(backend, gpus=gpus, ranks_on_host=local)
        delta = datetime.timedelta(seconds=self.timeout)
        # Both dims are built here, "replica" groups first, then "stage" groups, on every rank alike.
        self.device_mesh: DeviceMesh = init_device_mesh(
            self.device_type, (replicas, stages), mesh_dim_names=("replica", "stage"),
            backend_override={"replica": ("gloo", _options("gloo", delta)),
                              "stage": (pipe_backend, _options(pipe_backend, delta))})
        self.replica, self.stage = self.device_mesh.get_coordinate()
        self.rank = dist.get_rank()
        self.pipeline_group: dist.ProcessGroup = self.device_mesh["stage"].get_group()
        self.gossip_group: dist.ProcessGroup = self.device_mesh["replica"].get_group()

    def rank_of(self, replica: int, stage: int) -> int:
        """Global rank of ``stage`` of ``replica``: ``replica * stages + stage``."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica must be in [0, {self.replicas}), got {replica}")
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage must be in [0, {self.stages}), got {stage}")
        return replica * self.stages + stage

    def stage_ranks(self, replica: int | None = None) -> list[int]:
        """Global ranks of the stages of ``replica`` (default: this rank's), in stage order: its pipeline group."""
        replica = self.replica if replica is None else replica
        return [self.rank_of(replica, s) for s in range(self.stages)]

    def replica_ranks(self, stage: int | None = None) -> list[int]:
        """Global ranks holding ``stage`` (default: this rank's) in every replica, in replica order: its gossip
        group."""
        stage = self.stage if stage is None else stage
        return [self.rank_of(r, stage) for r in range(self.replicas)]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def __repr__(self) -> str:
        return (f"ReplicaMesh(replicas={self.replicas}, stages={self.stages}, rank={self.rank}: "
                f"replica={self.replica}, stage={self.stage})")
