"""Subspace compression of the activations between pipeline stages (Subspace Networks).

After Ramasinghe et al., "Subspace Networks: Scaling Decentralized Training with Communication-Efficient Model
Parallelism", arXiv 2506.01260. In a pre-norm transformer every write into the residual stream goes through the
token and position embeddings and each block's attention and MLP output projections. If every write made *before*
a stage boundary lands in ``span(U)`` for one fixed, seeded, orthonormal ``d × k`` basis ``U`` shared by every
stage, plus a frozen seeded token embedding ``E_fix`` that carries the token-specific part, then at that boundary::

    x = E_fix[tokens] + U c          x: [..., d] residual stream,  c: [..., k] coefficients

exactly. A stage sends ``c`` (k numbers per token) instead of ``x`` (d numbers per token) and the next stage
rebuilds ``x``; backward, the previous stage needs only ``∂L/∂c = Uᵀ ∂L/∂x`` (k numbers per token). That is d/k
compression in both directions, lossless given the reparametrisation (``fgdiloco.pretrain.model.GPT(...,
subspace_rank=k, subspace_stages=S)``, which leaves the writes after the last boundary free); the price is the
constraint on the model, which training has to absorb.

This module holds the parts that do not depend on a model or a pipeline:

* :func:`orthonormal_basis` / :class:`SubspaceBasis`: ``U``, identical on every rank and process for a given
  ``(d, k, seed)`` (a private seeded CPU generator, float64 QR with a sign convention, then cast);
* :func:`fixed_embedding`: ``E_fix``, seeded the same way;
* :class:`SubspaceCodec`: ``compress`` / ``decompress`` / ``residual`` / ``wire_bytes`` and the autograd
  boundary pair ``boundary_out`` (sending stage: ``x → c``) and ``boundary_in`` (receiving stage: ``c → x``),
  with :class:`BoundaryOut` / :class:`BoundaryIn` as modules for a stage's ``nn.Sequential``;
* :class:`SubspaceActivationCodec`: that pair as a :class:`fgdiloco.pipeline.Pipeline` ``activation_codec``
  (``needs_inputs``: every stage reads the token ids of the batch itself).

Token ids. The receiving stage needs ``tokens`` to add ``E_fix[tokens]`` back. This codec does not send them: the
design choice is that every stage reads the batch itself (the first stage needs the ids for the embedding, the last
needs the targets, which are the same batch shifted by one), so only ``c`` travels. A pipeline that does send the
ids with ``c`` counts them with ``wire_bytes(..., token_dtype=torch.int32)`` (forward only; 4 bytes per token, or 2
with ``torch.int16`` for a vocabulary below 32768).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .codec import shape_inference

__all__ = [
    "BoundaryIn",
    "BoundaryOut",
    "Residual",
    "SubspaceActivationCodec",
    "SubspaceBasis",
    "SubspaceCodec",
    "SubspaceError",
    "WireBytes",
    "compute_dtype",
    "default_tolerance",
    "fixed_embedding",
    "orthonormal_basis",
    "orthonormalize",
]

# Streams of the private generators: U and E_fix of one seed never share random numbers.
_BASIS_STREAM = 0
_EMBEDDING_STREAM = 1


class SubspaceError(RuntimeError):
    """The residual stream has a component outside ``E_fix[tokens] + span(U)`` above float tolerance: some module
    writes outside the subspace, so compressing it to ``c`` would lose information."""


def _check_int(name: str, value: object, low: int, high: int | None = None, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{what}, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {allowed}{what}, got {value}")
    return value


def _generator(seed: int, stream: int) -> torch.Generator:
    _check_int("seed", seed, 0, (1 << 63) - 1)
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + stream) % (1 << 63))


def orthonormalize(a: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning the columns of ``a`` (``[..., m, n]``, ``m >= n``): the Q factor of a reduced
    QR decomposition with the sign convention ``diag(R) >= 0``, which makes it unique for a full-rank ``a`` (and
    therefore the same on every process for the same input and library build). Same shape and dtype as ``a``.

    Raises:
        ValueError: ``a`` has fewer than 2 dimensions or more columns than rows.
    """
    if a.dim() < 2 or a.shape[-2] < a.shape[-1]:
        raise ValueError(f"a must be [..., m, n] with m >= n, got shape {tuple(a.shape)}")
    q, r = torch.linalg.qr(a)
    sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return q * sign.unsqueeze(-2)


