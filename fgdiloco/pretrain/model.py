"""A small nanoGPT-style decoder-only transformer (after Karpathy's nanoGPT, MIT) for the pretraining examples.

Pre-norm blocks of causal self-attention (``scaled_dot_product_attention(is_causal=True)``) and a 4x GELU MLP,
learned position embeddings, the token embedding tied to the output head, and GPT-2's initialisation (normal
0.02, residual projections scaled by ``1/sqrt(2 * n_layer)``).

``GPT(config, subspace_rank=k, subspace_stages=S)`` is the same network reparametrised after Ramasinghe et al.,
"Subspace Networks" (arXiv 2506.01260) so that its residual stream is in ``E_fix[tokens] + span(U)`` exactly
wherever :meth:`GPT.split` ``(S)`` cuts it, and crosses each pipeline-stage boundary as k numbers per token
(:mod:`fgdiloco.pipeline.subspace`); the blocks after the last boundary write freely. See :class:`GPT`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..pipeline.subspace import (
    Residual,
    SubspaceActivationCodec,
    SubspaceBasis,
    SubspaceCodec,
    SubspaceError,
    compute_dtype,
    default_tolerance,
    fixed_embedding,
    orthonormal_basis,
)

SUBSPACE_HEADS = ("dense", "subspace")

__all__ = ["GPT", "GPTConfig", "GPTStage", "StageEmbedding", "SubspaceLinear", "SubspacePositionEmbedding",
           "SubspaceTiedHead", "SubspaceTokenEmbedding", "activation_codec_for", "build_stage", "fragments_of",
           "lm_loss", "stage_layers", "two_stage_loss", "two_stage_step"]


def stage_layers(n_layer: int, stages: int) -> list[range]:
    """The blocks of each of ``stages`` pipeline stages of an ``n_layer``-block model, as :meth:`GPT.split` cuts
    them: as even as possible, the earlier stages taking one more block when ``stages`` does not divide
    ``n_layer``. E.g. ``stage_layers(4, 2) == [range(0, 2), range(2, 4)]``; the boundaries are after blocks
    ``r.stop - 1`` of every range but the last.

    Raises:
        TypeError: an argument not an int.
        ValueError: ``n_layer < 1`` or ``stages`` outside ``[1, n_layer]``.
    """
    for name, value in (("n_layer", n_layer), ("stages", stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if n_layer < 1 or not 1 <= stages <= n_layer:
        raise ValueError(f"stages must be in [1, n_layer={n_layer}] (every stage holds at least one block), got "
                         f"{stages}")
    per, extra = divmod(n_layer, stages)
    out, start = [], 0
    for s in range(stages):
        stop = start + per + (1 if s < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


@dataclass
class GPTConfig:
    """Size of a :class:`GPT`.

    Args:
        vocab_size: number of token ids (the tokenizer's ``vocab_size``).
        block_size: longest sequence the position embedding covers.
        n_layer: transformer blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        n_embd: width of the residual stream.
        dropout: dropout probability (attention, residual and embedding); 0 for short pretraining runs.
    """

    vocab_size: int
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an int >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``forward(idx, targets=None)`` takes token ids ``[B, T]`` (``T <= block_size``) and returns
    ``(logits [B, T, vocab_size], loss)``, where ``loss`` is the mean next-token cross-entropy in nats against
    ``targets`` (``[B, T]``), or ``None`` without targets.

    **Subspace option** (``subspace_rank=k``; Ramasinghe et al., "Subspace Networks", arXiv 2506.01260). Every
    write into the residual stream that reaches a pipeline-stage boundary goes through one fixed orthonormal basis
    ``U`` (``d × k``, ``d = n_embd``, seeded by ``subspace_seed``, identical on every process):

    * attention and MLP output projections of the constrained blocks (:attr:`subspace_layers`): ``W = U Z`` with
      ``Z`` trainable (``k × in``), bias ``U z_b`` (:class:`SubspaceLinear`; the parameters keep their names
      ``c_proj.weight`` / ``c_proj.bias``);
    * position embedding ``U Z_pos`` (``Z_pos``: ``block_size × k``);
    * token embedding ``E_fix + Z_tok Uᵀ`` with ``E_fix`` (``vocab × d``) a frozen seeded ``N(0, 0.02²)`` table
      carrying the token-specific part in all d dimensions, ``Z_tok`` (``vocab × k``) trainable, zero at
      initialisation (so the initial embedding is distributed as the plain model's); the tied output head uses
      the same combined embedding (:meth:`split` unties it for ``S > 1`` and makes it dense by default).

    **What is constrained: only what crosses** (``subspace_stages``). The stream is additive: after block ``i`` it
    is ``E_tok[t] + P[pos] + Σ_{j <= i} (attn_j + mlp_j)``, and nothing ever removes a write. A boundary after
    block ``b`` can therefore send ``x = E_fix[tokens] + U c`` exactly iff *every* write before it, in every earlier
    stage and not only in the sending one, lies in ``span(U)``: a write of the second stage that left the
    subspace would still be in the stream at the third stage's boundary, so the blocks between two boundaries need
    the constraint as much as the first stage's. What is written after the **last** boundary never crosses one:
    those blocks (every block of the last stage) and the head write freely in all d dimensions, as plain blocks.
    **One basis for all boundaries**, not one per boundary: with a basis ``U_b`` per boundary the stream at
    boundary ``b`` would hold ``U_1 c_1 + ... + U_b c_b``, of rank up to ``b·k``; sending k numbers there needs
    every earlier span inside ``span(U_b)`` (so one shared span), or a stage that re-expresses the stream it
    received in a new basis, which drops what lies outside it: a lossy projection, not this lossless codec.

    * ``subspace_stages=S`` (int in ``[2, n_layer]``): the model is meant to be cut by :meth:`split` ``(S)``.
      The embeddings and the blocks before the last stage (:attr:`subspace_layers`, ``range(0, c)`` with ``c`` the
      last stage's first block, :func:`stage_layers`) are constrained, blocks ``c..n_layer-1`` are plain. A split
      into ``S'`` stages is lossless when its last boundary is at or before ``c`` (``S' = S``, ``S' = 1``, or e.g.
      ``split(2)`` of a 6-block model built for 3 stages); :meth:`split` refuses the others.
    * ``subspace_stages=None`` (default): every block is constrained (``c = n_layer``): the stream is in the
      subspace after every block, any split is lossless; the most constrained model (for a single-process run
      that measures the constraint without knowing the split).

    So at every boundary the model can be cut at, ``x = E_fix[tokens] + U c`` exactly (to float rounding:
    :meth:`subspace_residual`, :meth:`check_subspace`), and :meth:`subspace_codec` gives the codec that sends
    ``c``. ``U`` and ``E_fix`` are buffers (in ``state_dict``, never parameters): no optimizer, gossip or
    pseudo-gradient sees them. Dropout acts on the trainable coefficients (``Z``'s outputs, ``Z_tok[t]``,
    ``Z_pos[p]``), which keeps the stream in the subspace. ``Z`` is initialised as the projection ``UᵀW`` of the
    plain initialisation (same std), so ``subspace_rank=n_embd`` spans exactly the plain model's function class
    (:meth:`load_plain` maps a plain model's weights in; for ``k < d`` it gives the orthogonal projection).
    ``subspace_rank=None`` is the plain model, unchanged (the same code path; pinned by a numeric fixture).

    **Stage embeddings** (``stage_embeddings=True``, with ``subspace_stages=S``). The token ids are on every stage
    anyway (the first embeds them, the last needs the targets, the codec adds ``E_fix[tokens]``), so every stage
    ``s`` re-embeds them with its own trainable, full-rank token and position embedding ``L_s[tokens] + Q_s[pos]``
    (:class:`StageEmbedding`, ``vocab × d`` and ``block_size × d``, drawn like the plain model's): the stage adds
    it to the stream it received before its first block and, on every stage but the last, removes it again after
    its last block, so what crosses a boundary is still ``E_fix[tokens] + U c`` (the same k numbers per token; the
    boundary stays lossless) while every stage's blocks read a token embedding that trains in all d dimensions.
    Without them the token-specific part of the stream is the frozen ``E_fix`` plus k trained dimensions, which is
    what the subspace model loses most by (``benchmarks/subspace.py``; docs/pipelines.md quotes it). Every stage
    after the first reads ``E_fix[tokens] + g_s · U c`` (:meth:`StageEmbedding.admit`): its gate ``g_s``, a
    trainable scalar, is zero at initialisation, so the stage starts from its own embedding and blocks and takes
    in what crosses the boundary as it proves useful; the stream stays in ``E_fix[tokens] + span(U)``. It adds
    ``S · (vocab + block_size) · d + S − 1`` parameters; in the unsplit model stage ``s`` is the blocks of
    :func:`stage_layers` ``(n_layer, S)[s]``.

    Args:
        config: the sizes (:class:`GPTConfig`).
        subspace_rank: k, the rank of the residual-stream subspace (int in [1, n_embd]), or None (plain model).
        subspace_seed: seed of ``U`` and ``E_fix`` (int in [0, 2**63)); every stage and replica must share it.
        subspace_stages: the number of pipeline stages the model will be split into (int in ``[2, n_layer]``:
            the last stage's blocks write freely), or None (every block constrained); ignored without
            ``subspace_rank``.
        stage_embeddings: whether every stage re-embeds the tokens (bool, see above); needs ``subspace_rank`` and
            ``subspace_stages``.

    Attributes:
        subspace_layers: the constrained blocks, ``range(0, c)`` (``range(0)`` for a plain model).
        stage_embeddings: the :class:`StageEmbedding` of each stage (``nn.ModuleList``), or None.

    Raises:
        TypeError, ValueError: ``subspace_rank``, ``subspace_seed``, ``subspace_stages`` or ``stage_embeddings``
            out of range (before anything is built).
    """

    def __init__(self, config: GPTConfig, subspace_rank: int | None = None, subspace_seed: int = 0,
                 subspace_stages: int | None = None, stage_embeddings: bool = False):
        super().__init__()
        _check_subspace_args(config, subspace_rank, subspace_seed, subspace_stages, stage_embeddings)
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.subspace_rank = subspace_rank
        self.subspace_seed = subspace_seed
        self.subspace_stages = subspace_stages if subspace_rank is not None else None
        self.subspace_layers = _constrained_layers(config.n_layer, subspace_rank, self.subspace_stages)
        if subspace_rank is not None:
            _reparametrise(self, subspace_rank, subspace_seed, self.subspace_layers)
        self.stage_embeddings = (nn.ModuleList(StageEmbedding(config, gated=s > 0) for s in range(subspace_stages))
                                 if stage_embeddings else None)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameter count (tied weights once); without the position embedding when ``non_embedding``."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def split(self, stages: int, *, subspace_head: str = "dense") -> list[GPTStage]:
        """This model as ``stages`` pipeline stages (for :class:`fgdiloco.pipeline.Pipeline`).

        Stage 0 holds the token and position embeddings and the first blocks, the last stage the last blocks, the
        final LayerNorm and the head; the blocks are spread as evenly as possible, earlier stages taking one more
        when they do not divide. Chained, the stages compute exactly this model's logits at split time:
        ``stage[-1](...stage[1](stage[0](idx)))`` equals ``self(idx)[0]``. The stages hold copies: training them
        does not change this model.

        The tied token embedding / head is **untied** when ``stages > 1``: the head starts as a copy of the
        embedding, and the two then train as separate matrices. Keeping the tie across stages would need a sum
        of the two gradients between the first and the last stage at every step (as Megatron-LM's embedding group
        does), a per-step collective across the pipeline that this example does not pay; both matrices are
        gossiped with their own stage. ``stages=1`` keeps the tie.

        **Subspace models** (``subspace_rank=k``) split the same way: stage 0 holds ``E_fix + Z_tok Uᵀ`` and
        ``U Z_pos``, every stage its blocks (``W = U Z`` output projections in :attr:`subspace_layers`, plain ones
        after them: with ``subspace_stages=S`` every block of the last stage), the last the head. Every boundary of
        the split must lie within the constrained blocks (see :class:`GPT`), else ``ValueError``. Every stage
        keeps its own copy of the fixed ``U`` and ``E_fix`` as buffers ``stage.U`` / ``stage.E_fix`` (identical
        bits on every stage; shared by the stage's modules, never parameters), which its boundary codec uses
        (:func:`activation_codec_for`): the stream crosses a boundary as ``c`` (``[B, T, k]``). The tie of the
        head, untied for ``S > 1`` for the same reason as the plain model's (no per-step gradient sum between the
        first and the last stage), is by default (``subspace_head="dense"``) a plain ``vocab × d`` linear map
        initialised to the combined embedding ``E_fix + Z_tok Uᵀ`` (same logits at split time) and trained in all
        d dimensions: the head only *reads* the residual stream, writing nothing into it, so the subspace need
        not constrain it once the tie is broken. ``subspace_head="subspace"`` keeps the tied form's constraint
        instead (:class:`SubspaceTiedHead` over the last stage's ``E_fix`` / ``U`` with its own copy of
        ``Z_tok``: only ``vocab × k`` numbers train). ``stages=1`` keeps the tie (and the constraint).

        Args:
            stages: S, an int in ``[1, n_layer]``.
            subspace_head: ``"dense"`` or ``"subspace"``: the last stage's head of a subspace model for S > 1
                (see above; ignored for a plain model and for S = 1).

        Returns:
            ``S`` :class:`GPTStage` modules: stage 0 takes token ids ``[B, T]``, every other stage the residual
            stream ``[B, T, n_embd]`` (float32); the last returns logits ``[B, T, vocab_size]``, the others the
            residual stream. Use :func:`lm_loss` as the pipeline's loss and :func:`activation_codec_for` as its
            ``activation_codec`` (None for a plain model).

        Raises:
            TypeError: ``stages`` not an int.
            ValueError: ``stages`` outside ``[1, n_layer]``, ``subspace_head`` not ``"dense"`` / ``"subspace"``, a
                boundary after a block that writes freely (a subspace model built for another split), a model
                with stage embeddings split into another number of stages than it was built for.
        """
        if isinstance(stages, bool) or not isinstance(stages, int):
            raise TypeError(f"stages must be an int in [1, n_layer={self.config.n_layer}], got "
                            f"{type(stages).__name__}")
        if not 1 <= stages <= self.config.n_layer:
            raise ValueError(f"stages must be in [1, n_layer={self.config.n_layer}] (every stage holds at least "
                             f"one block), got {stages}")
        if subspace_head not in SUBSPACE_HEADS:
            raise ValueError(f"subspace_head must be one of {SUBSPACE_HEADS}, got {subspace_head!r}")
        if self.stage_embeddings is not None and stages != len(self.stage_embeddings):
            raise ValueError(f"this model has one stage embedding per stage of split({len(self.stage_embeddings)}) "
                             f"(stage_embeddings=True, subspace_stages={self.subspace_stages}); split({stages}) "
                             f"would move blocks away from their stage's embedding: split it into "
                             f"{len(self.stage_embeddings)} stages")
        layers = stage_layers(self.config.n_layer, stages)
        last_boundary = layers[-1].start  # the stream crosses after blocks r.stop - 1 of every stage but the last
        if self.subspace_rank is not None and last_boundary > self.subspace_layers.stop:
            last_constrained = self.subspace_layers.stop - 1
            raise ValueError(f"split({stages}) cuts the stream after block {last_boundary - 1}, but this model "
                             f"(subspace_stages={self.subspace_stages}) constrains only blocks 0..{last_constrained} "
                             f"to the subspace: the blocks after them write outside span(U), so that boundary "
                             f"would lose information. Split it into {self.subspace_stages} stages, or build the "
                             f"model with subspace_stages={stages}")
        return [GPTStage(self, s, stages, r, subspace_head=subspace_head) for s, r in enumerate(layers)]

    def activation_codec(self, *, check: bool = True, tol: float | None = None) -> SubspaceActivationCodec | None:
        """:func:`activation_codec_for` this model: the pipeline codec of its subspace, None for a plain model."""
        return activation_codec_for(self, check=check, tol=tol)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, seq_len = idx.shape
        if seq_len > self.config.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq_len, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        if self.stage_embeddings is None:
            for block in self.transformer.h:
                x = block(x)
        else:
            x = _through_stages(self, x, idx)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    # ------------------------------------------------------------------------------------------ subspace option
    def subspace_codec(self, *, check: bool = True, tol: float | None = None) -> SubspaceCodec:
        """The activation codec of this model's subspace (its ``U`` and ``E_fix`` buffers, not copied).

        Raises:
            RuntimeError: the model was built without ``subspace_rank``.
        """
        return _subspace_codec(self, check=check, tol=tol)

    def subspace_residual(self, idx: torch.Tensor) -> list[tuple[str, Residual]]:
        """Run ``idx`` (``[B, T]``) forward without gradients and measure the residual stream's component outside
        ``E_fix[idx] + span(U)`` at every block boundary: ``[("embedding", r), ("block 0", r), ...]`` (the input
        of block 0, then the output of each block), each a :class:`~fgdiloco.pipeline.subspace.Residual`. The
        outputs of the blocks that write freely (after :attr:`subspace_layers`) are labelled ``"block i (free)"``:
        they are expected outside the subspace.

        Raises:
            RuntimeError: the model was built without ``subspace_rank``.
        """
        return _subspace_residual(self, idx)

    def check_subspace(self, idx: torch.Tensor, tol: float | None = None) -> list[tuple[str, Residual]]:
        """:meth:`subspace_residual`, raising :class:`~fgdiloco.pipeline.subspace.SubspaceError` naming the first
        constrained boundary (the embedding and the outputs of :attr:`subspace_layers`; the free blocks' outputs
        are not checked) whose out-of-subspace component exceeds ``tol`` (default: float rounding of the stream's
        dtype, or of the autocast dtype when called under autocast), e.g. after a user replaced a projection with
        a module that writes outside ``span(U)``."""
        return _check_subspace(self, idx, tol)

    def load_plain(self, plain: GPT | dict[str, torch.Tensor]) -> None:
        """Load a plain GPT's weights (a :class:`GPT` built without ``subspace_rank`` or its ``state_dict``) into
        this reparametrised one: every residual-stream write is projected onto ``span(U)`` (``Z = UᵀW``,
        ``z_b = Uᵀb``, ``Z_pos = W_pos U``, ``Z_tok = (W_tok − E_fix) U``), everything else is copied (stage
        embeddings, which a plain model lacks, keep their values). Exact for ``subspace_rank = n_embd`` without
        stage embeddings (same logits), the orthogonal projection otherwise.

        Raises:
            RuntimeError: this model was built without ``subspace_rank``.
            ValueError: ``plain`` does not have this model's configuration.
        """
        _load_plain(self, plain)


# ---------------------------------------------------------------------------------------------- subspace option
# The subspace reparametrisation (GPT(..., subspace_rank=k)) is self-contained below: the GPT above only calls
# _check_subspace_args / _reparametrise at construction and delegates its subspace methods here.


class StageEmbedding(nn.Module):
    """A stage's own token and position embedding (``GPT(..., stage_embeddings=True)``): ``forward(idx [B, T]) ->
    dropout(L[idx] + Q[0..T-1])`` (``[B, T, d]``), ``L`` = ``wte`` (``vocab × d``), ``Q`` = ``wpe``
    (``block_size × d``), both trainable, initialised ``N(0, 0.02²)`` as the plain model's embeddings.

    A stage that receives a stream (every stage but the first: ``gated=True``) also has ``gate``, a trainable scalar,
    zero at initialisation: :meth:`admit` scales the received coefficients' part of the stream by it, so the stage
    starts as a model of its own blocks and embedding and takes in what the stages before it send as training finds
    it useful (what the first stage writes is otherwise about 20x the norm of the stage's own embedding by the end
    of training, which drowns it after the blocks' LayerNorms; ``benchmarks/subspace.py`` measures both). With more
    than two stages the gates open from the last backwards: a stage's gate gets a gradient once the gates after it
    are open."""

    def __init__(self, config: GPTConfig, gated: bool = False):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        for e in (self.wte, self.wpe):
            nn.init.normal_(e.weight, mean=0.0, std=0.02)
        self.gate = nn.Parameter(torch.zeros(())) if gated else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[-1], dtype=torch.long, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        # a checkpoint from before the gate: a gate of 1 admits the stream as it is, the model it was saved from
        if self.gate is not None and prefix + "gate" not in state_dict:
            state_dict[prefix + "gate"] = torch.ones(())
        super()._load_from_state_dict(state_dict, prefix, *args)

    def admit(self, x: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
        """The stream this stage reads from the received ``x = E_fix[tokens] + U c`` (``[B, T, d]``; ``fixed`` is
        ``E_fix[tokens]``): ``fixed + gate · U c``, still in ``E_fix[tokens] + span(U)``, so a middle stage's
        boundary stays lossless. Without a gate, ``x`` itself."""
        return x if self.gate is None else fixed + self.gate * (x - fixed)


def _stage_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, local: torch.Tensor | None,
                  last: bool) -> torch.Tensor:
    """One stage's blocks on the stream ``x``: with a stage embedding ``local`` it is added first and, on every stage
    but the last, taken out again after the blocks, so only ``E_fix[tokens] + U c`` reaches the boundary."""
    if local is not None:
        x = x + local
    for block in blocks:
        x = block(x)
    return x if local is None or last else x - local


def _through_stages(gpt: GPT, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The blocks of a GPT with stage embeddings, stage by stage as the split stages run them."""
    ranges = stage_layers(gpt.config.n_layer, len(gpt.stage_embeddings))
    fixed = F.embedding(idx, gpt.transformer.wte.E_fix)
    for s, r in enumerate(ranges):
        embedding = gpt.stage_embeddings[s]
        x = _stage_blocks((gpt.transformer.h[i] for i in r), embedding.admit(x, fixed), embedding(idx),
                          s == len(ranges) - 1)
    return x


class SubspaceLinear(nn.Module):
    """``y ↦ U (dropout(Z y + z_b))``: a linear map that writes only into ``span(U)``.

    ``Z`` is ``weight`` (``k × in_features``), ``z_b`` is ``bias`` (``k``; optional), ``U`` the ``d × k`` buffer.
    Input ``[..., in_features]``, output ``[..., d]``; ``in·k + k·d`` multiply-adds per token (the plain linear:
    ``in·d``). Dropout (``p``) acts on the k coefficients so the output stays in ``span(U)``.
    """

    def __init__(self, in_features: int, U: torch.Tensor, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        d, k = U.shape
        self.in_features, self.d, self.k = in_features, d, k
        self.weight = nn.Parameter(torch.empty(k, in_features))
        self.bias = nn.Parameter(torch.zeros(k)) if bias else None
        self.register_buffer("U", U)
        self.dropout = nn.Dropout(dropout)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.dropout(F.linear(y, self.weight, self.bias)) @ self.U.T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, d={self.d}, k={self.k}, bias={self.bias is not None}"


class SubspaceTokenEmbedding(nn.Module):
    """Token embedding ``E_fix + Z_tok Uᵀ``: ``forward(idx [...]) -> E_fix[idx] + U dropout(Z_tok[idx])``
    (``[..., d]``). ``weight`` is ``Z_tok`` (``vocab × k``, trainable); ``E_fix`` (``vocab × d``) and ``U``
    (``d × k``) are buffers."""

    def __init__(self, E_fix: torch.Tensor, U: torch.Tensor, dropout: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E_fix.shape[0], U.shape[1]))
        self.register_buffer("E_fix", E_fix)
        self.register_buffer("U", U)
        self.dropout = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.E_fix) + self.dropout(F.embedding(idx, self.weight)) @ self.U.T

    def extra_repr(self) -> str:
        return f"vocab_size={self.E_fix.shape[0]}, d={self.U.shape[0]}, k={self.U.shape[1]}"


class SubspacePositionEmbedding(nn.Module):
    """Position embedding ``U Z_pos``: ``forward(pos [T]) -> U dropout(Z_pos[pos])`` (``[T, d]``). ``weight`` is
    ``Z_pos`` (``block_size × k``, trainable); ``U`` a buffer."""

    def __init__(self, block_size: int, U: torch.Tensor, dropout: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(block_size, U.shape[1]))
        self.register_buffer("U", U)
        self.dropout = nn.Dropout(dropout)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.dropout(F.embedding(pos, self.weight)) @ self.U.T


class SubspaceTiedHead(nn.Module):
    """Output head tied to a :class:`SubspaceTokenEmbedding`: ``h [..., d] -> h (E_fix + Z_tok Uᵀ)ᵀ`` (logits
    ``[..., vocab]``), computed as ``h E_fixᵀ + (h U) Z_tokᵀ``. ``weight`` is the embedding's ``Z_tok`` Parameter
    (shared, as in the plain model's tying); ``E_fix`` and ``U`` are the embedding's buffers."""

    def __init__(self, embedding: SubspaceTokenEmbedding):
        super().__init__()
        self.weight = embedding.weight
        self.register_buffer("E_fix", embedding.E_fix)
        self.register_buffer("U", embedding.U)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.E_fix) + F.linear(h @ self.U, self.weight)


def _check_subspace_args(config: GPTConfig, subspace_rank: int | None, subspace_seed: int,
                         subspace_stages: int | None = None, stage_embeddings: bool = False) -> None:
    if subspace_rank is not None:
        if isinstance(subspace_rank, bool) or not isinstance(subspace_rank, int):
            raise TypeError(f"subspace_rank must be None or an int in [1, n_embd={config.n_embd}], got "
                            f"{type(subspace_rank).__name__}")
        if not 1 <= subspace_rank <= config.n_embd:
            raise ValueError(f"subspace_rank must be None or an int in [1, n_embd={config.n_embd}], got "
                             f"{subspace_rank}")
    if isinstance(subspace_seed, bool) or not isinstance(subspace_seed, int):
        raise TypeError(f"subspace_seed must be an int in [0, 2**63), got {type(subspace_seed).__name__}")
    if not 0 <= subspace_seed < 1 << 63:
        raise ValueError(f"subspace_seed must be an int in [0, 2**63), got {subspace_seed}")
    if subspace_stages is not None:
        allowed = f"None or an int in [2, n_layer={config.n_layer}] (the stages GPT.split will cut the model into)"
        if isinstance(subspace_stages, bool) or not isinstance(subspace_stages, int):
            raise TypeError(f"subspace_stages must be {allowed}, got {type(subspace_stages).__name__}")
        if not 2 <= subspace_stages <= config.n_layer:
            hint = ("; one stage has no boundary to compress: use subspace_stages=None to constrain every block, "
                    "or subspace_rank=None" if subspace_stages == 1 else "")
            raise ValueError(f"subspace_stages must be {allowed}, got {subspace_stages}{hint}")
    if not isinstance(stage_embeddings, bool):
        raise TypeError(f"stage_embeddings must be a bool, got {type(stage_embeddings).__name__}")
    if stage_embeddings and (subspace_rank is None or subspace_stages is None):
        raise ValueError(f"stage_embeddings=True needs subspace_rank and subspace_stages (each stage of the split "
                         f"re-embeds the tokens), got subspace_rank={subspace_rank!r}, "
                         f"subspace_stages={subspace_stages!r}")


def _constrained_layers(n_layer: int, subspace_rank: int | None, subspace_stages: int | None) -> range:
    """The blocks whose writes must stay in ``span(U)``: those before the last stage of ``split(subspace_stages)``
    (every block when it is None), none for a plain model."""
    if subspace_rank is None:
        return range(0)
    if subspace_stages is None:
        return range(n_layer)
    return range(stage_layers(n_layer, subspace_stages)[-1].start)


def _reparametrise(gpt: GPT, k: int, seed: int, layers: range) -> None:
    """Swap the residual-stream writers of a freshly built plain ``gpt`` that reach a boundary (the embeddings and
    the blocks in ``layers``) for their subspace form (see :class:`GPT`); the other blocks stay plain. New
    parameters are drawn from the global RNG (after the plain initialisation), ``U`` / ``E_fix`` from their own
    seeded generators."""
    cfg = gpt.config
    U = orthonormal_basis(cfg.n_embd, k, seed)
    E_fix = fixed_embedding(cfg.vocab_size, cfg.n_embd, seed, std=0.02)
    t = gpt.transformer
    t.wte = SubspaceTokenEmbedding(E_fix, U, cfg.dropout)
    t.wpe = SubspacePositionEmbedding(cfg.block_size, U, cfg.dropout)
    t.drop = nn.Identity()  # embedding dropout acts on the coefficients inside wte / wpe
    gpt.lm_head = SubspaceTiedHead(t.wte)
    std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for block in (t.h[i] for i in layers):
        block.attn.c_proj = SubspaceLinear(cfg.n_embd, U, dropout=cfg.dropout)
        block.attn.resid_dropout = nn.Identity()
        block.mlp.c_proj = SubspaceLinear(4 * cfg.n_embd, U, dropout=cfg.dropout)
        block.mlp.dropout = nn.Identity()
        for proj in (block.attn.c_proj, block.mlp.c_proj):
            nn.init.normal_(proj.weight, mean=0.0, std=std)


def _require_subspace(gpt: GPT) -> SubspaceTokenEmbedding:
    wte = gpt.transformer.wte
    if gpt.subspace_rank is None or not isinstance(wte, SubspaceTokenEmbedding):
        raise RuntimeError("this GPT was built without subspace_rank: it has no residual-stream subspace "
                           "(build it as GPT(config, subspace_rank=k))")
    return wte


def _subspace_codec(gpt: GPT, *, check: bool, tol: float | None) -> SubspaceCodec:
    wte = _require_subspace(gpt)
    return SubspaceCodec(SubspaceBasis.from_tensor(wte.U, gpt.subspace_seed), wte.E_fix, check=check, tol=tol)


def _subspace_residual(gpt: GPT, idx: torch.Tensor) -> list[tuple[str, Residual]]:
    codec = _subspace_codec(gpt, check=False, tol=None)
    streams: list[tuple[str, torch.Tensor]] = []
    blocks = gpt.transformer.h
    # with stage embeddings a stage's blocks see the stream plus that stage's own embedding, which never crosses
    # a boundary: it is taken out before the stream is measured
    local: dict[int, torch.Tensor] = {}
    stage_of = [0] * len(blocks)
    if gpt.stage_embeddings is not None:
        for s, r in enumerate(stage_layers(len(blocks), len(gpt.stage_embeddings))):
            for i in r:
                stage_of[i] = s
        local = {s: torch.zeros(()) for s in range(len(gpt.stage_embeddings))}
    hooks = [emb.register_forward_hook(lambda m, args, out, s=s: local.__setitem__(s, out))
             for s, emb in enumerate(gpt.stage_embeddings or [])]
    hooks.append(blocks[0].register_forward_pre_hook(
        lambda m, args: streams.append(("embedding", args[0] - local.get(0, 0)))))
    for i, block in enumerate(blocks):
        where = f"block {i}" if i in gpt.subspace_layers else f"block {i} (free)"
        hooks.append(block.register_forward_hook(
            lambda m, args, out, w=where, i=i: streams.append((w, out - local.get(stage_of[i], 0)))))
    try:
        with torch.no_grad():
            gpt(idx)
    finally:
        for h in hooks:
            h.remove()
    return [(where, codec.residual(x, idx)) for where, x in streams]


def _check_subspace(gpt: GPT, idx: torch.Tensor, tol: float | None) -> list[tuple[str, Residual]]:
    codec = _subspace_codec(gpt, check=True, tol=tol)
    found = _subspace_residual(gpt, idx)
    for where, res in found:
        if where.endswith("(free)"):
            continue  # written after the last boundary: never sent, never constrained
        limit = codec.tol if codec.tol is not None else default_tolerance(compute_dtype(gpt.transformer.wte.E_fix))
        if not res.max_relative <= limit:
            raise SubspaceError(
                f"the residual stream after {where} is outside E_fix[tokens] + span(U): out-of-subspace component "
                f"{res.max_relative:.3g} of ‖x‖ (per token, max) exceeds the tolerance {limit:.3g}. A module in or "
                f"before {where} writes into the residual stream without going through U (every write must be "
                f"U·(something), e.g. SubspaceLinear); the stream cannot be compressed to k={gpt.subspace_rank} "
                f"coefficients there")
    return found


def _load_plain(gpt: GPT, plain: GPT | dict[str, torch.Tensor]) -> None:
    wte = _require_subspace(gpt)
    state = plain.state_dict() if isinstance(plain, nn.Module) else dict(plain)
    if isinstance(plain, GPT) and plain.subspace_rank is not None:
        raise ValueError("plain must be a GPT built without subspace_rank (or its state_dict)")
    U = wte.U.detach().double()
    E_fix = wte.E_fix.detach().double()
    own = gpt.state_dict()
    projected: dict[str, torch.Tensor] = {}
    frozen: set[str] = set()
    for name, module in gpt.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, (SubspaceLinear, SubspaceTokenEmbedding, SubspacePositionEmbedding,
                               SubspaceTiedHead)):
            frozen.update(f"{prefix}{b}" for b, _ in module.named_buffers(recurse=False))
            w = state.get(f"{prefix}weight")
            if w is None:
                raise ValueError(f"plain has no {prefix}weight: not a GPT state_dict of this configuration")
            w = w.detach().double()
            rows = module.in_features if isinstance(module, SubspaceLinear) else module.weight.shape[0]
            want = (module.d, rows) if isinstance(module, SubspaceLinear) else (rows, U.shape[0])
            if tuple(w.shape) != want:
                raise ValueError(f"plain does not match this GPT's configuration at {prefix}weight: expected "
                                 f"{want}, got {tuple(w.shape)}")
            if isinstance(module, SubspaceLinear):
                projected[f"{prefix}weight"] = U.T @ w
                if module.bias is not None:
                    projected[f"{prefix}bias"] = U.T @ state[f"{prefix}bias"].detach().double()
            elif isinstance(module, SubspacePositionEmbedding):
                projected[f"{prefix}weight"] = w @ U
            else:  # token embedding and the head tied to it
                projected[f"{prefix}weight"] = (w - E_fix) @ U
    merged = {}
    for key, value in own.items():
        if key in frozen or key.startswith("stage_embeddings."):  # buffers; embeddings the plain model lacks
            merged[key] = value
            continue
        src = projected[key] if key in projected else state.get(key)
        if src is None or src.shape != value.shape:
            raise ValueError(f"plain does not match this GPT's configuration at {key}: expected "
                             f"{tuple(value.shape)}, got {None if src is None else tuple(src.shape)}")
        merged[key] = src.to(value.dtype)
    gpt.load_state_dict(merged)

def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats of logits ``[B, T, V]`` against token ids ``[B, T]`` (the loss of
    :meth:`GPT.forward`, as a pipeline ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPTStage(nn.Module):
    """Stage ``index`` of ``stages`` of a :class:`GPT`, made by :meth:`GPT.split` (copies of its modules).

    Attributes: ``config``; ``layers`` (the global indices of the blocks held); ``wte``, ``wpe``, ``drop`` on the
    first stage; ``ln_f``, ``lm_head`` on the last; ``h`` (the blocks) on every stage; ``subspace_rank``,
    ``subspace_seed``, ``subspace_stages`` (None / the model's), ``subspace_layers`` (the model's constrained blocks,
    global indices), ``subspace_head`` (see :meth:`GPT.split`); for a subspace model the buffers ``U``
    (``n_embd × k``) and ``E_fix`` (``vocab_size × n_embd``), this stage's own copies, shared by its modules (the
    last stage keeps them for its receiving boundary even when none of its blocks writes through ``U``);
    ``stage_embedding``: this stage's :class:`StageEmbedding` (a copy of the model's ``stage_embeddings[index]``)
    or None. A stage with one reads the token ids: call it as ``stage(x, tokens)`` (the first stage takes the ids
    as ``x``), as :func:`activation_codec_for`'s codec does in a pipeline.
    """

    def __init__(self, model: GPT, index: int, stages: int, layers: range, *, subspace_head: str = "dense"):
        super().__init__()
        self.config = model.config
        self.index, self.stages, self.layers = index, stages, layers
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.subspace_rank, self.subspace_seed = model.subspace_rank, model.subspace_seed
        self.subspace_stages, self.subspace_layers = model.subspace_stages, model.subspace_layers
        self.subspace_head = subspace_head
        t = model.transformer
        # one memo for the whole stage: tensors shared inside the model (U, E_fix, a tie) stay shared in the stage
        memo: dict[int, object] = {}
        if model.subspace_rank is not None:
            wte = _require_subspace(model)
            self.register_buffer("U", wte.U.detach().clone())
            self.register_buffer("E_fix", wte.E_fix.detach().clone())
            memo[id(wte.U)], memo[id(wte.E_fix)] = self.U, self.E_fix
        if self.is_first:
            self.wte = copy.deepcopy(t.wte, memo)
            self.wpe = copy.deepcopy(t.wpe, memo)
            self.drop = copy.deepcopy(t.drop, memo)
        self.h = nn.ModuleList(copy.deepcopy(t.h[i], memo) for i in layers)
        self.stage_embedding = (copy.deepcopy(model.stage_embeddings[index], memo)
                                if model.stage_embeddings is not None else None)
        if self.is_last:
            self.ln_f = copy.deepcopy(t.ln_f, memo)
            if model.subspace_rank is not None and not self.is_first and subspace_head == "dense":
                head = model.lm_head  # reads the stream, writes nothing into it: unconstrained once untied
                self.lm_head = nn.utils.skip_init(nn.Linear, self.config.n_embd, self.config.vocab_size, bias=False,
                                                  device=head.weight.device, dtype=head.weight.dtype)  # no RNG
                with torch.no_grad():
                    self.lm_head.weight.copy_(head.E_fix + head.weight @ head.U.T)
            else:
                self.lm_head = copy.deepcopy(model.lm_head, memo)
            if self.is_first:
                self.wte.weight = self.lm_head.weight  # one stage: the tie is kept

    def subspace_codec(self, *, check: bool = True, tol: float | None = None) -> SubspaceCodec:
        """The :class:`~fgdiloco.pipeline.subspace.SubspaceCodec` over this stage's ``U`` / ``E_fix`` (not copied).

        Raises:
            RuntimeError: the stage is of a model built without ``subspace_rank``.
        """
        if self.subspace_rank is None:
            raise RuntimeError("this stage is of a GPT built without subspace_rank: it has no residual-stream "
                               "subspace (build it as GPT(config, subspace_rank=k))")
        return SubspaceCodec(SubspaceBasis.from_tensor(self.U, self.subspace_seed), self.E_fix, check=check, tol=tol)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``[B, T]`` (first stage) or the residual stream ``[B, T, n_embd]`` -> the residual stream, or
        logits ``[B, T, vocab_size]`` on the last stage. ``tokens`` (``[B, T]``): the token ids, needed by a
        stage after the first that has a :attr:`stage_embedding` (ignored otherwise).

        Raises:
            ValueError: a sequence longer than ``block_size``; ``tokens`` missing where the stage needs them.
        """
        if self.is_first:
            seq_len = x.shape[1]
            if seq_len > self.config.block_size:
                raise ValueError(f"sequence length {seq_len} exceeds block_size {self.config.block_size}")
            tokens = x
            pos = torch.arange(seq_len, dtype=torch.long, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        local = None
        if self.stage_embedding is not None:
            if tokens is None:
                raise ValueError(f"stage {self.index} re-embeds the tokens (stage_embeddings=True): call it as "
                                 f"stage(x, tokens) with the batch's token ids [B, T] (in a Pipeline, use "
                                 f"activation_codec_for(stage), which passes them)")
            local = self.stage_embedding(tokens)
            if not self.is_first:
                x = self.stage_embedding.admit(x, F.embedding(tokens, self.E_fix))
        x = _stage_blocks(self.h, x, local, self.is_last)
        return self.lm_head(self.ln_f(x)) if self.is_last else x

    def extra_repr(self) -> str:
        k = "" if self.subspace_rank is None else f", subspace_rank={self.subspace_rank}"
        free = [i for i in self.layers if i not in self.subspace_layers]
        if self.subspace_rank is not None and free:
            k += f", free blocks {free[0]}..{free[-1]}"
        if self.stage_embedding is not None:
            k += ", own token embedding"
        return f"stage {self.index} of {self.stages}, blocks {self.layers.start}..{self.layers.stop - 1}{k}"


def activation_codec_for(model: GPT | GPTStage, *, check: bool = True, tol: float | None = None
                         ) -> SubspaceActivationCodec | None:
    """The :class:`~fgdiloco.pipeline.Pipeline` ``activation_codec`` for a :class:`GPT` or one of its
    :class:`GPTStage` s: a :class:`~fgdiloco.pipeline.subspace.SubspaceActivationCodec` over its ``U`` / ``E_fix``
    for a subspace model (``c``, ``[B, T, k]``, crosses each boundary forward, ``∂L/∂c`` backward; every stage
    reads the token ids itself and, with stage embeddings, gets them as its second argument), ``None`` for a plain
    model (the stream ``[B, T, n_embd]`` travels as it is).
    ``check`` / ``tol``: the out-of-subspace check at each sending boundary (see
    :class:`~fgdiloco.pipeline.subspace.SubspaceCodec`). Use it on every stage of the pipeline, e.g.
    ``Pipeline(stage, mesh, lm_loss, m, activation_codec=activation_codec_for(stage))``.

    Raises:
        TypeError: ``model`` is neither a :class:`GPT` nor a :class:`GPTStage`.
    """
    if isinstance(model, GPT):
        with_tokens = model.stage_embeddings is not None
    elif isinstance(model, GPTStage):
        with_tokens = model.stage_embedding is not None
    else:
        raise TypeError(f"model must be a GPT or a GPTStage, got {type(model).__name__}")
    if model.subspace_rank is None:
        return None
    return SubspaceActivationCodec(model.subspace_codec(check=check, tol=tol), with_tokens=with_tokens)


def build_stage(config: GPTConfig, stages: int, stage: int, *, subspace_rank: int | None = None,
                subspace_seed: int = 0, seed: int = 0, subspace_head: str = "dense",
                stage_embeddings: bool = False) -> GPTStage:
    """Stage ``stage`` of ``stages`` of the model ``torch.manual_seed(seed); GPT(config, subspace_rank,
    subspace_seed, subspace_stages=stages)`` builds (:meth:`GPT.split`), with the global RNG left as it was: every
    rank that calls it with the same arguments gets the stage of the same model, so the stages of a replica fit
    together. A subspace model is built for this split: only what crosses a boundary is constrained, the last
    stage's blocks write freely (``stages=1``: ``subspace_stages=None``, every block constrained, as one stage).
    Pair it with :func:`activation_codec_for` (``Pipeline(..., activation_codec=activation_codec_for(stage))``).

    Args:
        config: the model's sizes (:class:`GPTConfig`).
        stages: S, an int in ``[1, n_layer]`` (1: the whole model as one stage, the tie kept).
        stage: this rank's stage, an int in ``[0, S)`` (``ReplicaMesh.stage``).
        subspace_rank, subspace_seed: as :class:`GPT` (None: the plain model).
        seed: the seed of the parameters' initialisation (int >= 0).
        subspace_head: the last stage's head of a subspace model, ``"dense"`` or ``"subspace"`` (:meth:`GPT.split`).
        stage_embeddings: whether every stage of a subspace model re-embeds the tokens (:class:`GPT`; bool; needs
            ``subspace_rank`` and ``stages > 1``).

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range (before anything is built).
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    for name, value, high in (("stages", stages, config.n_layer), ("stage", stage, None), ("seed", seed, None)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < (1 if name == "stages" else 0) or (high is not None and value > high):
            raise ValueError(f"{name} must be an int in [1, n_layer={config.n_layer}], got {value}"
                             if name == "stages" else f"{name} must be an int >= 0, got {value}")
    if stage >= stages:
        raise ValueError(f"stage must be an int in [0, stages={stages}), got {stage}")
    _check_subspace_args(config, subspace_rank, subspace_seed, stages if stages > 1 else None, stage_embeddings)
    if subspace_head not in SUBSPACE_HEADS:
        raise ValueError(f"subspace_head must be one of {SUBSPACE_HEADS}, got {subspace_head!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config, subspace_rank=subspace_rank, subspace_seed=subspace_seed,
                    subspace_stages=stages if stages > 1 else None, stage_embeddings=stage_embeddings)
        return model.split(stages, subspace_head=subspace_head)[stage]


def fragments_of(model: GPT, n: int) -> list[nn.Module]:
    """Split the example GPT into ``n`` fragments (``nn.ModuleList``s; Streaming DiLoCo's, as torchft takes them), in
    forward order: the blocks in ``n`` contiguous groups, the token / position embeddings (the token embedding is
    tied to the output head) with the first, the final LayerNorm with the last. Every trainable parameter is in
    exactly one fragment (``n = 1``: the model itself).

    Raises:
        ValueError: ``n`` not in ``[1, n_layer]``.
    """
    blocks = list(model.transformer.h)
    if not 1 <= n <= len(blocks):
        raise ValueError(f"fragments must be in [1, n_layer={len(blocks)}], got {n}")
    if n == 1:
        return [model]
    per, extra = divmod(len(blocks), n)
    out, start = [], 0
    for i in range(n):
        size = per + (1 if i < extra else 0)
        mods = blocks[start:start + size]
        start += size
        if i == 0:
            mods = [model.transformer.wte, model.transformer.wpe, *mods]
        if i == n - 1:
            mods = [*mods, model.transformer.ln_f]
        out.append(nn.ModuleList(mods))
    return out


def two_stage_step(stages: list[GPTStage], idx: torch.Tensor, targets: torch.Tensor,
                   codec: SubspaceCodec | None) -> tuple[float, int, int]:
    """One forward + backward through two simulated pipeline stages (``GPT.split(2)``) in one process; returns
    ``(loss, bytes forward, bytes backward)`` of what crossed the boundary: ``x`` and ``∂L/∂x`` (``codec=None``) or
    ``c`` and ``∂L/∂c`` (a subspace model's codec). Gradients accumulate in the stages' parameters, as the pipeline
    leaves them (``benchmarks/subspace.py`` trains with it)."""
    first, last = stages
    x = first(idx)
    sent = x if codec is None else codec.boundary_out(x, idx)  # stage 0's output
    received = sent.detach().requires_grad_()  # the wire
    logits = last(received if codec is None else codec.boundary_in(received, idx), idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()  # stage 1
    sent.backward(received.grad)  # stage 0, from the gradient that came back
    grad = received.grad
    return float(loss.detach()), sent.numel() * sent.element_size(), grad.numel() * grad.element_size()


@torch.no_grad()
def two_stage_loss(stages: list[GPTStage], codec: SubspaceCodec | None,
                   batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean held-out loss over ``batches`` through two simulated stages and the codec (eval mode, restored)."""
    for s in stages:
        s.eval()
    total = n = 0.0
    for idx, tgt in batches:
        x = stages[0](idx)
        if codec is not None:
            x = codec.decompress(*codec.compress(x, idx))
        logits = stages[1](x, idx)
        total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), reduction="sum"))
        n += tgt.numel()
    for s in stages:
        s.train()
    return total / n
