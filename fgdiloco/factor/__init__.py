"""Compression of gossip payloads: codecs, error feedback and checked wire frames (DESIGN §3)."""

from .codec import BF16, Codec, CodecError, Dense, codec_from_id, register_codec, resolve_codec
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
    "decode_frame",
    "dequantize_int8",
    "encode_frame",
    "job_secret",
    "layout_fingerprint",
    "quantize_int8",
    "register_codec",
    "resolve_codec",
]
