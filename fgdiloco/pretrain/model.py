"""A small nanoGPT-style decoder-only transformer (after Karpathy's nanoGPT, MIT) for the pretraining examples.

Pre-norm blocks of causal self-attention (``scaled_dot_product_attention(is_causal=True)``) and a 4x GELU MLP,
learned position embeddings, the token embedding tied to the output head, and GPT-2's initialisation (normal
0.02, residual projections scaled by ``1/sqrt(2 * n_layer)``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "GPTStage", "lm_loss"]


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
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
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

    def split(self, stages: int) -> list[GPTStage]:
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

        Args:
            stages: S, an int in ``[1, n_layer]``.

        Returns:
            ``S`` :class:`GPTStage` modules: stage 0 takes token ids ``[B, T]``, every other stage the residual
            stream ``[B, T, n_embd]`` (float32); the last returns logits ``[B, T, vocab_size]``, the others the
            residual stream. Use :func:`lm_loss` as the pipeline's loss.

        Raises:
            TypeError: ``stages`` not an int.
            ValueError: ``stages`` outside ``[1, n_layer]``.
        """
        if isinstance(stages, bool) or not isinstance(stages, int):
            raise TypeError(f"stages must be an int in [1, n_layer={self.config.n_layer}], got "
                            f"{type(stages).__name__}")
        if not 1 <= stages <= self.config.n_layer:
            raise ValueError(f"stages must be in [1, n_layer={self.config.n_layer}] (every stage holds at least "
                             f"one block), got {stages}")
        per, extra = divmod(self.config.n_layer, stages)
        out, start = [], 0
        for s in range(stages):
            stop = start + per + (1 if s < extra else 0)
            out.append(GPTStage(self, s, stages, range(start, stop)))
            start = stop
        return out

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, seq_len = idx.shape
        if seq_len > self.config.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq_len, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats of logits ``[B, T, V]`` against token ids ``[B, T]`` (the loss of
    :meth:`GPT.forward`, as a pipeline ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPTStage(nn.Module):
    """Stage ``index`` of ``stages`` of a :class:`GPT`, made by :meth:`GPT.split` (copies of its modules).

    Attributes: ``config``; ``layers`` (the global indices of the blocks held); ``wte``, ``wpe``, ``drop`` on the
    first stage; ``ln_f``, ``lm_head`` on the last; ``h`` (the blocks) on every stage.
    """

    def __init__(self, model: GPT, index: int, stages: int, layers: range):
        super().__init__()
        self.config = model.config
        self.index, self.stages, self.layers = index, stages, layers
        self.is_first, self.is_last = index == 0, index == stages - 1
        t = model.transformer
        if self.is_first:
            self.wte = copy.deepcopy(t.wte)
            self.wpe = copy.deepcopy(t.wpe)
            self.drop = copy.deepcopy(t.drop)
        self.h = nn.ModuleList(copy.deepcopy(t.h[i]) for i in layers)
        if self.is_last:
            self.ln_f = copy.deepcopy(t.ln_f)
            self.lm_head = copy.deepcopy(model.lm_head)
            if self.is_first:
                self.wte.weight = self.lm_head.weight  # one stage: the tie is kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` (first stage) or the residual stream ``[B, T, n_embd]`` -> the residual stream, or
        logits ``[B, T, vocab_size]`` on the last stage."""
        if self.is_first:
            seq_len = x.shape[1]
            if seq_len > self.config.block_size:
                raise ValueError(f"sequence length {seq_len} exceeds block_size {self.config.block_size}")
            pos = torch.arange(seq_len, dtype=torch.long, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
        return x

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.stages}, blocks {self.layers.start}..{self.layers.stop - 1}"
