"""Compression of gossip payloads: codecs (dense, bf16, int8, low-rank), error feedback and checked wire frames.

The subspace activation codec (compression of the activations between pipeline stages) lives with the pipeline, in
:mod:`fgdiloco.pipeline.subspace`. Its names are still importable from here for old code (``from fgdiloco.factor
import SubspaceCodec``), with a ``DeprecationWarning`` naming the new place; this package never imports
:mod:`fgdiloco.pipeline` itself (the pipeline may import the gossip codecs, not the other way round).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .codec import BF16, Codec, CodecError, Dense, codec_from_id, codec_names, register_codec, resolve_codec
from .frame import HEADER_SIZE, FrameError, decode_frame, encode_frame, job_secret, layout_fingerprint
from .lowrank import LowRank
from .quantize import Int8, dequantize_int8, quantize_int8

__all__ = [
    "BF16",
    "Codec",
    "CodecError",
    "Dense",
    "FrameError",
    "HEADER_SIZE",
    "Int8",
    "LowRank",
    "codec_from_id",
    "codec_names",
    "decode_frame",
    "dequantize_int8",
    "encode_frame",
    "job_secret",
    "layout_fingerprint",
    "quantize_int8",
    "register_codec",
    "resolve_codec",
]

# moved to fgdiloco.pipeline.subspace (activation codecs live with the pipeline); resolved lazily by __getattr__
_MOVED_TO_PIPELINE = frozenset({
    "BoundaryIn",
    "BoundaryOut",
    "Residual",
    "SubspaceActivationCodec",
    "SubspaceBasis",
    "SubspaceCodec",
    "SubspaceError",
    "WireBytes",
    "default_tolerance",
    "fixed_embedding",
    "orthonormal_basis",
    "orthonormalize",
})
_NEW_HOME = "fgdiloco.pipeline.subspace"


def __getattr__(name: str) -> Any:
    """``fgdiloco.factor.<name>`` for a name that moved to :mod:`fgdiloco.pipeline.subspace` (deprecated)."""
    if name in _MOVED_TO_PIPELINE:
        warnings.warn(f"fgdiloco.factor.{name} has moved to {_NEW_HOME}.{name}; import it from there "
                      f"(the old name will be removed)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_NEW_HOME), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _MOVED_TO_PIPELINE)
