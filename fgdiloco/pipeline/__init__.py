"""Pipeline stages of one replica on a :class:`~fgdiloco.mesh.ReplicaMesh` (``torch.distributed.pipelining``),
with activation codecs at the stage boundaries (:mod:`fgdiloco.pipeline.codec`; the subspace codec of Subspace
Networks, Ramasinghe et al., arXiv 2506.01260, in :mod:`fgdiloco.pipeline.subspace`).

The schedule (:class:`Pipeline` and its errors and stats) is imported on first use: ``torch.distributed.pipelining``
brings in ``torch._dynamo`` (about 2 CPU-seconds per process), which a model that only uses the codecs, or a worker
without stages, should not pay at every start or restart."""

from typing import Any

from .codec import ActivationCodec
from .subspace import (
    BoundaryIn,
    BoundaryOut,
    SubspaceActivationCodec,
    SubspaceBasis,
    SubspaceCodec,
    SubspaceError,
    fixed_embedding,
    orthonormal_basis,
)

__all__ = [
    "SCHEDULES",
    "ActivationCodec",
    "BoundaryIn",
    "BoundaryOut",
    "Pipeline",
    "PipelineError",
    "PipelineStats",
    "SubspaceActivationCodec",
    "SubspaceBasis",
    "SubspaceCodec",
    "SubspaceError",
    "fixed_embedding",
    "orthonormal_basis",
]

_SCHEDULE = frozenset({"SCHEDULES", "Pipeline", "PipelineError", "PipelineStats"})


def __getattr__(name: str) -> Any:
    if name in _SCHEDULE:
        from . import schedule

        return getattr(schedule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
