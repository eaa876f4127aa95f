"""The codec interface every compressor of a gossip payload implements.

A codec turns a list of tensors (one per model parameter, any shapes) into a *body*: codec-specific bytes that
:func:`fgdiloco.factor.frame.encode_frame` wraps in a checked, versioned, zstd-compressed wire frame. Decoding takes
the body and the list of tensors it stands for (``like``: shapes, dtypes and device of the result).

Mixing needs one more thing from a codec: what the *receiver* will reconstruct from the sender's own message. Both
:meth:`Codec.encode` results are returned together so the sender mixes with exactly the value its peer sees, which
keeps pairwise gossip sum-preserving even with a lossy codec (see :mod:`fgdiloco.gossip.mix`).

Stateful codecs (error feedback, warm-started factors) keep per-tensor state between rounds. That state changes only
on ``encode(..., stateful=True)`` or when the ``commit`` of :meth:`Codec.encode_staged` / a pair session is called
(the mixer calls it only once the exchange succeeded on both sides), and is saved by :meth:`Codec.state_dict` as
part of ``FGDiLoCo.state_dict()``.

Pairwise gossip rounds run a codec's *pair session* (:meth:`Codec.pair_session`): a short conversation of one or
more messages with the peer that ends in the correction ``c_i`` this worker adds to its value (its peer adds
``c_j = −c_i``, bit for bit, so the pair's sum is preserved). A pairwise round must be *consensus-safe*
(docs/gossip.md, consensus safety): the disagreement ``‖(I−J)X‖_F`` after the round is at most
``sqrt(‖(I−J)X‖_F² + Σ_i floor_i²)``, where ``floor_i = ‖q(x_i) − x_i‖_F`` is worker i's own quantisation error in
that round (reported as :attr:`PairOutcome.floor`; 0 for lossless number formats, up to float rounding). The
default session (one message: ``q(x_i)``, correction ``½(q(x_j) − q(x_i))``) has that property for every
*stateless* value codec (dense, bf16, int8); :class:`~fgdiloco.factor.lowrank.LowRank` overrides it with a
projection onto a basis both peers share.
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = ["Codec", "Dense", "BF16", "CodecError", "Message", "PairOutcome", "PairSession", "register_codec",
           "codec_from_id", "codec_names", "resolve_codec"]


class CodecError(ValueError):
    """A body cannot be decoded into the expected tensors (wrong length, wrong shape, bad content)."""


_REGISTRY: dict[int, type[Codec]] = {}


@dataclass
class Message:
    """One message of a pair session: what this worker sends, and how to decode what the peer sends back.

    Attributes:
        body: the codec body to send (wrapped in a checked frame by the mixer).
        codec: the codec whose ``codec_id``, ``max_body_bytes`` and ``decode`` frame and check this message (the
            session's codec itself, or a helper for a message of another layout).
        like: tensors giving the shapes, dtypes and device of the peer's message once decoded.
    """

    body: bytes
    codec: Codec
    like: Sequence[torch.Tensor]


@dataclass
class PairOutcome:
    """The end of a pair session on one worker.

    Attributes:
        correction: one fp32 tensor per value: this worker's new value is ``x_i + correction`` (the peer's
            correction is the exact negation of this one).
        distance_sq: per value tensor, ``‖q(x_i) − q(x_j)‖²`` (the disagreement as transmitted; equal inputs give 0).
        floor: ``‖q(x_i) − x_i‖_F`` over all tensors: this worker's own quantisation error in the round, the term
            the consensus-safety bound allows on top of the previous disagreement.
        commit: applies the codec state change of this round (warm starts); called only when both sides accepted
            the exchange.
    """

    correction: list[torch.Tensor]
    distance_sq: list[float]
    floor: float = 0.0
    commit: Callable[[], None] = field(default=lambda: None)


#: A pair session: yields the :class:`Message` to send and receives the peer's decoded tensors in reply
#: (``reply = yield message``), until it returns the :class:`PairOutcome`. ``lower`` (an argument of
#: :meth:`Codec.pair_session`) is True on the peer with the lower rank, so both sides can order shared computations
#: the same way.
PairSession = Generator[Message, list[torch.Tensor], PairOutcome]


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` known by its ``codec_id`` (stored in every frame header)."""
    if cls.codec_id in _REGISTRY and _REGISTRY[cls.codec_id] is not cls:
        raise ValueError(f"codec_id {cls.codec_id} already used by {_REGISTRY[cls.codec_id].__name__}")
    _REGISTRY[cls.codec_id] = cls
    return cls


def codec_from_id(codec_id: int) -> type[Codec]:
    """The codec class for a frame's codec id; raises ``KeyError`` for an unknown id."""
    return _REGISTRY[codec_id]


