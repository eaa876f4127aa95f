"""Pipeline stages of one replica on a :class:`~fgdiloco.mesh.ReplicaMesh` (``torch.distributed.pipelining``),
with activation codecs at the stage boundaries (:mod:`fgdiloco.pipeline.codec`; the subspace codec of Subspace
Networks, Ramasinghe et al., arXiv 2506.01260, in :mod:`fgdiloco.pipeline.subspace`)."""

from .codec import ActivationCodec
from .schedule import SCHEDULES, Pipeline, PipelineError, PipelineStats
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
