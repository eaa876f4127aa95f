"""The wire frame every gossip payload travels in.

Layout (little endian)::

    offset size field
    0      4    magic  b"FGDL"
    4      1    version (currently 1)
    5      1    codec id (see :func:`fgdiloco.factor.codec.register_codec`)
    6      1    flags: bit 0 = body zstd-compressed, bit 1 = body byte-plane shuffled before compression,
                bit 2 = authenticated (a 32-byte tag follows the payload)
    7      1    shuffle element size in bytes (0 when not shuffled)
    8      4    sender rank
    12     8    round (the gossip schedule index the payload belongs to)
    20     8    layout fingerprint (:func:`layout_fingerprint`)
    28     8    raw body length in bytes (after decompression)
    36     8    payload length in bytes (as sent)
    44     4    CRC-32 of bytes 0..43 and of the payload
    48     ...  payload
    48+n   32   (authenticated frames only) HMAC-SHA256 under the job secret of bytes 0..47 and of the payload

**Who may take part.** When the job has a secret (:func:`job_secret`: the environment variable
``FGDILOCO_SECRET``, or a file named by ``FGDILOCO_SECRET_FILE``), every frame carries an HMAC-SHA256 tag
(standard library ``hmac``) over its header and payload, and :func:`decode_frame` rejects, with :class:`FrameError`
like a corrupt frame, a frame without a tag, with a wrong one (the sender does not hold the secret), and an
authenticated frame when this worker has no secret. The tag covers sender, gossip round and layout fingerprint,
so a recorded frame cannot be replayed into another exchange.

A frame that is truncated, altered, foreign (magic, version, codec, layout) or that decodes to NaN/Inf raises
:class:`FrameError`; a frame never decodes to wrong tensors silently. The CRC catches accidents; forged frames
with a valid CRC are bounded too: the announced body length must fit the codec's ``max_body_bytes`` for the
expected layout before anything is decompressed, and the zstd stream must be exactly one frame announcing that
length (so a zstd bomb costs at most the expected body size).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import zstandard

from .codec import Codec, CodecError, _all_finite

__all__ = ["FrameError", "encode_frame", "decode_frame", "layout_fingerprint", "job_secret", "HEADER_SIZE",
           "TAG_SIZE"]

MAGIC = b"FGDL"
VERSION = 1
_HEADER = struct.Struct("<4sBBBBIQ8sQQ")
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size + _CRC.size  # 48 bytes
FLAG_ZSTD = 1
FLAG_SHUFFLE = 2
FLAG_MAC = 4
TAG_SIZE = 32  # HMAC-SHA256
SECRET_ENV, SECRET_FILE_ENV = "FGDILOCO_SECRET", "FGDILOCO_SECRET_FILE"
ZSTD_LEVEL = 1  # measured: level 3 gains nothing on tensor bytes and is slower
# Largest raw body we will ever allocate for: guards against a forged length field.
MAX_BODY_BYTES = 1 << 36


_TLS = threading.local()


def _zstd() -> threading.local:
    """This thread's zstd (de)compressor: building one costs 30-40 us, and they are not thread-safe."""
    if not hasattr(_TLS, "compressor"):
        _TLS.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        _TLS.decompressor = zstandard.ZstdDecompressor()
    return _TLS


class FrameError(ValueError):
    """A received frame was rejected; the message says what is wrong with it."""


