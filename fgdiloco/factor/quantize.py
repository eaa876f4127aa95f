"""Int8 quantisation with one absmax scale per block, and the :class:`Int8` codec built on it.

The block functions work on a batch of rows ``x`` of shape ``(R, L)``: each row is cut into
``ceil(L / block)`` blocks of ``block`` consecutive elements (the last one shorter), and every block is sent as
int8 codes ``q = round(x / d)`` with one fp32 step ``d = absmax(block) / 127``; the receiver computes
``x̂ = q · d``. A block never spans two rows, so rows of very different magnitude (the factors of
:class:`~fgdiloco.factor.lowrank.LowRank`, one row per singular direction) each get their own scales.

Error bound (round to nearest, fp32 arithmetic, for blocks whose absmax is at least 1e-30)::

    |x − x̂| ≤ absmax(block) / 254 · (1 + 2⁻¹²)        for every element of the block

i.e. half a quantisation step. An all-zero block decodes to exact zeros; a block holding NaN or ±Inf decodes to
non-finite values, which :func:`~fgdiloco.factor.frame.decode_frame` rejects.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .codec import Codec, CodecError, _numel, register_codec

__all__ = ["Int8", "quantize_int8", "dequantize_int8", "int8_nbytes", "int8_nscales", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 256
_QMAX = 127.0


def _check_block(block: Any) -> int:
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"block must be an int (elements per int8 scale), got {type(block).__name__}")
    if not 1 <= block <= 1 << 20:
        raise ValueError(f"block must be in [1, 2**20] elements per int8 scale, got {block}")
    return block


def int8_nscales(rows: int, length: int, block: int) -> int:
    """Number of fp32 scales of ``rows`` rows of ``length`` elements: ``rows · ceil(length / block)``."""
    return rows * (-(-length // block))


def int8_nbytes(rows: int, length: int, block: int) -> int:
    """Bytes of int8 codes plus fp32 scales for ``rows`` rows of ``length`` elements."""
    return rows * length + 4 * int8_nscales(rows, length, block)


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows to int8 with one absmax scale per block.

    Args:
        x: float tensor of shape ``(R, L)`` (any device).
        block: elements per scale (>= 1).

    Returns:
        ``(q, d)``: int8 codes of shape ``(R, L)`` and fp32 steps of shape ``(R, ceil(L / block))``, on
        ``x``'s device. Decode with :func:`dequantize_int8`.
    """
    x = x.to(torch.float32)
    rows, length = x.shape
    nb = -(-length // block)
    pad = nb * block - length
    xb = (F.pad(x, (0, pad)) if pad else x).reshape(rows, nb, block)
    step = xb.abs().amax(dim=2) / _QMAX if length else x.new_zeros(rows, 0)
    # step > 0 is False for 0 and NaN: divide by 1 there (zeros stay zero, NaN blocks decode to NaN via d)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round(xb / safe.unsqueeze(2)).clamp_(-_QMAX, _QMAX).nan_to_num_(0.0).to(torch.int8)
    q = q.reshape(rows, nb * block)
    if pad:
        q = q[:, :length].contiguous()
    return q, step


def dequantize_int8(q: torch.Tensor, step: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``(R, L)`` int8 codes and ``(R, ceil(L / block))`` steps -> fp32
    ``(R, L)`` (contiguous). Deterministic: the same inputs give bit-identical outputs on every device."""
    rows, length = q.shape
    nb = step.shape[1]
    pad = nb * block - length
    qf = q.to(torch.float32)
    if pad:
        qf = F.pad(qf, (0, pad))
    out = (qf.reshape(rows, nb, block) * step.unsqueeze(2)).reshape(rows, nb * block)
    return out[:, :length].contiguous() if pad else out


_I8_HEADER = struct.Struct("<II")  # body format version, block
_I8_VERSION = 1


@register_codec
class Int8(Codec):
    """Int8 with one fp32 absmax scale per block of ``block`` elements of each tensor (stateless).

    Error bound, per element of each block (see :mod:`fgdiloco.factor.quantize`)::

        |x − x̂| ≤ absmax(block) / 254 · (1 + 2⁻¹²)

    Args:
        block: elements per scale (int in [1, 2**20]); each tensor is flattened and cut into blocks of this size,
            the last one shorter. Smaller blocks follow local magnitudes more closely and cost ``4 / block``
            extra bytes per element.

    Body (little endian): an 8-byte header (format version, ``block``), the fp32 steps of all tensors in order,
    then the int8 codes of all tensors in order: ``8 + numel + 4·Σ ceil(numel_i / block)`` bytes, i.e. about
    ``1 + 4/block`` bytes per element (1.016 at the default block of 256), before zstd.

    Raises:
        TypeError, ValueError: ``block`` is not an int in range.
    """

    codec_id = 3
    name = "int8"

    def __init__(self, block: int = DEFAULT_BLOCK):
        self.block = _check_block(block)

    def config(self) -> dict[str, Any]:
        return {"block": self.block}

    def max_body_bytes(self, like: Sequence[torch.Tensor]) -> int:
        return _I8_HEADER.size + sum(int8_nbytes(1, t.numel(), self.block) for t in like)

    def encode(self, tensors, *, stateful=True):
        qs, steps, decoded = [], [], []
        for t in tensors:
            x = t.detach().reshape(1, -1)
            q, d = quantize_int8(x, self.block)
            qs.append(q.reshape(-1).cpu())
            steps.append(d.reshape(-1).cpu())
            decoded.append(dequantize_int8(q, d, self.block).reshape(t.shape).to(t.dtype))
        step_all = torch.cat(steps) if steps else torch.empty(0)
        q_all = torch.cat(qs) if qs else torch.empty(0, dtype=torch.int8)
        body = b"".join((_I8_HEADER.pack(_I8_VERSION, self.block), step_all.numpy().tobytes(),
                         q_all.numpy().tobytes()))
        return body, decoded

    def decode(self, body, like):
        expected = self.max_body_bytes(like)
        if len(body) != expected:
            raise CodecError(f"int8 body has {len(body)} bytes, expected {expected} for {_numel(like)} elements "
                             f"in {len(like)} tensors with block {self.block}")
        version, block = _I8_HEADER.unpack_from(body, 0)
        if version != _I8_VERSION or block != self.block:
            raise CodecError(f"int8 body has format version {version} and block {block}; this worker expects "
                             f"version {_I8_VERSION} and block {self.block}")
        nscales = sum(int8_nscales(1, t.numel(), self.block) for t in like)
        off = _I8_HEADER.size
        steps = torch.from_numpy(np.frombuffer(body, dtype="<f4", count=nscales, offset=off).copy())
        codes = torch.from_numpy(np.frombuffer(body, dtype=np.int8, offset=off + 4 * nscales).copy())
        out, so, qo = [], 0, 0
        for t in like:
            n = t.numel()
            ns = int8_nscales(1, n, self.block)
            d = steps[so : so + ns].reshape(1, ns).to(t.device)
            q = codes[qo : qo + n].reshape(1, n).to(t.device)
            out.append(dequantize_int8(q, d, self.block).reshape(t.shape).to(t.dtype))
            so += ns
            qo += n
        return out