def orthonormal_basis(d: int, k: int, seed: int = 0, *, device: torch.device | str | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``U``: a ``d × k`` matrix with orthonormal columns (``UᵀU = I_k``), a function of ``(d, k, seed)`` only.

    A Gaussian ``d × k`` matrix from a private CPU generator (the global RNG is neither read nor advanced) is
    orthonormalised in float64 (:func:`orthonormalize`) and then cast to ``dtype`` and moved to ``device``, so every
    rank and process that asks for the same ``(d, k, seed)`` gets the same bits (on the same library build; compare
    :meth:`SubspaceBasis.fingerprint` across ranks to be sure). ``span(U)`` is uniformly distributed over the
    k-dimensional subspaces of R^d.

    Raises:
        TypeError, ValueError: ``d`` not an int >= 1, ``k`` not an int in [1, d], ``seed`` not an int in
            [0, 2**63).
    """
    _check_int("d", d, 1, what=" (width of the residual stream)")
    _check_int("k", k, 1, d, what=f" (rank of the subspace, at most d = {d})")
    g = _generator(seed, _BASIS_STREAM)
    u = orthonormalize(torch.randn(d, k, generator=g, dtype=torch.float64))
    return u.to(device=device, dtype=dtype, memory_format=torch.contiguous_format)


def fixed_embedding(num_embeddings: int, d: int, seed: int = 0, *, std: float = 0.02,
                    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E_fix``: a frozen ``num_embeddings × d`` token embedding, ``N(0, std²)`` entries from a private CPU
    generator (stream distinct from :func:`orthonormal_basis`'s for the same seed), identical on every process.

    Raises:
        TypeError, ValueError: a size not an int >= 1, ``std`` not a finite number >= 0, a bad ``seed``.
    """
    _check_int("num_embeddings", num_embeddings, 1)
    _check_int("d", d, 1)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0 <= std < float("inf"):
        raise ValueError(f"std must be a finite number >= 0, got {std!r}")
    g = _generator(seed, _EMBEDDING_STREAM)
    e = torch.randn(num_embeddings, d, generator=g, dtype=torch.float64) * std
    return e.to(device=device, dtype=dtype)


def default_tolerance(dtype: torch.dtype) -> float:
    """Largest out-of-subspace component (relative to the residual stream's norm, per token) that float rounding
    explains for activations of ``dtype``: 1e-10 (float64), 1e-4 (float32), 3e-2 (bfloat16, float16).

    Measured on the example GPT (4 blocks, d = 32, fp32, weights perturbed off their initialisation, 5 seeds):
    2e-7 - 3e-7 for k >= 8; up to 1.6e-5 for k = 1 with large weights, where successive writes along the one
    direction cancel and the rounding of the larger intermediate streams remains. A module writing outside
    ``span(U)`` gave 1e-3 and more. A write smaller than the tolerance is below float noise and is not reported.

    Under bf16 autocast (the same GPT, d = 32 and 128, 4 and 8 blocks, k = 4 to d/8, weights perturbed by 0 to
    0.3, 2 seeds) the writes are rounded to bfloat16 before they are added to the fp32 stream: 1e-3 - 1e-2 for
    k >= 4, where a plain ``nn.Linear`` swapped into a block gave 9e-2 and more. For k = 1 with large weights the
    writes cancel as above and the rounding left can reach 0.3 of ``‖x‖``: pass ``tol`` there. The codec picks
    the dtype with :func:`compute_dtype`, so an fp32 stream computed under bf16 autocast is held to the bfloat16
    tolerance.
    """
    if dtype == torch.float64:
        return 1e-10
    if dtype in (torch.float16, torch.bfloat16):
        return 3e-2
    return 1e-4


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` now; None when autocast is off there (or the device
    type has no autocast)."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The lowest precision that took part in computing ``x`` as far as it can be told where ``x`` is checked:
    ``x.dtype``, or the autocast dtype when autocast is enabled for ``x``'s device type and is coarser (an fp32
    residual stream computed under bf16 autocast: ``torch.bfloat16``, since every write into it was rounded to
    bfloat16 before it was added). What :class:`SubspaceCodec` picks its default tolerance by
    (:func:`default_tolerance`); a stream computed under autocast but checked outside it reads as ``x.dtype``:
    pass ``tol`` then. Autocast leaves float64 alone, so a float64 stream reads as float64."""
    low = _autocast_dtype(x.device.type)
    if low is None or not x.is_floating_point() or x.dtype == torch.float64 \
            or torch.finfo(low).eps <= torch.finfo(x.dtype).eps:
        return x.dtype
    return low


def _exact(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast off on ``device``'s type: the codec computes in its tensors' own dtype (``c`` in ``x``'s dtype,
    the sent bytes and the round trip as without autocast), whatever the caller's autocast does to the stages."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


class Residual(NamedTuple):
    """The component ``r = y − U Uᵀ y`` of ``y = x − E_fix[tokens]`` outside ``span(U)``.

    Attributes:
        norm: ``‖r‖`` over the whole tensor (Frobenius), in the units of ``x``.
        relative: ``‖r‖ / ‖x‖`` over the whole tensor.
        max_relative: ``max_t ‖r_t‖ / ‖x_t‖`` over tokens ``t``: what the check compares with the tolerance, so
            one bad token is not averaged away.
    """

    norm: float
    relative: float
    max_relative: float


class SubspaceBasis:
    """A fixed orthonormal basis ``U`` (``d × k``) of the subspace every residual-stream write is confined to.

    ``U`` is a function of ``(d, k, seed)`` only (see :func:`orthonormal_basis`): identical on every rank and
    process, never trained and never sent. Ramasinghe et al., arXiv 2506.01260.

    Args:
        d: width of the residual stream (int >= 1).
        k: rank of the subspace (int, 1 <= k <= d); the boundary carries k numbers per token, d/k less than x.
        seed: selects the basis (int in [0, 2**63)); every stage of every replica must use the same.
        device, dtype: where ``U`` lives and its floating dtype (default float32).

    Raises:
        TypeError, ValueError: an argument out of range (the message names it and the allowed values).
    """

    def __init__(self, d: int, k: int, seed: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.U = orthonormal_basis(d, k, seed, device=device, dtype=dtype)
        self.d, self.k, self.seed = d, k, seed

    @classmethod
    def from_tensor(cls, U: torch.Tensor, seed: int = -1) -> SubspaceBasis:
        """Wrap an existing ``d × k`` basis (e.g. a model's ``U`` buffer) without copying it. ``seed`` is only
        recorded (-1: unknown).

        Raises:
            ValueError: ``U`` is not a 2-D floating tensor with ``d >= k >= 1``.
        """
        if not isinstance(U, torch.Tensor) or U.dim() != 2 or not U.is_floating_point() or not 1 <= U.shape[1] \
                <= U.shape[0]:
            raise ValueError(f"U must be a floating [d, k] tensor with 1 <= k <= d, got "
                             f"{tuple(U.shape) if isinstance(U, torch.Tensor) else type(U).__name__}")
        basis = cls.__new__(cls)
        basis.U, basis.d, basis.k, basis.seed = U, U.shape[0], U.shape[1], seed
        return basis

    @property
    def device(self) -> torch.device:
        return self.U.device

    @property
    def dtype(self) -> torch.dtype:
        return self.U.dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> SubspaceBasis:
        """The same basis on another device / in another dtype (a new object; ``self`` is unchanged)."""
        return SubspaceBasis.from_tensor(self.U.to(device=device, dtype=dtype), self.seed)

    def project(self, y: torch.Tensor) -> torch.Tensor:
        """Coefficients ``Uᵀ y`` of ``y`` (``[..., d]``) in the basis: ``[..., k]``, in ``y``'s dtype."""
        return y @ self.U.to(y.dtype)

    def lift(self, c: torch.Tensor) -> torch.Tensor:
        """The vector ``U c`` of coefficients ``c`` (``[..., k]``): ``[..., d]``, in ``c``'s dtype."""
        return c @ self.U.to(c.dtype).T

    def fingerprint(self) -> str:
        """SHA-256 (hex) of ``U``'s shape, dtype and bytes: equal on two ranks iff they hold bit-identical
        bases. Compare it across stages once at set-up."""
        u = self.U.detach().to("cpu").contiguous()
        h = hashlib.sha256(f"{tuple(u.shape)}|{u.dtype}".encode())
        h.update(u.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"SubspaceBasis(d={self.d}, k={self.k}, seed={self.seed}, device={self.device}, dtype={self.dtype})"


@dataclass(frozen=True)
class WireBytes:
    """Bytes that cross one stage boundary for one (micro)batch, and what an uncompressed boundary would carry.

    Attributes:
        forward: the coefficients ``c``: ``batch·seq·k`` numbers of ``dtype``.
        backward: the gradient ``∂L/∂c``: ``batch·seq·k`` numbers of ``dtype``.
        tokens: token ids sent with ``c`` (forward only), 0 when every stage reads the batch itself.
        dense_forward, dense_backward: ``x`` and ``∂L/∂x`` uncompressed: ``batch·seq·d`` numbers of ``dtype`` each.
    """

    forward: int
    backward: int
    tokens: int
    dense_forward: int
    dense_backward: int

    @property
    def total(self) -> int:
        """Everything this boundary carries per (micro)batch, both directions."""
        return self.forward + self.backward + self.tokens

    @property
    def dense_total(self) -> int:
        return self.dense_forward + self.dense_backward

    @property
    def ratio(self) -> float:
        """``dense_total / total``: the compression against the same boundary uncompressed in the same dtype."""
        return self.dense_total / self.total


class _BoundaryOut(torch.autograd.Function):
    """Sending stage: ``c = Uᵀ (x − e)``; backward ``∂L/∂x = U ∂L/∂c`` (only k numbers per token arrived)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, u: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u)
        with _exact(x.device):
            return (x - e) @ u

    @staticmethod
    def backward(ctx, grad_c: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (u,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        with _exact(grad_c.device):
            return grad_c @ u.to(grad_c.dtype).T, None, None


class _BoundaryIn(torch.autograd.Function):
    """Receiving stage: ``x = e + U c``; backward ``∂L/∂c = Uᵀ ∂L/∂x`` (k numbers per token go back)."""

    @staticmethod
    def forward(ctx, c: torch.Tensor, u: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u)
        with _exact(c.device):
            return e + c @ u.T

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (u,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        with _exact(grad_x.device):
            return grad_x @ u.to(grad_x.dtype), None, None


class SubspaceCodec:
    """Lossless activation codec for a residual stream confined to ``E_fix[tokens] + span(U)``.

    Ramasinghe et al., "Subspace Networks", arXiv 2506.01260. For a stream ``x`` (``[..., d]``) and its token ids
    (``[...]``, the same leading shape)::

        compress:    c = Uᵀ (x − E_fix[tokens])        [..., k]
        decompress:  x̂ = E_fix[tokens] + U c           [..., d]

    ``x̂ = x`` (to float rounding) iff ``x`` lies in the subspace; otherwise ``x̂`` is the orthogonal projection of
    ``x`` onto ``E_fix[tokens] + span(U)`` and :meth:`residual` is what is lost. With ``check=True`` (default)
    :meth:`compress` and :meth:`boundary_out` measure that residual and raise :class:`SubspaceError` above
    ``tol`` (per token, relative to ``‖x_t‖``), so a module writing outside the subspace is caught at the first
    boundary instead of silently degrading the model; the check costs one more ``[..., k] × [k, d]`` product and a
    host synchronisation, ``check=False`` skips it.

    Autocast. Under ``torch.autocast`` (e.g. bf16 on a GPU, ``precision="bf16-mixed"``) the stream stays fp32 but
    every write into it was rounded to the autocast dtype first, so its out-of-subspace rounding is that dtype's:
    the default tolerance follows the autocast dtype enabled for ``x``'s device when the check runs
    (:func:`compute_dtype`; 3e-2 for bf16 instead of 1e-4 for fp32), and a module writing outside ``span(U)``
    (9e-2 of ``‖x‖`` and more on the example GPT) is still caught. The codec's own products run with autocast off,
    in ``x``'s dtype: ``c`` (and ``∂L/∂c`` back) keeps ``x``'s dtype, so the bytes sent are those of
    :meth:`wire_bytes` for that dtype, and ``decompress(compress(x))`` is as exact as without autocast.

    The autograd pair, for a model split into stages: the sending stage ends with ``c = boundary_out(x, tokens)``
    and sends ``c``; the receiving stage starts with ``x = boundary_in(c_received, tokens)``. Backward,
    ``boundary_in`` returns ``∂L/∂c = Uᵀ ∂L/∂x`` (k numbers per token, what is sent back) and ``boundary_out`` turns
    the received ``∂L/∂c`` into ``∂L/∂x = U ∂L/∂c``. Because the sending stage's parameters move ``x`` only
    within ``span(U)``, the parameter gradients equal those of the unsplit model exactly (only the discarded
    ``(I − UUᵀ) ∂L/∂x`` is not sent, and it is orthogonal to every direction the parameters can move ``x`` in).
    Neither ``U`` nor ``E_fix`` gets a gradient.

    Wire size per boundary and (micro)batch of ``batch × seq`` tokens (:meth:`wire_bytes`): ``batch·seq·k``
    numbers forward plus as many backward, against ``batch·seq·d`` each way uncompressed: a ratio of d/k. Token ids
    do not travel (every stage reads the batch); a pipeline that sends them adds ``batch·seq`` ids forward.

    Args:
        basis: the :class:`SubspaceBasis` (``U``, ``d × k``), or a ``[d, k]`` tensor with orthonormal columns
            (checked: ``max |UᵀU − I|`` at most 10x :func:`default_tolerance` of its dtype).
        token_embedding: ``E_fix``, ``[vocab, d]`` floating tensor (frozen; e.g. :func:`fixed_embedding`).
        check: measure the out-of-subspace residual in :meth:`compress` / :meth:`boundary_out` and raise above
            ``tol``.
        tol: the largest allowed ``Residual.max_relative``; None: :func:`default_tolerance` of
            :func:`compute_dtype` (``x``'s dtype, or the autocast dtype under autocast).

    Raises:
        TypeError, ValueError: ``basis`` without orthonormal columns, ``token_embedding`` not a floating
            ``[vocab, d]`` tensor for the basis's d, ``tol`` not a finite number > 0.
    """

    def __init__(self, basis: SubspaceBasis | torch.Tensor, token_embedding: torch.Tensor, *, check: bool = True,
                 tol: float | None = None):
        if isinstance(basis, torch.Tensor):
            basis = SubspaceBasis.from_tensor(basis)
        if not isinstance(basis, SubspaceBasis):
            raise TypeError(f"basis must be a SubspaceBasis or a [d, k] tensor, got {type(basis).__name__}")
        with torch.no_grad():
            u = basis.U.detach().to(torch.float64)
            gram_error = float((u.T @ u - torch.eye(basis.k, dtype=torch.float64, device=u.device)).abs().max())
        if not gram_error <= 10 * default_tolerance(basis.dtype):
            raise ValueError(f"basis must have orthonormal columns (UᵀU = I): max |UᵀU − I| is {gram_error:.3g}; "
                             f"build it with SubspaceBasis / orthonormal_basis")
        if not isinstance(token_embedding, torch.Tensor) or token_embedding.dim() != 2 \
                or not token_embedding.is_floating_point() or token_embedding.shape[1] != basis.d:
            shape = tuple(token_embedding.shape) if isinstance(token_embedding, torch.Tensor) else None
            raise ValueError(f"token_embedding must be a floating [vocab, d={basis.d}] tensor (E_fix), got "
                             f"{shape if shape is not None else type(token_embedding).__name__}")
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                                or not 0 < tol < float("inf")):
            raise ValueError(f"tol must be a finite number > 0 or None (dtype default), got {tol!r}")
        self.basis = basis
        self.token_embedding = token_embedding.detach()
        self.check = bool(check)
        self.tol = None if tol is None else float(tol)
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def d(self) -> int:
        return self.basis.d

    @property
    def k(self) -> int:
        return self.basis.k

    @property
    def vocab_size(self) -> int:
        return self.token_embedding.shape[0]

    # ---------------------------------------------------------------------------------------------- helpers
    def _tensors(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``U`` and ``E_fix`` on ``like``'s device and in its dtype (converted once, then cached)."""
        key = (like.device, like.dtype)
        if key not in self._cache:
            self._cache[key] = (self.basis.U.detach().to(device=like.device, dtype=like.dtype),
                                self.token_embedding.to(device=like.device, dtype=like.dtype))
        return self._cache[key]

    def _check_tokens(self, tokens: torch.Tensor, lead: torch.Size, what: str) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype.is_complex \
                or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor of token ids, got "
                            f"{tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        if tokens.shape != lead:
            raise ValueError(f"tokens must have the leading shape of {what}, {tuple(lead)}, got {tuple(tokens.shape)}")

    def _check_x(self, x: torch.Tensor, tokens: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != self.d:
            raise ValueError(f"x must be a floating [..., d={self.d}] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        self._check_tokens(tokens, x.shape[:-1], "x")

    def _check_c(self, c: torch.Tensor, tokens: torch.Tensor) -> None:
        if not isinstance(c, torch.Tensor) or not c.is_floating_point() or c.dim() < 1 or c.shape[-1] != self.k:
            raise ValueError(f"c must be a floating [..., k={self.k}] tensor, got "
                             f"{tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__}")
        self._check_tokens(tokens, c.shape[:-1], "c")

    # ---------------------------------------------------------------------------------------------- codec
    def compress(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c, tokens)`` with ``c = Uᵀ (x − E_fix[tokens])``: ``[..., k]`` in ``x``'s dtype. Not differentiable
        through the boundary semantics (use :meth:`boundary_out` in training).

        Raises:
            ValueError: ``x`` not ``[..., d]`` floating, ``tokens`` not of ``x``'s leading shape.
            TypeError: ``tokens`` not an integer tensor.
            SubspaceError: ``check`` is on and ``x`` is outside the subspace beyond the tolerance.
        """
        self._check_x(x, tokens)
        if self.check:
            self.verify(x, tokens)
        u, e = self._tensors(x)
        with torch.no_grad(), _exact(x.device):
            return (x.detach() - F.embedding(tokens, e)) @ u, tokens

    def decompress(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``x = E_fix[tokens] + U c``: ``[..., d]`` in ``c``'s dtype.

        Raises:
            ValueError: ``c`` not ``[..., k]`` floating, ``tokens`` not of ``c``'s leading shape.
            TypeError: ``tokens`` not an integer tensor.
        """
        self._check_c(c, tokens)
        u, e = self._tensors(c)
        with torch.no_grad(), _exact(c.device):
            return F.embedding(tokens, e) + c.detach() @ u.T

    def residual(self, x: torch.Tensor, tokens: torch.Tensor) -> Residual:
        """The component of ``x`` outside ``E_fix[tokens] + span(U)`` (computed in float64 for float64 input,
        float32 otherwise, with autocast off, so the measurement does not add the activations' rounding).

        Raises:
            ValueError, TypeError: as :meth:`compress`.
        """
        self._check_x(x, tokens)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        with torch.no_grad(), _exact(x.device):
            xw = x.detach().to(work)
            u = self.basis.U.detach().to(device=x.device, dtype=work)
            y = xw - F.embedding(tokens, self.token_embedding.to(device=x.device, dtype=work))
            r = y - (y @ u) @ u.T
            r_tok, x_tok = torch.linalg.vector_norm(r, dim=-1), torch.linalg.vector_norm(xw, dim=-1)
            norm, x_norm = float(torch.linalg.vector_norm(r_tok)), float(torch.linalg.vector_norm(x_tok))
            tiny = torch.finfo(work).tiny
            max_rel = float((r_tok / x_tok.clamp_min(tiny)).max()) if r_tok.numel() else 0.0
        return Residual(norm, norm / max(x_norm, tiny), max_rel)

    def verify(self, x: torch.Tensor, tokens: torch.Tensor, where: str = "") -> Residual:
        """:meth:`residual`, raising :class:`SubspaceError` if ``max_relative`` exceeds the tolerance (``tol``, or
        :func:`default_tolerance` of :func:`compute_dtype`: ``x``'s dtype, or the autocast dtype when autocast is
        on for ``x``'s device and coarser, since the writes into the stream were rounded to it). ``where`` names
        the place in the error message.

        Raises:
            SubspaceError: ``x`` has a component outside the subspace beyond float rounding.
        """
        res = self.residual(x, tokens)
        low = compute_dtype(x)
        tol = self.tol if self.tol is not None else default_tolerance(low)
        if not res.max_relative <= tol:  # also catches NaN
            at = f" at {where}" if where else ""
            under = f" computed under {low} autocast" if low != x.dtype else ""
            raise SubspaceError(
                f"the residual stream{at} is outside E_fix[tokens] + span(U): out-of-subspace component "
                f"{res.max_relative:.3g} of ‖x‖ (per token, max; {res.relative:.3g} overall) exceeds the tolerance "
                f"{tol:.3g} for {x.dtype}{under}. Some module writes into the residual stream without going through U "
                f"(every write must be U·(something): use the subspace output projections and embeddings); "
                f"compressing this stream to k={self.k} coefficients would lose that component")
        return res

    def wire_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32, *,
                   token_dtype: torch.dtype | None = None) -> WireBytes:
        """Bytes across one boundary for one (micro)batch of ``batch × seq`` tokens with activations and gradients
        in ``dtype``; ``token_dtype``: the dtype token ids travel in with ``c`` (None: they do not travel).

        Raises:
            TypeError, ValueError: ``batch`` / ``seq`` not ints >= 1, a dtype that is not a torch.dtype.
        """
        _check_int("batch", batch, 1)
        _check_int("seq", seq, 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if token_dtype is not None and (not isinstance(token_dtype, torch.dtype) or token_dtype.is_floating_point):
            raise TypeError(f"token_dtype must be an integer torch.dtype or None, got {token_dtype!r}")
        n, item = batch * seq, dtype.itemsize
        tokens = 0 if token_dtype is None else n * token_dtype.itemsize
        return WireBytes(forward=n * self.k * item, backward=n * self.k * item, tokens=tokens,
                         dense_forward=n * self.d * item, dense_backward=n * self.d * item)

    # ---------------------------------------------------------------------------------------------- autograd
    def boundary_out(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Sending stage: ``c = Uᵀ (x − E_fix[tokens])`` (``[..., k]``, differentiable in ``x``: backward maps the
        received ``∂L/∂c`` to ``∂L/∂x = U ∂L/∂c``). Checks the residual first when ``check`` is on.

        Raises:
            ValueError, TypeError, SubspaceError: as :meth:`compress`.
        """
        self._check_x(x, tokens)
        if self.check:
            self.verify(x, tokens, where="boundary_out")
        u, e = self._tensors(x)
        return _BoundaryOut.apply(x, u, F.embedding(tokens, e))

    def boundary_in(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Receiving stage: ``x = E_fix[tokens] + U c`` (``[..., d]``, differentiable in ``c``: backward gives
        ``∂L/∂c = Uᵀ ∂L/∂x``, the k numbers per token that are sent back). Call ``c.requires_grad_()`` on the
        received tensor to get its gradient.

        Raises:
            ValueError, TypeError: as :meth:`decompress`.
        """
        self._check_c(c, tokens)
        u, e = self._tensors(c)
        return _BoundaryIn.apply(c, u, F.embedding(tokens, e))

    def __repr__(self) -> str:
        return (f"SubspaceCodec(d={self.d}, k={self.k}, vocab_size={self.vocab_size}, check={self.check}, "
                f"tol={self.tol})")


class BoundaryOut(nn.Module):
    """``forward(x, tokens) -> c``: :meth:`SubspaceCodec.boundary_out` as the last module of a sending stage."""

    def __init__(self, codec: SubspaceCodec):
        super().__init__()
        if not isinstance(codec, SubspaceCodec):
            raise TypeError(f"codec must be a SubspaceCodec, got {type(codec).__name__}")
        self.codec = codec

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.codec.boundary_out(x, tokens)


class BoundaryIn(nn.Module):
    """``forward(c, tokens) -> x``: :meth:`SubspaceCodec.boundary_in` as the first module of a receiving stage."""

    def __init__(self, codec: SubspaceCodec):
        super().__init__()
        if not isinstance(codec, SubspaceCodec):
            raise TypeError(f"codec must be a SubspaceCodec, got {type(codec).__name__}")
        self.codec = codec

    def forward(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.codec.boundary_in(c, tokens)


def _tokens_of(inputs: object) -> torch.Tensor:
    tokens = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"the subspace activation codec needs the microbatch's token ids [b, T] as the pipeline's "
                        f"inputs (Pipeline.step(idx, targets) on every stage), got {type(inputs).__name__}")
    return tokens


class SubspaceActivationCodec:
    """:class:`SubspaceCodec` as the ``activation_codec`` of a :class:`fgdiloco.pipeline.Pipeline` (Subspace
    Networks, Ramasinghe et al., arXiv 2506.01260).

    ``encode(x, inputs=idx)`` on a sending stage is ``boundary_out``: ``x`` (``[b, T, d]``) → ``c`` (``[b, T, k]``)
    goes on the wire; ``decode(c, inputs=idx)`` on the receiving stage is ``boundary_in``: ``c`` → ``x``. Backward,
    ``∂L/∂c`` (``[b, T, k]``) travels back. Both directions carry ``b·T·k`` numbers of the activations' dtype per
    microbatch and boundary (static shapes), under autocast too (the codec computes with autocast off); ``U`` and
    ``E_fix`` stay on their stage and never travel.

    Token ids: ``needs_inputs = True``, so every stage reads the batch's token ids itself (the pipeline passes
    ``Pipeline.step(idx, targets)``'s ``idx`` to the codec on every stage, split into microbatches locally): no ids
    cross a boundary. With ``check`` (default) ``encode`` raises :class:`SubspaceError` when the stream has left
    ``E_fix[tokens] + span(U)`` by more than float rounding (a module writing outside the subspace; the rounding of
    the autocast dtype when autocast is on, see :class:`SubspaceCodec`); the check is
    skipped while the pipeline infers shapes on uninitialised tensors
    (:func:`fgdiloco.pipeline.codec.shape_inference`).

    With ``with_tokens=True`` :meth:`decode` returns ``(x, tokens)``, so the receiving stage module is called as
    ``module(x, tokens)``: for stages that read the token ids themselves, e.g. a GPT built with
    ``stage_embeddings=True`` whose every stage re-embeds the tokens (:class:`fgdiloco.pretrain.model.GPT`). The ids
    are the ones every stage already reads; nothing more crosses the boundary.

    Args:
        codec: the :class:`SubspaceCodec` (e.g. ``GPT.subspace_codec()`` or a stage's); or build one from
            ``basis`` and ``token_embedding`` as :class:`SubspaceCodec` does (keywords ``check``, ``tol`` as there).
        with_tokens: whether :meth:`decode` hands the token ids to the receiving stage module too (bool).

    Raises:
        TypeError: ``codec`` is not a :class:`SubspaceCodec`, ``with_tokens`` not a bool.
    """

    needs_inputs = True

    def __init__(self, codec: SubspaceCodec, *, with_tokens: bool = False):
        if not isinstance(codec, SubspaceCodec):
            raise TypeError(f"codec must be a SubspaceCodec, got {type(codec).__name__}")
        if not isinstance(with_tokens, bool):
            raise TypeError(f"with_tokens must be a bool, got {type(with_tokens).__name__}")
        self.codec = codec
        self.with_tokens = with_tokens

    @classmethod
    def from_basis(cls, basis: SubspaceBasis | torch.Tensor, token_embedding: torch.Tensor, *, check: bool = True,
                   tol: float | None = None, with_tokens: bool = False) -> SubspaceActivationCodec:
        """``SubspaceActivationCodec(SubspaceCodec(basis, token_embedding, check=check, tol=tol), with_tokens=...)``."""
        return cls(SubspaceCodec(basis, token_embedding, check=check, tol=tol), with_tokens=with_tokens)

    @property
    def k(self) -> int:
        return self.codec.k

    @property
    def d(self) -> int:
        return self.codec.d

    def encode(self, x: torch.Tensor, inputs: object = None) -> torch.Tensor:
        """Sending stage: ``c = Uᵀ (x − E_fix[tokens])``, ``[b, T, k]`` (differentiable; see
        :meth:`SubspaceCodec.boundary_out`). Raises :class:`SubspaceError` as described in the class docstring."""
        tokens = _tokens_of(inputs)
        if self.codec.check and shape_inference():
            return _BoundaryOut.apply(x, *self._u_e(x, tokens))
        return self.codec.boundary_out(x, tokens)

    def decode(self, c: torch.Tensor, inputs: object = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Receiving stage: ``x = E_fix[tokens] + U c``, ``[b, T, d]`` (differentiable; backward gives the
        ``∂L/∂c`` that is sent back); ``(x, tokens)`` with ``with_tokens``."""
        tokens = _tokens_of(inputs)
        x = self.codec.boundary_in(c, tokens)
        return (x, tokens) if self.with_tokens else x

    def _u_e(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.codec._check_x(x, tokens)
        u, e = self.codec._tensors(x)
        return u, F.embedding(tokens, e)

    def wire_bytes(self, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> WireBytes:
        """What one boundary carries for a (micro)batch of ``batch × seq`` tokens (no token ids travel): see
        :meth:`SubspaceCodec.wire_bytes`."""
        return self.codec.wire_bytes(batch, seq, dtype)

    def __repr__(self) -> str:
        extra = ", with_tokens=True" if self.with_tokens else ""
        return f"SubspaceActivationCodec({self.codec!r}{extra})"
