"""Low-rank compression of pseudo-gradients.

Two protocols share one codec (:class:`LowRank`), chosen by the mix that runs it:

* **Pairwise gossip rounds** (random, exponential, ring topologies): a *pair-agreed projection*. Both peers project
  onto one basis they build together, so the round is consensus-safe (docs/gossip.md): ``q(Δ_j) − q(Δ_i) =
  P̂P̂ᵀ(Δ_j − Δ_i)`` and the pair's disagreement can only shrink (up to the number format's floor). The basis is a
  power-iteration step on the pair's *difference* ``Δ_j − Δ_i``, warm-started per peer (the part a pair round
  leaves is ``(I − P̂P̂ᵀ)(Δ_j − Δ_i)``, so that is the subspace to find). No error feedback: the difference form
  already keeps the workers' average exact, and a residual would be paid later to a different peer.
* **The exact (all-reduce) path**: PowerSGD with warm start and error feedback (Vogels, Karimireddy & Jaggi,
  NeurIPS 2019), where every worker applies the same mean.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .codec import Codec, CodecError, Message, PairOutcome, PairSession, _all_finite, register_codec, sq_norm
from .quantize import DEFAULT_BLOCK, _check_block, dequantize_int8, int8_nscales, quantize_int8

__all__ = ["LowRank"]

_QUANT_CODES = {"int8": 1, "bf16": 2, "fp32": 3}
_BASIS_CODES = {"joint": 0, "difference": 1}  # the pair basis, in the number-format byte's high nibble
# body format version, number format (| pair basis << 4), rank, int8 block, min_compression
_HEADER = struct.Struct("<BBHIf")
_VERSION = 1
_STATE_VERSION = 2  # 2: the per-peer warm starts of the difference basis; version 1 states load (without them)
PAIR_PEERS = 16  # per-peer warm starts kept (least recently used dropped): the exponential graph needs log2(M)


@dataclass(frozen=True)
class _Group:
    """Tensors of one shape class, processed as one batch: factored ``m × n`` matrices (``Pᵀ``: ``B·r`` rows of m,
    ``Qᵀ``: ``B·r`` rows of n) or dense tensors of ``n`` elements (``B`` rows of n)."""

    factored: bool
    m: int
    n: int
    rank: int
    indices: tuple[int, ...]

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        b = len(self.indices)
        if self.factored:
            return ((b * self.rank, self.m), (b * self.rank, self.n))
        return ((b, self.n),)


@dataclass(frozen=True)
class _Plan:
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[_Group, ...]
    factored: tuple[bool, ...]
    nvals: int
    nscales: int


@register_codec
class LowRank(Codec):
    """Rank-``r`` factorisation of each matrix with warm-started power iteration and error feedback.

    PowerSGD (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019), applied to the pseudo-gradients of Mix2. For every tensor ``Δ`` with at least two
    dimensions, viewed as an ``m × n`` matrix (first dimension × all others)::

        M  = Δ + e                   e: this tensor's error-feedback residual (zeros at first)
        P  = M Q                     Q: n × r, warm-started from the previous round (seeded Gaussian at first)
        P̂  = orthonormalise(P)       torch.linalg.qr, m × r
        Qᵀ = P̂ᵀ M                    r × n (computed from P̂ as the receiver will see it)
        send P̂ and Q; the receiver reconstructs  M̂ = P̂ Qᵀ
        e ← M − M̂                    what was not sent is carried to the next round

    One power-iteration step per round, warm-started, tracks the top-``r`` singular subspace of the slowly
    changing ``M``. If ``M`` has rank at most ``r`` the reconstruction is exact (to float rounding, with
    ``quantize=None``) in a single round from any starting ``Q`` with ``VᵀQ`` invertible, which a Gaussian start
    gives with probability 1. A matrix is factored only when that sends fewer numbers:
    ``min_compression · r·(m + n) < m·n``; other tensors (1-D biases and norms, 0-D scalars, small or narrow
    matrices) go *dense*, in the same number format, with the same error feedback.

    **Pairwise rounds** use :meth:`pair_session` instead (no residual; the warm starts are the only state)::

        worker i                                    worker j (the same, with i and j swapped)
        P_i = Δ_i Qᵀ             ── send P_i ──▶     (m × r per matrix, Qᵀ: the pair's warm start, r × n)
        P̂  = orthonormalise(P_hi − P_lo)            (identical on both: same inputs, same order; = (Δ_hi − Δ_lo) Qᵀ)
        B_i = P̂ᵀ Δ_i             ── send B_i ──▶     (r × n per matrix; 1-D tensors travel dense here)
        Δ_i ← Δ_i + ½ P̂ (B_j − B_i)                 = Δ_i + ½ P̂P̂ᵀ(Δ_j − Δ_i)
        Q   ← rows of (B_hi − B_lo), normalised     (kept for this peer; committed only when the exchange succeeded)

    ``Q`` is a warm start per peer (the :data:`PAIR_PEERS` most recent peers), the same on both sides after every
    successful exchange between them, and the seeded draw for a peer never met: one warm-started step of subspace
    iteration on the pair's difference per round, as PowerSGD's on a gradient. A pair whose warm starts differ (one
    side restarted, or missed the other's accept) still builds the same ``P̂`` on both sides (it is computed from
    the transmitted ``P`` messages), only a worse one, and agrees again after that exchange. ``pair_basis="joint"`` (the
    basis of earlier releases: the top-``r`` left singular vectors of ``[Δ_lo Q_lo, Δ_hi Q_hi]`` with one warm start per
    worker, ``Q_i`` ← rows of ``B_i + B_j``) finds the pair's *shared* directions instead; measured on the
    example GPT's pseudo-gradients it leaves 1.7-1.9x the difference (benchmarks/RESULTS.md, "The pair basis").

    The same numbers travel as in the exact path (``r·(m + n)`` per matrix), in two messages instead of one. The
    pair's new difference is ``(I − P̂P̂ᵀ)(Δ_i − Δ_j)`` plus the number format's error on ``B`` (the floor: 0 for
    ``"fp32"``, half an int8 step of each row block of ``B`` for ``"int8"``), so a round never increases the
    disagreement beyond that floor, whatever the inputs and whichever basis (a per-worker subspace would not cancel
    it). Measured on the example GPT's real pseudo-gradients (4 workers, ``benchmarks/consensus.py``): see
    benchmarks/RESULTS.md (consensus).

    Error feedback (exact path) makes the compression unbiased over time: the sum of everything sent up to round
    ``t`` equals the sum of the inputs minus the current residual (``Σ M̂ = Σ Δ − e_t``), and the residual stays
    bounded, so nothing is lost, only delayed. Without it (``error_feedback=False``, for ablations) the part outside the
    top-``r`` subspace is dropped every round and the gap grows linearly.

    Tuning (as for PowerSGD): start at ``rank=1``-``4`` and double it only if training lags the dense codec; keep
    error feedback and warm start on, they are what makes low rank work. ``quantize="int8"`` shrinks the factors
    4x more at an error (half an int8 step per element) that error feedback absorbs.

    Number formats (``quantize``): ``"int8"`` (default) sends factors and dense tensors as int8 with one fp32
    absmax scale per ``block`` elements of each factor row (:mod:`fgdiloco.factor.quantize`; error at most
    ``absmax/254·(1+2⁻¹²)`` per element, before error feedback); ``"bf16"`` sends them as bfloat16 (relative
    error ≤ 2⁻⁸); ``"fp32"`` or None sends them as fp32 (dense tensors then travel exactly).

    Wire size (exact, before zstd; frames add 48 bytes of header): a 12-byte header plus, per factored ``m × n``
    tensor, ``r·(m + n)`` numbers, and per dense tensor its ``numel`` numbers, at 1 byte (int8; plus 4 bytes per
    scale: ``r·ceil(m/block) + r·ceil(n/block)`` or ``ceil(numel/block)`` scales), 2 bytes (bf16) or 4 bytes
    (fp32) each. :meth:`max_body_bytes` gives the exact body size for a layout.

    The state (per tensor: warm-start ``Qᵀ``, ``r × n`` fp32 with unit rows; residual ``e``, fp32 of the tensor's
    shape; per peer, the difference basis's warm starts) changes only in ``encode(..., stateful=True)`` and when a
    pair session's outcome is committed; with ``stateful=False`` it is only read (``Q``) and no residual is added
    or kept. It is saved by :meth:`state_dict` and restored exactly by
    :meth:`load_state_dict`, so a resumed run continues the same trajectory. State is kept per position in the
    tensor list, on the tensors' device.

    What :meth:`encode` returns as decoded is computed by the same code the receiver runs (:meth:`decode`), so on
    the same kind of device with the same library build both sides hold bit-identical tensors. A tensor whose
    input is NaN or ±Inf is sent non-finite (the peer's frame check rejects it); its residual is then reset to
    zero and its warm start kept, so one bad round does not poison later ones.

    Args:
        rank: r, the rank of each factorisation (int >= 1).
        error_feedback: on the exact (all-reduce) path, keep a per-tensor residual of what was not sent and add it
            to the next input. Pairwise rounds never use a residual.
        quantize: number format on the wire: ``"int8"``, ``"bf16"``, ``"fp32"`` or None (= ``"fp32"``).
        block: elements per int8 scale (int in [1, 2**20]); a block never spans two factor rows.
        min_compression: factor a matrix only if that sends fewer than ``1/min_compression`` of its numbers
            (float >= 1).
        seed: seed of the initial ``Q`` of each tensor (tensor ``i`` gets its own stream; same on every worker).
        pair_basis: the basis of a pairwise round: ``"difference"`` (a subspace-iteration step on the pair's
            difference, warm-started per peer) or ``"joint"`` (the pair's shared top-``r`` directions). Both peers
            must use the same (the frame header carries it).

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range.
    """

    codec_id = 4
    name = "lowrank"
    stateful = True

    def __init__(self, rank: int = 4, *, error_feedback: bool = True, quantize: str | None = "int8",
                 block: int = DEFAULT_BLOCK, min_compression: float = 1.0, seed: int = 0,
                 pair_basis: str = "difference"):
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int >= 1 (rank of each factorisation), got {type(rank).__name__}")
        if not 1 <= rank <= 65535:
            raise ValueError(f"rank must be an int in [1, 65535], got {rank}")
        if quantize is None:
            quantize = "fp32"
        if not isinstance(quantize, str) or quantize.lower() not in _QUANT_CODES:
            raise ValueError(f"quantize must be one of 'int8', 'bf16', 'fp32' or None, got {quantize!r}")
        if isinstance(min_compression, bool) or not isinstance(min_compression, (int, float)):
            raise TypeError(f"min_compression must be a number >= 1, got {type(min_compression).__name__}")
        if not (math.isfinite(min_compression) and min_compression >= 1.0):
            raise ValueError(f"min_compression must be a finite number >= 1, got {min_compression!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if pair_basis not in _BASIS_CODES:
            raise ValueError(f"pair_basis must be one of {', '.join(map(repr, _BASIS_CODES))}, got {pair_basis!r}")
        self.pair_basis = pair_basis
        self.rank = rank
        self.error_feedback = bool(error_feedback)
        self.quantize = quantize.lower()
        self.block = _check_block(block)
        # stored as the fp32 that travels in the header, so both ends compare the same number
        self.min_compression = float(np.float32(min_compression))
        self.seed = seed
        self.shuffle = {"int8": 0, "bf16": 2, "fp32": 4}[self.quantize]
        self._plans: dict[tuple[tuple[int, ...], ...], _Plan] = {}
        self._reset_state()

    # ------------------------------------------------------------------ configuration and layout
    def config(self) -> dict[str, Any]:
        return {"rank": self.rank, "error_feedback": self.error_feedback, "quantize": self.quantize,
                "block": self.block, "min_compression": self.min_compression, "seed": self.seed,
                "pair_basis": self.pair_basis}

    def _reset_state(self) -> None:
        self._shapes: tuple[tuple[int, ...], ...] | None = None
        self._q: list[torch.Tensor | None] = []
        self._e: list[torch.Tensor | None] = []
        # the difference basis's warm starts: peer -> {tensor index: r × n}, least recently used first
        self._pq: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()

    def _factors(self, shape: tuple[int, ...]) -> bool:
        """A tensor of 2 or more dimensions, viewed as ``m × n`` (``m = shape[0]``), is factored when
        ``min_compression · rank · (m + n) < m · n``; any other tensor is sent whole."""
        numel = math.prod(shape)
        if len(shape) < 2 or numel == 0:
            return False
        m, n = shape[0], numel // shape[0]
        return self.min_compression * self.rank * (m + n) < m * n

    def factors_none_of(self, like: Sequence[torch.Tensor]) -> str | None:
        """What to tell a user whose layout ``like`` (tensors or meta tensors: only shapes are read) has matrices
        but none that is :meth:`factored` at this rank (each then travels whole, and the codec saves nothing);
        None when one is factored or none is a matrix."""
        matrices = [(t.shape[0], t.numel() // t.shape[0]) for t in like if t.dim() >= 2 and t.numel() > 0]
        if not matrices or any(self.factored(like)):
            return None
        useful = max(math.ceil(m * n / (self.min_compression * (m + n))) - 1 for m, n in matrices)
        return (f"at codec rank {self.rank} none of the model's matrices ({len(matrices)}) is factored (a rank-r "
                "factorisation of an m x n matrix is smaller only while r·(m + n) < m·n): Mix2 sends each one "
                "whole, so the low-rank codec "
                f"saves nothing here; use {f'a rank of at most {useful}' if useful >= 1 else 'the dense codec'}")

    def _plan(self, shapes: tuple[tuple[int, ...], ...]) -> _Plan:
        """How a layout travels (cached): tensors grouped by shape, groups in order of first appearance.

        The grouping depends on the shapes only (never on devices or dtypes), so sender and receiver agree on it.
        """
        plan = self._plans.get(shapes)
        if plan is not None:
            return plan
        members: dict[tuple[bool, int, int], list[int]] = {}
        factored = []
        for i, shape in enumerate(shapes):
            numel = math.prod(shape)
            key = (True, shape[0], numel // shape[0]) if self._factors(shape) else (False, 1, numel)
            factored.append(key[0])
            members.setdefault(key, []).append(i)
        groups = tuple(_Group(f, m, n, self.rank, tuple(idx)) for (f, m, n), idx in members.items())
        nvals = sum(r * n for g in groups for r, n in g.pieces)
        nscales = sum(int8_nscales(r, n, self.block) for g in groups for r, n in g.pieces)
        if len(self._plans) > 8:
            self._plans.clear()
        plan = self._plans[shapes] = _Plan(shapes, groups, tuple(factored), nvals, nscales)
        return plan

    def _header(self) -> bytes:
        fmt = _QUANT_CODES[self.quantize] | _BASIS_CODES[self.pair_basis] << 4
        return _HEADER.pack(_VERSION, fmt, self.rank, self.block, self.min_compression)

    def max_body_bytes(self, like: Sequence[torch.Tensor]) -> int:
        """Exact body size in bytes for tensors shaped like ``like`` (every body of this layout has it)."""
        plan = self._plan(tuple(tuple(t.shape) for t in like))
        if self.quantize == "int8":
            return _HEADER.size + 4 * plan.nscales + plan.nvals
        return _HEADER.size + (2 if self.quantize == "bf16" else 4) * plan.nvals

    def factored(self, like: Sequence[torch.Tensor]) -> list[bool]:
        """Which tensors of a layout are factored (True) or sent dense (False)."""
        return list(self._plan(tuple(tuple(t.shape) for t in like)).factored)

    # ------------------------------------------------------------------ number formats
    def _send(self, v: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Wire parts of rows ``v`` (R, L) fp32 and what the receiver dequantises from them (contiguous fp32)."""
        if self.quantize == "int8":
            q, d = quantize_int8(v, self.block)
            return (q, d), dequantize_int8(q, d, self.block).contiguous()
        if self.quantize == "bf16":
            b = v.to(torch.bfloat16).contiguous()
            return (b,), b.to(torch.float32)
        v = v.contiguous()
        return (v,), v

    @staticmethod
    def _rebuild(group: _Group, deq: Sequence[torch.Tensor]) -> torch.Tensor:
        """``(B, m, n)`` fp32: what a receiver reconstructs from a group's dequantised pieces (the same code runs
        on the sender, so both hold bit-identical values)."""
        b = len(group.indices)
        if group.factored:
            pt = deq[0].reshape(b, group.rank, group.m)
            qt = deq[1].reshape(b, group.rank, group.n)
            return torch.bmm(pt.transpose(1, 2), qt)
        return deq[0].reshape(b, 1, group.n)

    def _init_q(self, index: int, n: int, device: torch.device) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (1 << 63))
        q = torch.randn(self.rank, n, generator=g, dtype=torch.float32)
        return (q / q.norm(dim=1, keepdim=True)).to(device)

    # ------------------------------------------------------------------ the codec
    def encode(self, tensors, *, stateful=True):
        """Encode pseudo-gradients (one tensor per parameter, any shapes and float dtypes; not modified).

        Returns ``(body, decoded)`` as :meth:`Codec.encode`; with ``stateful=True`` adds and updates the
        residuals and warm starts, with ``stateful=False`` only reads the warm starts.

        Raises:
            ValueError: the codec holds state for a different layout (number or shapes of tensors).
        """
        shapes = tuple(tuple(t.shape) for t in tensors)
        plan = self._plan(shapes)
        if self._shapes is not None and shapes != self._shapes:
            raise ValueError(f"LowRank holds state for {len(self._shapes)} tensors of shapes {list(self._shapes)[:4]}"
                             f"...; got {len(shapes)} tensors of shapes {list(shapes)[:4]}...: one codec instance "
                             "serves one parameter layout")
        if stateful and self._shapes is None:
            self._shapes = shapes
            self._q = [None] * len(shapes)
            self._e = [None] * len(shapes)
        keep = stateful and self.error_feedback
        wire: list[torch.Tensor] = []
        decoded: list[torch.Tensor | None] = [None] * len(tensors)
        for g in plan.groups:
            mb = self._stack_inputs(g, tensors, keep)
            if g.factored:
                parts, out, finite = self._encode_factored(g, mb, stateful)
            else:
                parts, out, finite = self._encode_dense(g, mb)
            wire += parts
            outs = []
            for j, i in enumerate(g.indices):
                t = tensors[i]
                o = out[j].reshape(t.shape).to(dtype=t.dtype)
                if keep and o.dtype != torch.float32:  # the residual is what the receiver did not get
                    mb[j].sub_(o.to(torch.float32).reshape(g.m, g.n))
                outs.append(o)
                decoded[i] = o.to(device=t.device)
            if keep:
                self._keep_residual(g, mb, out, outs, finite)
        return self._pack(wire), decoded

    def _stack_inputs(self, g: Any, tensors: Any, keep: bool) -> torch.Tensor:
        """The group's inputs as one ``[len, m, n]`` fp32 batch, plus their residuals when error feedback adds them."""
        dev = tensors[g.indices[0]].device
        mb = torch.empty((len(g.indices), g.m, g.n), dtype=torch.float32, device=dev)
        for j, i in enumerate(g.indices):
            x = tensors[i].detach().reshape(g.m, g.n).to(device=dev)
            e_old = self._e[i] if self._e and self.error_feedback else None
            if keep and e_old is not None:
                torch.add(x, e_old.reshape(g.m, g.n).to(dev), out=mb[j])
            else:
                mb[j].copy_(x)
        return mb

    def _encode_factored(self, g: Any, mb: torch.Tensor, stateful: bool) -> tuple[list, torch.Tensor, Any]:
        """One warm-started power step per matrix: what is sent, what the receiver rebuilds, and which matrices
        were finite (None: all)."""
        qb = torch.stack([self._start_q(i, g.n, mb.device) for i in g.indices])
        p = torch.bmm(mb, qb.transpose(1, 2))
        finite = torch.isfinite(p).flatten(1).all(dim=1)
        all_finite = bool(finite.all())
        if all_finite:
            p_hat = torch.linalg.qr(p).Q
        else:  # keep NaN/Inf in what is sent (the peer rejects it) without asking LAPACK to factor it
            ok = finite.view(-1, 1, 1)
            p_hat = torch.where(ok, torch.linalg.qr(torch.where(ok, p, 0.0)).Q, p)
        parts_p, pt = self._send(p_hat.transpose(1, 2).reshape(-1, g.m))
        qt = torch.bmm(pt.view(-1, g.rank, g.m), mb)
        parts_q, qt_deq = self._send(qt.reshape(-1, g.n))
        out = self._rebuild(g, (pt, qt_deq))
        if stateful:
            warm = self._warm(qt, g)
            for j, i in enumerate(g.indices):
                if all_finite or bool(finite[j]):
                    self._q[i] = warm[j]
        return [*parts_p, *parts_q], out, None if all_finite else finite

    def _encode_dense(self, g: Any, mb: torch.Tensor) -> tuple[list, torch.Tensor, Any]:
        """Tensors sent as they are (in the number format): parts, what the receiver gets, finite rows (None:
        all)."""
        rows = mb.view(len(g.indices), g.n)
        # fp32 sends the rows themselves: copy them, mb becomes the residual below
        parts, deq = self._send(rows.clone() if self.quantize == "fp32" else rows)
        out = self._rebuild(g, (deq,))
        finite = None if _all_finite(mb) else torch.isfinite(mb).flatten(1).all(dim=1)
        return list(parts), out, finite

    def _keep_residual(self, g: Any, mb: torch.Tensor, out: torch.Tensor, outs: list[torch.Tensor],
                       finite: Any) -> None:
        """Error feedback: what was not sent (``mb`` minus what the receiver rebuilds) is carried to the next round;
        a non-finite input does not poison later rounds."""
        if all(o.dtype == torch.float32 for o in outs):
            mb.sub_(out)
        else:
            for j, o in enumerate(outs):
                if o.dtype == torch.float32:
                    mb[j].sub_(out[j])
        if finite is not None:
            mb[~finite.to(mb.device)] = 0.0
        for j, i in enumerate(g.indices):
            self._e[i] = mb[j].view(self._shapes[i])

    def encode_staged(self, tensors):
        """``encode(tensors, stateful=True)`` whose warm starts and residuals take effect only on ``commit()``
        (the exact path commits once the all-gather succeeded)."""
        old = (self._shapes, list(self._q), list(self._e))
        body, decoded = self.encode(tensors, stateful=True)
        new = (self._shapes, list(self._q), list(self._e))
        self._shapes, self._q, self._e = old

        def commit() -> None:
            self._shapes, self._q, self._e = new

        return body, decoded, commit

    def pair_session(self, values, *, lower, peer=None) -> PairSession:
        """The pairwise round: a pair-agreed projection (see the class docstring), two messages each way.

        Args:
            values: one fp32 tensor per parameter (the pseudo-gradients); not modified.
            lower: True on the peer with the lower rank (its factors are ``lo`` when building the basis).
            peer: the peer's rank, which keys the difference basis's warm starts (None: the seeded draw, nothing
                kept).

        Raises:
            CodecError: this worker's own input holds NaN or ±Inf (nothing is sent; the mixer aborts the exchange).
            ValueError: the codec holds state for a different layout.
        """
        shapes = tuple(tuple(t.shape) for t in values)
        plan = self._plan(shapes)
        if self._shapes is not None and shapes != self._shapes:
            raise ValueError(f"LowRank holds state for {len(self._shapes)} tensors; got {len(shapes)} tensors of "
                             "another layout: one codec instance serves one parameter layout")
        fmt = _Rows(self)
        factored = [g for g in plan.groups if g.factored]
        dense = [g for g in plan.groups if not g.factored]
        difference = self.pair_basis == "difference"
        starts = self._pq.get(peer, {}) if difference and peer is not None else {}
        mats, p_rows = [], []
        for g in factored:
            dev = values[g.indices[0]].device
            x = torch.stack([values[i].detach().reshape(g.m, g.n).to(device=dev, dtype=torch.float32)
                             for i in g.indices])
            if difference:  # the pair's warm start (the seeded draw, the same on every worker, for a new peer)
                q = torch.stack([starts[i].to(dev) if i in starts else self._init_q(i, g.n, dev)
                                 for i in g.indices])
            else:
                q = torch.stack([self._start_q(i, g.n, dev) for i in g.indices])  # (B, r, n)
            p = torch.bmm(x, q.transpose(1, 2))  # (B, m, r)
            mats.append(x)
            p_rows.append(p.transpose(1, 2).reshape(-1, g.m))  # (B·r, m): one row per direction
        if not all(_all_finite(p) for p in p_rows):
            raise CodecError("this worker's pseudo-gradient holds NaN or Inf; nothing was sent")
        body, own_p = fmt.encode(p_rows)
        peer_p = yield Message(body, fmt, own_p)

        bases, b_rows = [], []
        for g, x, mine, theirs in zip(factored, mats, own_p, peer_p):
            b = len(g.indices)
            lo, hi = (mine, theirs.to(mine.device)) if lower else (theirs.to(mine.device), mine)
            if difference:  # (Δ_hi − Δ_lo) Q, orthonormalised
                basis = torch.linalg.qr((hi - lo).view(b, g.rank, g.m).transpose(1, 2)).Q
            else:
                stacked = torch.cat([lo.view(b, g.rank, g.m), hi.view(b, g.rank, g.m)], dim=1).transpose(1, 2)
                basis = _top_left_singular(stacked, g.rank)
            bases.append(basis)  # (B, m, r), identical on both peers
            b_rows.append(torch.bmm(basis.transpose(1, 2), x).reshape(-1, g.n))  # (B·r, n)
        for g in dense:
            dev = values[g.indices[0]].device
            b_rows.append(torch.stack([values[i].detach().reshape(-1).to(device=dev, dtype=torch.float32)
                                       for i in g.indices]))  # (B, n)
        if not all(_all_finite(r) for r in b_rows[len(factored):]):
            raise CodecError("this worker's pseudo-gradient holds NaN or Inf; nothing was sent")
        body, own_b = fmt.encode(b_rows)
        peer_b = yield Message(body, fmt, own_b)

        return self._pair_outcome(factored + dense, bases, own_b, b_rows, peer_b, shapes, lower, peer)

    def _pair_outcome(self, groups: list, bases: list, own_b: list, b_rows: list, peer_b: list,
                      shapes: tuple, lower: bool, peer: int | None) -> PairOutcome:
        """The pair session's end: ``c_i = ½ P̂ (B_j − B_i)`` per matrix (``½ (x_j − x_i)`` per dense tensor), the
        disagreement as transmitted, this worker's quantisation floor, and the warm starts both peers agree on."""
        difference = self.pair_basis == "difference"
        correction: list[torch.Tensor | None] = [None] * len(shapes)
        dist_sq = [0.0] * len(shapes)
        floor_sq = 0.0
        warm: dict[int, torch.Tensor] = {}
        for k, g in enumerate(groups):  # the order of the B message
            mine, sent = own_b[k], b_rows[k]
            diff = peer_b[k].to(mine.device) - mine  # B_j − B_i; the peer computes its exact negation
            floor_sq += sq_norm(mine - sent)
            b = len(g.indices)
            if g.factored:
                d3 = diff.view(b, g.rank, g.n)
                c = 0.5 * torch.bmm(bases[k], d3)  # (B, m, n) = ½ P̂ (B_j − B_i)
                theirs = peer_b[k].to(mine.device)
                # difference: Qᵀ ∝ P̂ᵀ(Δ_hi − Δ_lo), the next subspace-iteration step; the same on both peers
                step = (theirs - mine if lower else mine - theirs) if difference else mine + theirs
                new_q = self._warm(step.view(b, g.rank, g.n), g)
                for j, i in enumerate(g.indices):
                    warm[i] = new_q[j]
            else:
                d3 = diff.view(b, 1, g.n)
                c = 0.5 * d3
            for j, i in enumerate(g.indices):
                correction[i] = c[j].reshape(shapes[i])
                dist_sq[i] = sq_norm(d3[j])

        def commit() -> None:
            if self._shapes is None:
                self._shapes = shapes
                self._q = [None] * len(shapes)
                self._e = [None] * len(shapes)
            if not difference:
                for i, q in warm.items():
                    self._q[i] = q
            elif peer is not None:
                self._pq[peer] = warm
                self._pq.move_to_end(peer)
                while len(self._pq) > PAIR_PEERS:
                    self._pq.popitem(last=False)

        return PairOutcome(correction, dist_sq, math.sqrt(floor_sq), commit)

    def _start_q(self, index: int, n: int, device: torch.device) -> torch.Tensor:
        q = self._q[index] if self._q else None
        return self._init_q(index, n, device) if q is None else q.to(device)

    def _warm(self, qt: torch.Tensor, group: _Group) -> torch.Tensor:
        """Next round's starts ``(B, r, n)``: ``Qᵀ`` with unit rows (the QR of ``M Q`` does not depend on column
        scales, and unit rows keep ``M Q`` far from overflow); rows that vanished (a zero input) or overflowed
        restart from the seeded draw."""
        norms = qt.norm(dim=2, keepdim=True)
        ok = (norms > 0) & torch.isfinite(norms)
        warm = qt / torch.where(ok, norms, torch.ones_like(norms))
        if not bool(ok.all()):
            fresh = torch.stack([self._init_q(i, group.n, qt.device) for i in group.indices])
            warm = torch.where(ok, warm, fresh)
        return warm

    def _pack(self, wire: list[torch.Tensor]) -> bytes:
        head = self._header()
        if self.quantize == "int8":
            codes = [w for w in wire if w.dtype == torch.int8]
            steps = [w for w in wire if w.dtype != torch.int8]
            return b"".join((head, _flat_bytes(steps, torch.float32), _flat_bytes(codes, torch.int8)))
        if self.quantize == "bf16":
            return head + _flat_bytes(wire, torch.bfloat16)
        return head + _flat_bytes(wire, torch.float32)

    def decode(self, body, like):
        """Reconstruct tensors shaped like ``like`` from a peer's body (exact size checked first).

        Raises:
            CodecError: the body's length or header does not match this codec's configuration and ``like``.
        """
        shapes = tuple(tuple(t.shape) for t in like)
        plan = self._plan(shapes)
        expected = self.max_body_bytes(like)
        if len(body) != expected:
            raise CodecError(f"lowrank body has {len(body)} bytes, expected {expected} for {len(like)} tensors "
                             f"with rank {self.rank} and {self.quantize} numbers")
        head = bytes(body[: _HEADER.size])
        if head != self._header():
            version, fmt, rank, block, minc = _HEADER.unpack(head)
            raise CodecError(f"lowrank body was made with format version {version}, number format {fmt & 15}, "
                             f"pair basis {fmt >> 4}, rank {rank}, block {block}, min_compression {minc}; this "
                             f"worker uses version {_VERSION}, {self.quantize} ({_QUANT_CODES[self.quantize]}), "
                             f"pair basis {self.pair_basis} ({_BASIS_CODES[self.pair_basis]}), rank {self.rank}, "
                             f"block {self.block}, min_compression {self.min_compression}")
        off = _HEADER.size
        nvals, nscales = plan.nvals, plan.nscales
        if self.quantize == "int8":
            steps = torch.from_numpy(np.frombuffer(body, dtype="<f4", count=nscales, offset=off).copy())
            vals = torch.from_numpy(np.frombuffer(body, dtype=np.int8, count=nvals, offset=off + 4 * nscales).copy())
        elif self.quantize == "bf16":
            raw = np.frombuffer(body, dtype="<i2", count=nvals, offset=off).copy()
            vals = torch.from_numpy(raw).view(torch.bfloat16)
        else:
            vals = torch.from_numpy(np.frombuffer(body, dtype="<f4", count=nvals, offset=off).copy())
        out: list[torch.Tensor | None] = [None] * len(like)
        vo = so = 0
        for g in plan.groups:
            dev = like[g.indices[0]].device
            deq = []
            for rows, length in g.pieces:
                v = vals[vo : vo + rows * length].reshape(rows, length).to(dev)
                vo += rows * length
                if self.quantize == "int8":
                    ns = int8_nscales(rows, length, self.block)
                    d = steps[so : so + ns].reshape(rows, ns // rows).to(dev)
                    so += ns
                    deq.append(dequantize_int8(v, d, self.block))
                else:
                    deq.append(v.to(torch.float32).contiguous())
            rebuilt = self._rebuild(g, deq)
            for j, i in enumerate(g.indices):
                t = like[i]
                out[i] = rebuilt[j].reshape(t.shape).to(dtype=t.dtype).to(device=t.device)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Warm starts and residuals: ``{"version", "config", "shapes", "q", "e", "pair_q"}`` where ``q[i]`` is
        the ``r × n`` fp32 warm start of tensor ``i`` (None for dense tensors or before the first round), ``e[i]``
        its fp32 residual (None without error feedback or before the first round) and ``pair_q`` the difference
        basis's warm starts, ``[(peer, {i: r × n})]`` from least to most recently used. Tensors are copies."""
        def copy(ts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
            return [None if t is None else t.detach().clone() for t in ts]

        return {"version": _STATE_VERSION, "config": self.config(),
                "shapes": None if self._shapes is None else [list(s) for s in self._shapes],
                "q": copy(self._q), "e": copy(self._e),
                "pair_q": [(peer, {i: t.detach().clone() for i, t in qs.items()}) for peer, qs in self._pq.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty dict resets the state). A version 1 state (before the per-peer
        warm starts) loads with none: each pair starts its difference basis from the seeded draw.

        Raises:
            ValueError: a state of another format version or rank, or with inconsistent shapes.
        """
        if not state:
            self._reset_state()
            return
        if not isinstance(state, dict) or state.get("version") not in (1, _STATE_VERSION):
            raise ValueError(f"not a LowRank state dict of version 1 or {_STATE_VERSION}")
        rank = state.get("config", {}).get("rank")
        if rank != self.rank:
            raise ValueError(f"LowRank state was saved with rank={rank}, this codec has rank={self.rank}")
        if state["shapes"] is None:
            self._reset_state()
            return
        shapes = tuple(tuple(int(d) for d in s) for s in state["shapes"])
        q, e = list(state["q"]), list(state["e"])
        if not len(q) == len(e) == len(shapes):
            raise ValueError(f"LowRank state lists {len(shapes)} shapes but {len(q)} warm starts and "
                             f"{len(e)} residuals")
        plan = self._plan(shapes)
        n_of = {i: g.n for g in plan.groups if g.factored for i in g.indices}
        for i, (qi, ei) in enumerate(zip(q, e)):
            want = (self.rank, n_of[i]) if i in n_of else None
            if qi is not None and (want is None or tuple(qi.shape) != want):
                raise ValueError(f"LowRank state: warm start {i} has shape {tuple(qi.shape)}, expected {want}")
            if ei is not None and tuple(ei.shape) != shapes[i]:
                raise ValueError(f"LowRank state: residual {i} has shape {tuple(ei.shape)}, expected {shapes[i]}")
        pair_q: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()
        for peer, qs in state.get("pair_q", []):
            for i, qi in qs.items():
                if i not in n_of or tuple(qi.shape) != (self.rank, n_of[i]):
                    raise ValueError(f"LowRank state: the warm start of tensor {i} for peer {peer} has shape "
                                     f"{tuple(qi.shape)}, expected {(self.rank, n_of.get(i))}")
            pair_q[int(peer)] = {int(i): qi.detach().to(torch.float32).clone() for i, qi in qs.items()}
        self._shapes = shapes
        self._q = [None if t is None else t.detach().to(torch.float32).clone() for t in q]
        self._e = [None if t is None else t.detach().to(torch.float32).clone() for t in e]
        self._pq = pair_q


def _top_left_singular(stacked: torch.Tensor, r: int) -> torch.Tensor:
    """``(B, m, r)``: the top-``r`` left singular vectors of each ``(m, 2r)`` matrix of ``stacked`` (QR, then the
    SVD of the small ``R``). Deterministic: the same input gives bit-identical output on the same build."""
    q, rr = torch.linalg.qr(stacked)  # q: (B, m, k), rr: (B, k, 2r), k = min(m, 2r) > r
    u, _, _ = torch.linalg.svd(rr, full_matrices=False)  # (B, k, k)
    return torch.bmm(q, u[:, :, :r])


class _Rows(Codec):
    """The messages of :meth:`LowRank.pair_session`: a list of fp32 row matrices ``(R, L)`` in the codec's number
    format (int8 with one scale per ``block`` elements of each row, bf16 or fp32), behind LowRank's header.

    Frames of these messages carry LowRank's codec id; the header check rejects a peer of another configuration.
    """

    name = "lowrank"

    def __init__(self, codec: LowRank):
        self.codec_id = codec.codec_id
        self.lowrank = codec
        self.shuffle = codec.shuffle

    def max_body_bytes(self, like):
        lr = self.lowrank
        nvals = sum(t.numel() for t in like)
        if lr.quantize == "int8":
            return _HEADER.size + nvals + 4 * sum(int8_nscales(t.shape[0], t.shape[1], lr.block) for t in like)
        return _HEADER.size + (2 if lr.quantize == "bf16" else 4) * nvals

    def encode(self, tensors, *, stateful=False):
        wire, decoded = [], []
        for rows in tensors:
            parts, deq = self.lowrank._send(rows.to(torch.float32))
            wire += list(parts)
            decoded.append(deq)
        return self.lowrank._pack(wire), decoded

    def decode(self, body, like):
        lr = self.lowrank
        expected = self.max_body_bytes(like)
        if len(body) != expected:
            raise CodecError(f"lowrank pair message has {len(body)} bytes, expected {expected}")
        if bytes(body[: _HEADER.size]) != lr._header():
            raise CodecError("lowrank pair message was made with another format version, number format, pair "
                             f"basis, rank, block or min_compression than this worker's ({lr.config()})")
        off = _HEADER.size
        nvals = sum(t.numel() for t in like)
        out = []
        if lr.quantize == "int8":
            nscales = sum(int8_nscales(t.shape[0], t.shape[1], lr.block) for t in like)
            steps = torch.from_numpy(np.frombuffer(body, dtype="<f4", count=nscales, offset=off).copy())
            vals = torch.from_numpy(np.frombuffer(body, dtype=np.int8, count=nvals, offset=off + 4 * nscales).copy())
            vo = so = 0
            for t in like:
                rows, length = t.shape
                ns = int8_nscales(rows, length, lr.block)
                v = vals[vo : vo + rows * length].reshape(rows, length).to(t.device)
                d = steps[so : so + ns].reshape(rows, ns // rows if rows else 0).to(t.device)
                out.append(dequantize_int8(v, d, lr.block))
                vo += rows * length
                so += ns
            return out
        if lr.quantize == "bf16":
            raw = np.frombuffer(body, dtype="<i2", count=nvals, offset=off).copy()
            vals = torch.from_numpy(raw).view(torch.bfloat16).to(torch.float32)
        else:
            vals = torch.from_numpy(np.frombuffer(body, dtype="<f4", count=nvals, offset=off).copy())
        vo = 0
        for t in like:
            out.append(vals[vo : vo + t.numel()].reshape(t.shape).to(t.device).contiguous())
            vo += t.numel()
        return out


def _flat_bytes(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> bytes:
    if not parts:
        return b""
    flat = torch.cat([p.reshape(-1).to(dtype) for p in parts]).cpu()
    if dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes()