class Codec(abc.ABC):
    """Compresses a list of tensors into bytes and back.

    Subclasses set ``codec_id`` (unique, 1-255, written into each frame header) and ``name``.
    ``lossless`` is True when ``decode(encode(x)) == x`` bit for bit. ``shuffle`` is the element size in bytes
    of a byte-plane shuffle that :func:`~fgdiloco.factor.frame.encode_frame` should apply before zstd (0: none);
    it pays for bodies made of one float type (measured zstd ratios: fp32 1.08x -> 1.19x, bf16 1.29x -> 1.46x) on links
    slower than a few hundred Mbit/s, and a codec may set it per instance.
    """

    codec_id: ClassVar[int]
    name: ClassVar[str]
    lossless: ClassVar[bool] = False
    #: True when encoding reads or updates per-worker state (error feedback, warm starts). A stateful codec is not
    #: allowed in Mix1 (parameters); in pairwise rounds it must override :meth:`pair_session` with a
    #: consensus-safe protocol.
    stateful: ClassVar[bool] = False
    shuffle: int = 0

    @abc.abstractmethod
    def encode(self, tensors: Sequence[torch.Tensor], *, stateful: bool = True) -> tuple[bytes, list[torch.Tensor]]:
        """Encode ``tensors``.

        Args:
            tensors: one tensor per parameter, any shapes; not modified.
            stateful: when True the codec may read and update its per-tensor state (error feedback residual,
                warm-start factors). When False the state is read-only (used for the second and later gossip
                rounds of one mix, whose inputs are already mixed values).

        Returns:
            ``(body, decoded)``: the body bytes, and the tensors the receiver will decode from them (same shapes
            and dtypes as ``tensors``, on their devices).
        """

    @abc.abstractmethod
    def decode(self, body: bytes, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Decode a body made by :meth:`encode` on a peer into tensors shaped like ``like``.

        Raises:
            CodecError: the body does not fit ``like`` (wrong length or layout).
        """

    def encode_staged(self, tensors: Sequence[torch.Tensor]) -> tuple[bytes, list[torch.Tensor], Callable[[], None]]:
        """Encode like ``encode(tensors, stateful=True)`` but leave the codec's state unchanged until the returned
        ``commit()`` is called (the exact-average path calls it only when the collective succeeded).

        Returns ``(body, decoded, commit)``. Stateless codecs return a no-op ``commit``; stateful codecs override it.
        """
        body, decoded = self.encode(tensors, stateful=False)
        return body, decoded, lambda: None

    def pair_session(self, values: Sequence[torch.Tensor], *, lower: bool, peer: int | None = None) -> PairSession:
        """The pairwise gossip round of a stateless value codec: send ``q(x_i)``, receive ``q(x_j)``, correct by
        ``½(q(x_j) − q(x_i))`` (difference form; the pair's sum is preserved and the pair's disagreement becomes
        ``q``'s own error, see the module docstring). ``values`` are fp32 and not modified; ``lower``: this worker
        has the lower rank of the pair; ``peer``: the peer's rank (a codec with per-peer state keys it by this).

        Raises:
            ValueError: the codec is stateful and does not provide its own consensus-safe session.
        """
        if self.stateful:
            raise ValueError(f"{type(self).__name__} keeps per-worker state and defines no consensus-safe pair "
                             "session; it can only be used with topology='allreduce'")
        body, own = self.encode(values, stateful=False)
        peer = yield Message(body, self, values)
        correction, dist_sq, floor_sq = [], [], 0.0
        for x, a, b in zip(values, own, peer):
            a32, b32 = a.to(torch.float32), b.to(device=a.device, dtype=torch.float32)
            diff = b32 - a32
            correction.append(0.5 * diff)
            dist_sq.append(sq_norm(diff))
            floor_sq += sq_norm(a32 - x.to(a32.device))  # exact in fp32: q(x) and x are within a factor 2
        return PairOutcome(correction, dist_sq, math.sqrt(floor_sq))

    def max_body_bytes(self, like: Sequence[torch.Tensor]) -> int:
        """Upper bound, in bytes, of a body this codec makes for tensors shaped like ``like``.

        :func:`~fgdiloco.factor.frame.decode_frame` rejects a frame announcing a longer body before it
        decompresses anything (a forged length or a zstd bomb). The default allows 8 bytes per element plus
        256 bytes per tensor and 4 KiB; codecs with a known size override it with the exact size.
        """
        return 8 * _numel(like) + 256 * len(like) + 4096

    def state_dict(self) -> dict[str, Any]:
        """Per-tensor state to checkpoint (empty for stateless codecs)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an empty dict resets the state (``FGDiLoCo`` copies a codec instance it is
        given and resets the copy this way, so a stateful codec must honour it)."""
        return None

    def config(self) -> dict[str, Any]:
        """Constructor arguments, for logs and summaries."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or ±Inf in ``t``. ``aminmax`` propagates NaN (documented) and is ~10x faster on CPU than
    ``isfinite(t).all()``, which allocates a mask."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def sq_norm(t: torch.Tensor) -> float:
    """``‖t‖²`` as a float: one BLAS dot in fp32 (relative error about 1e-7 at a million elements), with no
    temporary for fp32 input. The disagreement diagnostics and scale checks of every exchange summed float64
    copies (two 8-byte temporaries per element), memory traffic that slowed the inner steps running beside them."""
    f = t.detach().reshape(-1)
    if f.dtype != torch.float32:
        f = f.float()
    return float(torch.dot(f, f))


def _numel(like: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in like)


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[off : off + n].view(t.shape).to(device=t.device, dtype=t.dtype))
        off += n
    return out


def _flat_cpu(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=dtype) for t in tensors])


