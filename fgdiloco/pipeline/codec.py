"""Activation codecs: what travels between pipeline stages.

A codec is a pair of differentiable functions, applied where a replica's stages meet:

* ``encode(output)`` runs on the sending stage, after the stage module; what it returns (a tensor or a tuple of
  tensors) is what goes on the wire forward;
* ``decode(*received)`` runs on the receiving stage, before the stage module, and returns what the module takes (a
  tensor, or a tuple that is unpacked into its arguments).

Autograd runs through both, so the backward transfer is compressed the same way without extra code: the receiving
stage sends ``∂L/∂(encoded)`` back, which has the shape of what was sent, and the sending stage turns it into
``∂L/∂(output)`` through ``encode``'s backward. A linear projection ``c = x U`` with an orthonormal ``d × k`` basis
``U`` (``decode: x = c Uᵀ``) sends ``k`` numbers per row instead of ``d``, forward and backward; it is lossless when
the activation lies in ``span(U)`` (subspace networks, Ramasinghe et al., arXiv 2506.01260).

The codec may be an ``nn.Module`` (its buffers, e.g. a fixed basis, then move with the stage); parameters it holds
are not in the user's stage module, so neither the inner optimizer nor gossip touches them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ActivationCodec", "BoundaryModule", "resolve_activation_codec"]


@runtime_checkable
class ActivationCodec(Protocol):
    """What :class:`~fgdiloco.pipeline.Pipeline` accepts as ``activation_codec`` (or a tuple ``(encode, decode)``).

    ``encode(output)``: the stage's output (tensor or tuple) -> the tensor(s) sent to the next stage.
    ``decode(*received)``: the received tensor(s) -> the next stage module's input (tensor or tuple).
    Both must be differentiable with ``torch.autograd``.
    """

    def encode(self, output: Any) -> torch.Tensor | tuple[torch.Tensor, ...]: ...

    def decode(self, *received: torch.Tensor) -> Any: ...


def resolve_activation_codec(codec: Any) -> tuple[Callable[..., Any], Callable[..., Any], Any] | None:
    """``(encode, decode, owner)`` for an :class:`ActivationCodec` or an ``(encode, decode)`` pair; ``None`` for
    ``None``. ``owner`` is the codec object when it is an ``nn.Module`` (registered with the stage), else None.

    Raises:
        TypeError: anything else.
    """
    if codec is None:
        return None
    if isinstance(codec, tuple):
        if len(codec) == 2 and all(callable(f) for f in codec):
            return codec[0], codec[1], None
        raise TypeError("activation_codec as a tuple must be (encode, decode), two callables")
    encode, decode = getattr(codec, "encode", None), getattr(codec, "decode", None)
    if callable(encode) and callable(decode):
        return encode, decode, codec if isinstance(codec, nn.Module) else None
    raise TypeError(f"activation_codec must be None, an (encode, decode) pair of callables or an object with "
                    f"encode() and decode() methods, got {type(codec).__name__}")


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


class BoundaryModule(nn.Module):
    """``module`` with ``decode`` before it (stages after the first) and ``encode`` after it (stages before the
    last): the module a :class:`~torch.distributed.pipelining.PipelineStage` runs."""

    def __init__(self, module: nn.Module, encode: Callable[..., Any] | None, decode: Callable[..., Any] | None,
                 owner: nn.Module | None = None):
        super().__init__()
        self.module = module
        self._encode = encode
        self._decode = decode
        self.codec = owner  # registered so that .to(device) moves its buffers

    def forward(self, *args: Any) -> Any:
        if self._decode is not None:
            args = _as_tuple(self._decode(*args))
        out = self.module(*args)
        if self._encode is not None:
            out = self._encode(out)
        return out
