"""Compression of gossip payloads: codecs, error feedback and checked wire frames (DESIGN §3)."""

from .codec import BF16, Codec, CodecError, Dense, codec_from_id, register_codec, resolve_codec
from .frame import HEADER_SIZE, FrameError, decode_frame, encode_frame, layout_fingerprint

__all__ = [
    "BF16",
    "Codec",
    "CodecError",
    "Dense",
    "FrameError",
    "HEADER_SIZE",
    "codec_from_id",
    "decode_frame",
    "encode_frame",
    "layout_fingerprint",
    "register_codec",
    "resolve_codec",
]