@register_codec
class Dense(Codec):
    """Lossless fp32: 4 bytes per element. The reference every compression ratio is measured against.

    Body: the tensors' elements, flattened and concatenated in order, as little-endian fp32 (``4·numel`` bytes).
    Frames shuffle its byte planes (``shuffle = 4``) before zstd.
    """

    codec_id = 1
    name = "dense"
    lossless = True
    shuffle = 4

    def max_body_bytes(self, like):
        return 4 * _numel(like)

    def encode(self, tensors, *, stateful=True):
        flat = _flat_cpu(tensors, torch.float32)
        return flat.numpy().tobytes(), [t.detach().clone() for t in tensors]

    def decode(self, body, like):
        n = _numel(like)
        if len(body) != 4 * n:
            raise CodecError(f"dense body has {len(body)} bytes, expected {4 * n} for {n} fp32 elements")
        flat = torch.from_numpy(np.frombuffer(body, dtype=np.float32).copy())
        return _split(flat, like)


@register_codec
class BF16(Codec):
    """bfloat16: 2 bytes per element, relative error at most 2**-8 per element (round to nearest even).

    Error bound: ``|x − x̂| ≤ 2⁻⁸·|x|`` for every element whose magnitude lies in bf16's normal range
    (about 1.2e-38 to 3.4e38); values above it become ±Inf (and are rejected by the frame's finiteness check).

    The default codec of Mix1 (parameters): parameters need range more than precision, and mixing uses the
    difference form ``θ_i + ½(q(θ_j) − q(θ_i))``, so the rounding only touches the *difference* between two
    replicas, never a replica's own parameters, and the pair's sum is preserved exactly.

    Body: the tensors' elements as little-endian bf16 (``2·numel`` bytes). Frames shuffle its byte planes
    (``shuffle = 2``) before zstd.
    """

    codec_id = 2
    name = "bf16"
    shuffle = 2

    def max_body_bytes(self, like):
        return 2 * _numel(like)

    def encode(self, tensors, *, stateful=True):
        flat = _flat_cpu(tensors, torch.float32).to(torch.bfloat16)
        body = flat.view(torch.int16).numpy().tobytes()
        return body, _split(flat.to(torch.float32), tensors)

    def decode(self, body, like):
        n = _numel(like)
        if len(body) != 2 * n:
            raise CodecError(f"bf16 body has {len(body)} bytes, expected {2 * n} for {n} bf16 elements")
        raw = torch.from_numpy(np.frombuffer(body, dtype=np.int16).copy())
        return _split(raw.view(torch.bfloat16).to(torch.float32), like)


def codec_names() -> list[str]:
    """The names of the registered codecs (:func:`register_codec`), sorted: what a codec setting accepts."""
    return sorted(cls.name for cls in _REGISTRY.values())


def resolve_codec(codec: Codec | str | None, *, default: str, argument: str, rank: int | None = None) -> Codec:
    """Turn ``None``, a codec name or a :class:`Codec` instance into a codec instance. ``rank``: the rank of a
    codec built by name that takes one (``"lowrank"``); None: its own default.

    Raises:
        TypeError: ``codec`` is neither None, a string nor a Codec.
        ValueError: unknown codec name (the message lists the known ones); ``rank`` given with a Codec instance
            or with the name of a codec that takes no rank.
    """
    if codec is None:
        codec = default
    if isinstance(codec, Codec):
        if rank is not None:
            raise ValueError(f"codec_rank={rank} applies to a codec given by name; {argument}={codec!r} is an "
                             "instance: give it its rank instead")
        return codec
    if isinstance(codec, str):
        by_name = {cls.name: cls for cls in _REGISTRY.values()}
        if codec.lower() not in by_name:
            raise ValueError(f"{argument}={codec!r} is not a known codec; use one of {sorted(by_name)} "
                             "or a fgdiloco.factor.Codec instance")
        cls = by_name[codec.lower()]
        if rank is None:
            return cls()
        if "rank" not in inspect.signature(cls).parameters:
            ranked = sorted(c.name for c in _REGISTRY.values() if "rank" in inspect.signature(c).parameters)
            raise ValueError(f"codec_rank={rank} applies to a codec that takes a rank ({', '.join(ranked)}); "
                             f"{argument}={codec!r} has none")
        return cls(rank=rank)
    raise TypeError(f"{argument} must be None, a codec name or a fgdiloco.factor.Codec, got {type(codec).__name__}")
