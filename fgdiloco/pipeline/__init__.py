"""Pipeline stages of one replica on a :class:`~fgdiloco.mesh.ReplicaMesh` (``torch.distributed.pipelining``),
with activation codecs at the stage boundaries."""

from .codec import ActivationCodec
from .schedule import SCHEDULES, Pipeline, PipelineError, PipelineStats

__all__ = ["SCHEDULES", "ActivationCodec", "Pipeline", "PipelineError", "PipelineStats"]
