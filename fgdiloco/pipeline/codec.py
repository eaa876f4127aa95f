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

A codec with ``needs_inputs = True`` also gets the microbatch's *inputs* (what the user passes to
:meth:`~fgdiloco.pipeline.Pipeline.step`, e.g. the token ids): ``encode(output, inputs=...)`` and
``decode(*received, inputs=...)``. Every stage then reads the batch itself (``Pipeline.step(inputs, target)`` on
every rank); the inputs are never sent between stages. The subspace codec
(:class:`fgdiloco.pipeline.subspace.SubspaceActivationCodec`) uses this to add ``E_fix[tokens]`` back.

While ``torch.distributed.pipelining`` infers the boundary shapes (first step, and after each switch between
``step`` and ``eval_loss``), the stages after the first run on *uninitialised* tensors of the right shape (and the
last stage calls ``loss_fn`` on their output); :func:`shape_inference` is True then, and a codec should skip value
checks (e.g. NaN or a subspace test), a ``loss_fn`` should not record that loss.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ActivationCodec", "BoundaryModule", "resolve_activation_codec", "shape_inference"]

_SHAPE_INFERENCE = contextvars.ContextVar("fgdiloco_pipeline_shape_inference", default=False)


def shape_inference() -> bool:
    """True while a :class:`~fgdiloco.pipeline.Pipeline` infers the shapes crossing its stage boundaries: the
    received tensors of stages after the first are then uninitialised memory, so codecs skip value checks."""
    return _SHAPE_INFERENCE.get()


@contextlib.contextmanager
def _inferring_shapes() -> Iterator[None]:
    token = _SHAPE_INFERENCE.set(True)
    try:
        yield
    finally:
        _SHAPE_INFERENCE.reset(token)


@runtime_checkable
class ActivationCodec(Protocol):
    """What :class:`~fgdiloco.pipeline.Pipeline` accepts as ``activation_codec`` (or a tuple ``(encode, decode)``).

    ``encode(output)``: the stage's output (tensor or tuple) -> the tensor(s) sent to the next stage.
    ``decode(*received)``: the received tensor(s) -> the next stage module's input (tensor or tuple).
    Both must be differentiable with ``torch.autograd``. With ``needs_inputs = True`` both also take the
    microbatch's inputs as the keyword ``inputs`` (see the module docstring).
    """

    def encode(self, output: Any) -> torch.Tensor | tuple[torch.Tensor, ...]: ...

    def decode(self, *received: torch.Tensor) -> Any: ...


def needs_inputs(codec: Any) -> bool:
    """Whether ``codec`` (an :class:`ActivationCodec`) wants the microbatch's inputs in ``encode`` / ``decode``."""
    return bool(getattr(codec, "needs_inputs", False)) and not isinstance(codec, tuple)


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
    last): the module a :class:`~torch.distributed.pipelining.PipelineStage` runs.

    With ``with_inputs`` the codec gets the microbatch's inputs: on the first stage they are the positional
    arguments (the module's own inputs), on the others the keyword ``inputs`` the pipeline passes to every stage.
    """

    def __init__(self, module: nn.Module, encode: Callable[..., Any] | None, decode: Callable[..., Any] | None,
                 owner: nn.Module | None = None, *, with_inputs: bool = False, first: bool = True):
        super().__init__()
        self.module = module
        self._encode = encode
        self._decode = decode
        self._with_inputs = with_inputs
        self._first = first
        self.codec = owner  # registered so that .to(device) moves its buffers

    def forward(self, *args: Any, inputs: Any = None) -> Any:
        if self._with_inputs and self._first:
            inputs = args[0] if len(args) == 1 else args
        extra = {"inputs": inputs} if self._with_inputs else {}
        if self._decode is not None:
            args = _as_tuple(self._decode(*args, **extra))
        out = self.module(*args)
        if self._encode is not None:
            out = self._encode(out, **extra)
        return out
