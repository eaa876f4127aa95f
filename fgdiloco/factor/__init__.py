"""Compression of gossip payloads (codecs, error feedback, checked wire frames: docs/gossip.md) and of activations
between pipeline stages (subspace codec: docs/pipelines.md)."""

from .codec import BF16, Codec, CodecError, Dense, codec_from_id, codec_names, register_codec, resolve_codec
from .frame import HEADER_SIZE, FrameError, decode_frame, encode_frame, job_secret, layout_fingerprint
from .lowrank import LowRank
from .quantize import Int8, dequantize_int8, quantize_int8
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
    "BF16",
    "BoundaryIn",
    "BoundaryOut",
    "Codec",
    "CodecError",
    "Dense",
    "FrameError",
    "HEADER_SIZE",
    "Int8",
    "LowRank",
    "SubspaceActivationCodec",
    "SubspaceBasis",
    "SubspaceCodec",
    "SubspaceError",
    "codec_from_id",
    "codec_names",
    "decode_frame",
    "dequantize_int8",
    "encode_frame",
    "fixed_embedding",
    "job_secret",
    "layout_fingerprint",
    "orthonormal_basis",
    "quantize_int8",
    "register_codec",
    "resolve_codec",
]