def job_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The job secret that authenticates frames, or None when none is configured.

    Read from ``FGDILOCO_SECRET`` (its UTF-8 bytes) or, when that is unset, from the file named by
    ``FGDILOCO_SECRET_FILE`` (its bytes, one trailing newline stripped). Every worker of a job must see the same.

    Raises:
        ValueError: both variables are set, the secret is empty, or the file cannot be read.
    """
    env = os.environ if environ is None else environ
    value, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
    if value is not None and path is not None:
        raise ValueError(f"set either {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read()
        except OSError as e:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {e}") from e
        secret = secret[:-1] if secret.endswith(b"\n") else secret
    elif value is not None:
        secret = value.encode()
    else:
        return None
    if not secret:
        raise ValueError(f"the job secret ({SECRET_ENV} or {SECRET_FILE_ENV}) must not be empty")
    return secret


def _tag(secret: bytes, head: bytes, payload: bytes) -> bytes:
    mac = hmac.new(secret, head, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def layout_fingerprint(layout: Iterable[tuple[str, Sequence[int], torch.dtype | str]]) -> bytes:
    """8-byte fingerprint of a parameter layout: ``(name, shape, dtype)`` per parameter, in order.

    Two workers whose fingerprints differ hold different models and must never mix.
    """
    h = hashlib.blake2b(digest_size=8)
    for name, shape, dtype in layout:
        h.update(f"{name}|{tuple(int(s) for s in shape)}|{dtype};".encode())
    return h.digest()


def _shuffle(raw: bytes, itemsize: int) -> bytes:
    """Byte planes: byte k of every ``itemsize``-byte element, for k = 0 .. itemsize - 1, then the tail."""
    a = np.frombuffer(raw, dtype=np.uint8)
    n = len(a) // itemsize * itemsize
    out = np.empty(n, dtype=np.uint8)
    planes = out.reshape(itemsize, -1)
    for k in range(itemsize):  # one strided read per plane: a transposed copy with a short inner axis is 6x slower
        planes[k] = a[k:n:itemsize]
    return out.tobytes() + a[n:].tobytes()


def _unshuffle(raw: bytes, itemsize: int) -> bytes:
    """The inverse of :func:`_shuffle`."""
    a = np.frombuffer(raw, dtype=np.uint8)
    n = len(a) // itemsize * itemsize
    out = np.empty(n, dtype=np.uint8)
    planes = a[:n].reshape(itemsize, -1)
    for k in range(itemsize):
        out[k::itemsize] = planes[k]
    return out.tobytes() + a[n:].tobytes()


def encode_frame(
    codec: Codec,
    body: bytes,
    *,
    sender: int,
    round: int,
    fingerprint: bytes,
    compress: bool = True,
    shuffle: int = 0,
    secret: bytes | None = None,
) -> bytes:
    """Wrap a codec body into a checked wire frame.

    Args:
        codec: the codec that produced ``body`` (its ``codec_id`` goes into the header).
        body: codec bytes (see :meth:`fgdiloco.factor.codec.Codec.encode`).
        sender: the sender's rank in the gossip group.
        round: the gossip schedule index this payload belongs to.
        fingerprint: 8 bytes from :func:`layout_fingerprint`.
        compress: compress the body with zstandard level 1.
        shuffle: element size in bytes for a byte-plane shuffle before compression (0 = none); it lifts the
            zstd ratio of float data (measured: bf16 1.29x -> 1.46x).
        secret: the job secret (:func:`job_secret`): append an HMAC-SHA256 tag over header and payload.

    Returns:
        The frame: a 48-byte header followed by the payload (and the 32-byte tag with a secret).
    """
    if len(fingerprint) != 8:
        raise ValueError(f"fingerprint must be 8 bytes, got {len(fingerprint)}")
    if not 0 <= shuffle <= 255:
        raise ValueError(f"shuffle must be an element size in [0, 255] bytes, got {shuffle}")
    if not 0 <= sender < 1 << 32 or not 0 <= round < 1 << 64:
        raise ValueError(f"sender must be in [0, 2**32) and round in [0, 2**64), got {sender} and {round}")
    flags = FLAG_MAC if secret is not None else 0
    payload = body
    if shuffle:
        payload = _shuffle(payload, shuffle)
        flags |= FLAG_SHUFFLE
    if compress:
        payload = _zstd().compressor.compress(payload)
        flags |= FLAG_ZSTD
    head = _HEADER.pack(MAGIC, VERSION, codec.codec_id, flags, shuffle, sender, round, fingerprint,
                        len(body), len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    head += _CRC.pack(crc)
    if secret is None:
        return head + payload
    return head + payload + _tag(secret, head, payload)


def decode_frame(
    data: bytes,
    codec: Codec,
    like: Sequence[torch.Tensor],
    *,
    fingerprint: bytes,
    sender: int | None = None,
    round: int | None = None,
    secret: bytes | None = None,
) -> list[torch.Tensor]:
    """Check and decode a frame made by :func:`encode_frame`.

    Args:
        data: the received bytes.
        codec: the codec this worker expects (the frame's codec id must match).
        like: tensors giving the expected shapes, dtypes and device of the result.
        fingerprint: this worker's layout fingerprint; the frame's must match.
        sender, round: when given, the frame's sender rank and round must match them.
        secret: the job secret: the frame must carry a valid HMAC-SHA256 tag under it. Without a secret an
            authenticated frame is rejected too (the two workers are configured differently).

    Returns:
        The decoded tensors, all finite.

    Raises:
        FrameError: truncated or corrupted frame (length or CRC), wrong magic or version, another codec, another
            layout, unexpected sender or round, unknown flags, a body longer than ``codec.max_body_bytes(like)``
            (checked before decompressing), a zstd stream that is not exactly one frame of the announced size,
            an undecodable body, tensors of the wrong number or shapes, NaN/Inf in the decoded tensors, or a
            missing, wrong or unexpected authentication tag. Nothing else is raised for any input bytes.
    """
    try:
        data = memoryview(data).cast("B")
    except TypeError as e:
        raise FrameError(f"a frame must be bytes, got {type(data).__name__}") from e
    header, payload = _intact(data, secret)
    # From here on the frame is intact as sent: what remains rejects frames from another codec, model or build,
    # and forged ones (the CRC detects accidents, not intent).
    _check_origin(header, codec, fingerprint, sender, round)
    return _decode_body(header, payload, codec, like)


class _Header(NamedTuple):
    codec_id: int
    flags: int
    shuffle: int
    sender: int
    round: int
    fingerprint: bytes
    raw_len: int


def _intact(data: memoryview, secret: bytes | None) -> tuple[_Header, bytes]:
    """The header and payload of a frame that is whole, uncorrupted and authenticated as this worker requires."""
    if len(data) < HEADER_SIZE:
        raise FrameError(f"truncated frame: {len(data)} bytes, a header alone is {HEADER_SIZE}")
    head = bytes(data[: _HEADER.size])
    magic, version, codec_id, flags, shuffle, f_sender, f_round, f_fp, raw_len, payload_len = _HEADER.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"not an fgdiloco frame: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"frame version {version} is not supported (this build speaks version {VERSION})")
    tag_len = TAG_SIZE if flags & FLAG_MAC else 0
    if len(data) != HEADER_SIZE + payload_len + tag_len:
        raise FrameError(f"frame length {len(data)} does not match its header ({HEADER_SIZE} + {payload_len}"
                         + (f" + {TAG_SIZE}-byte tag)" if tag_len else ")"))
    (crc,) = _CRC.unpack(bytes(data[_HEADER.size : HEADER_SIZE]))
    payload = bytes(data[HEADER_SIZE : HEADER_SIZE + payload_len])
    if zlib.crc32(payload, zlib.crc32(head)) != crc:
        raise FrameError("frame checksum mismatch: the frame was corrupted in transit")
    if secret is not None and not tag_len:
        raise FrameError("frame carries no authentication tag: the sender does not use the job secret")
    if secret is None and tag_len:
        raise FrameError("frame is authenticated but this worker has no job secret (set FGDILOCO_SECRET or "
                         "FGDILOCO_SECRET_FILE on every worker)")
    if secret is not None and not hmac.compare_digest(
            _tag(secret, bytes(data[:HEADER_SIZE]), payload), bytes(data[HEADER_SIZE + payload_len:])):
        raise FrameError("frame authentication tag does not match: the sender does not hold the job secret")
    return _Header(codec_id, flags, shuffle, f_sender, f_round, f_fp, raw_len), payload


def _check_origin(h: _Header, codec: Codec, fingerprint: bytes, sender: int | None, round: int | None) -> None:
    """Reject a frame of another codec, model layout, sender or round, or with flags this build does not know."""
    if h.codec_id != codec.codec_id:
        raise FrameError(f"frame was encoded with codec id {h.codec_id}, this worker uses {codec.name} "
                         f"(id {codec.codec_id})")
    if h.fingerprint != fingerprint:
        raise FrameError(f"parameter layout fingerprint {h.fingerprint.hex()} does not match ours "
                         f"({fingerprint.hex()}): the peer trains a different model")
    if sender is not None and h.sender != sender:
        raise FrameError(f"frame claims sender rank {h.sender}, expected {sender}")
    if round is not None and h.round != round:
        raise FrameError(f"frame belongs to round {h.round}, expected {round}")
    if h.flags & ~(FLAG_ZSTD | FLAG_SHUFFLE | FLAG_MAC):
        raise FrameError(f"frame has unknown flags {h.flags:#04x}")
    if bool(h.flags & FLAG_SHUFFLE) != (h.shuffle != 0):
        raise FrameError(f"frame shuffle flag ({bool(h.flags & FLAG_SHUFFLE)}) and element size ({h.shuffle}) "
                         "disagree")
    if h.shuffle not in (0, codec.shuffle):  # another element size would reorder the body's bytes into other values
        raise FrameError(f"frame shuffles {h.shuffle}-byte elements; {codec.name} frames shuffle {codec.shuffle} "
                         "or none")


def _decode_body(h: _Header, payload: bytes, codec: Codec, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The body's tensors: size-checked before decompressing, then of the expected shapes and finite."""
    try:
        limit = min(int(codec.max_body_bytes(like)), MAX_BODY_BYTES)
    except Exception as e:  # noqa: BLE001 - a codec that cannot size this layout cannot decode it either
        raise FrameError(f"{codec.name} cannot size a body for this layout: {type(e).__name__}: {e}") from e
    if h.raw_len > limit:
        raise FrameError(f"frame announces a {h.raw_len}-byte body, over the {limit} bytes {codec.name} can make "
                         "for this layout")
    body = _decompress(payload, h.raw_len) if h.flags & FLAG_ZSTD else payload
    if len(body) != h.raw_len:
        raise FrameError(f"frame body is {len(body)} bytes, header says {h.raw_len}")
    if h.flags & FLAG_SHUFFLE:
        body = _unshuffle(body, h.shuffle)
    try:
        tensors = codec.decode(body, like)
    except CodecError as e:
        raise FrameError(f"frame body does not decode with {codec.name}: {e}") from e
    except Exception as e:  # noqa: BLE001 - never let a malformed body escape as anything but FrameError
        raise FrameError(f"frame body does not decode with {codec.name}: {type(e).__name__}: {e}") from e
    if len(tensors) != len(like):
        raise FrameError(f"frame decoded to {len(tensors)} tensors, expected {len(like)}")
    for i, (t, ref) in enumerate(zip(tensors, like)):
        if tuple(t.shape) != tuple(ref.shape):
            raise FrameError(f"frame tensor {i} decoded to shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if t.is_floating_point() and not _all_finite(t):
            raise FrameError(f"frame tensor {i} (shape {tuple(t.shape)}) holds NaN or Inf")
    return tensors


def _decompress(payload: bytes, raw_len: int) -> bytes:
    """Decompress one zstd frame of exactly ``raw_len`` bytes; anything else (a zstd bomb, a lying or missing
    content size, trailing data, a truncated stream) raises :class:`FrameError` without allocating more than
    ``raw_len`` bytes of output."""
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise FrameError(f"frame body is not a zstd frame: {e}") from e
    if size != raw_len:
        raise FrameError(f"zstd frame announces {size} bytes, the frame header {raw_len}")
    try:
        # the output buffer is the (checked) content size; zstd stops with an error if the stream would exceed it,
        # and allow_extra_data=False rejects anything after the frame
        return _zstd().decompressor.decompress(payload, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FrameError(f"frame body does not decompress: {e}") from e
