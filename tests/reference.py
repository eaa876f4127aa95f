"""A deliberately plain single-process DiLoCo / one-round FG-DiLoCo reference for the tests.

Workers are simulated one after the other in one process: each keeps its own model copy and AdamW state; a round
runs H AdamW steps from the round-start parameters on that worker's batches, forms the pseudo-gradient
Δ_i = θ_i^t − φ_i, and the outer step is SGD with Nesterov momentum on the mixed pseudo-gradient from the mixed
round-start parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))


_TARGET = torch.linspace(-1.0, 1.0, 6).unsqueeze(1)  # a linear teacher: loss falls steadily


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic batch of worker ``rank`` at inner step ``step`` (global count)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 6, generator=g)
    return x, 0.5 * x @ _TARGET


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return ((model(x) - y) ** 2).mean()


INNER_LR = 1e-2


def diloco_reference(
    init: list[dict[str, torch.Tensor]],
    rounds: int,
    sync_every: int,
    *,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    mix: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> list[list[torch.Tensor]]:
    """Parameters of every worker after ``rounds`` rounds.

    ``init``: each worker's initial ``state_dict``. ``mix`` maps the stacked per-worker tensors (one tensor of shape
    [M, ...] per parameter... applied per parameter) to mixed ones; default: exact average (DiLoCo). The same mix is
    used for parameters (Mix1) and pseudo-gradients (Mix2).
    """
    m = len(init)
    models = []
    inners = []
    for sd in init:
        model = make_model()
        model.load_state_dict(sd)
        models.append(model)
        inners.append(torch.optim.AdamW(model.parameters(), lr=INNER_LR))
    if mix is None:
        def mix(stacked: list[torch.Tensor]) -> list[torch.Tensor]:
            return [s.mean(0, keepdim=True).expand_as(s).clone() for s in stacked]
    theta = [[p.detach().clone() for p in mdl.parameters()] for mdl in models]
    bufs: list[list[torch.Tensor] | None] = [None] * m
    step = 0
    for _ in range(rounds):
        deltas = []
        for i, (mdl, opt) in enumerate(zip(models, inners)):
            with torch.no_grad():
                for p, t in zip(mdl.parameters(), theta[i]):
                    p.copy_(t)
            for s in range(sync_every):
                loss_of(mdl, i, step + s).backward()
                opt.step()
                opt.zero_grad()
            deltas.append([t - p.detach() for t, p in zip(theta[i], mdl.parameters())])
        step += sync_every
        n = len(theta[0])
        mixed_theta = mix([torch.stack([theta[i][k] for i in range(m)]) for k in range(n)])
        mixed_delta = mix([torch.stack([deltas[i][k] for i in range(m)]) for k in range(n)])
        for i in range(m):
            new = []
            for k in range(n):
                d = mixed_delta[k][i]
                if bufs[i] is None:
                    bufs[i] = [torch.zeros_like(t) for t in theta[i]]
                buf = bufs[i][k]
                buf.mul_(outer_momentum).add_(d)
                new.append(mixed_theta[k][i] - outer_lr * (d + outer_momentum * buf))
            theta[i] = new
    return theta


def gossip_reference(
    init: list[dict[str, torch.Tensor]],
    rounds: int,
    sync_every: int,
    w1: Callable[[int], list[torch.Tensor]],
    w2: Callable[[int], list[torch.Tensor]],
    *,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    mix_momentum: bool = True,
) -> list[list[torch.Tensor]]:
    """FG-DiLoCo written with mixing matrices, in float32: X^{t+1} = W1 X^t − η·Nesterov(W2 Δ^t), where
    ``w1(t)`` / ``w2(t)`` give the M×M matrices of outer round t's gossip rounds (applied in order) and, with
    ``mix_momentum``, the momentum buffers are mixed by W1 as well. Parameters of every worker after ``rounds``."""
    m = len(init)
    models, inners = [], []
    for sd in init:
        model = make_model()
        model.load_state_dict(sd)
        models.append(model)
        inners.append(torch.optim.AdamW(model.parameters(), lr=INNER_LR))
    n = len(list(models[0].parameters()))
    theta = [torch.stack([list(mdl.parameters())[k].detach().clone() for mdl in models]) for k in range(n)]
    bufs = [torch.zeros_like(t) for t in theta]

    def apply(ws: list[torch.Tensor], stacked: torch.Tensor) -> torch.Tensor:
        flat = stacked.reshape(m, -1)
        for w in ws:
            flat = w.to(torch.float32) @ flat
        return flat.reshape(stacked.shape)

    step = 0
    for t in range(rounds):
        deltas = [torch.zeros_like(x) for x in theta]
        for i, (mdl, opt) in enumerate(zip(models, inners)):
            with torch.no_grad():
                for p, x in zip(mdl.parameters(), theta):
                    p.copy_(x[i])
            for s in range(sync_every):
                loss_of(mdl, i, step + s).backward()
                opt.step()
                opt.zero_grad()
            for k, p in enumerate(mdl.parameters()):
                deltas[k][i] = theta[k][i] - p.detach()
        step += sync_every
        ws1, ws2 = w1(t), w2(t)
        mixed_theta = [apply(ws1, x) for x in theta]
        mixed_bufs = [apply(ws1, b) for b in bufs] if mix_momentum else bufs
        mixed_delta = [apply(ws2, d) for d in deltas]
        for k in range(n):
            bufs[k] = mixed_bufs[k] * outer_momentum + mixed_delta[k]
            theta[k] = mixed_theta[k] - outer_lr * (mixed_delta[k] + outer_momentum * bufs[k])
    return [[x[i] for x in theta] for i in range(m)]


def streaming_reference(
    init: list[dict[str, torch.Tensor]],
    steps: int,
    sync_every: int,
    fragments: list[list[int]],
    *,
    overlap: int = 0,
    alpha: float = 0.0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
) -> list[list[torch.Tensor]]:
    """Streaming DiLoCo (Douillard et al., arXiv 2501.18512) as torchft schedules it, written plainly: fragment
    ``e % F`` is synchronised after inner step ``(e + 1)·H/F``; its pseudo-gradient ``θ^t − θ_i`` is taken
    ``overlap`` (τ) steps earlier; the exact mean goes through SGD with Nesterov momentum from the shared round-start
    values; then each worker's fragment becomes ``lerp(θ_outer, θ_local, alpha)`` and the next round starts from
    ``θ_outer``. Parameters of every worker after ``steps`` inner steps."""
    m = len(init)
    models, inners = [], []
    for sd in init:
        model = make_model()
        model.load_state_dict(sd)
        models.append(model)
        inners.append(torch.optim.AdamW(model.parameters(), lr=INNER_LR))
    theta0 = [p.detach().clone() for p in models[0].parameters()]  # shared: every worker starts from rank 0
    for mdl in models:
        with torch.no_grad():
            for p, t in zip(mdl.parameters(), theta0):
                p.copy_(t)
    bufs = [torch.zeros_like(t) for t in theta0]
    every = sync_every // len(fragments)
    pending: dict[int, list[list[torch.Tensor]]] = {}
    for s in range(1, steps + 1):
        for i, (mdl, opt) in enumerate(zip(models, inners)):
            loss_of(mdl, i, s - 1).backward()
            opt.step()
            opt.zero_grad()
        event = s // every - 1 if s % every == 0 else None
        if (s + overlap) % every == 0:  # take the pseudo-gradient of the fragment synced `overlap` steps from now
            f = ((s + overlap) // every - 1) % len(fragments)
            pending[f] = [[theta0[k] - list(mdl.parameters())[k].detach() for k in fragments[f]] for mdl in models]
        if event is None:
            continue
        f = event % len(fragments)
        deltas = pending.pop(f)
        for j, k in enumerate(fragments[f]):
            d = torch.stack([deltas[i][j] for i in range(m)]).mean(0)
            bufs[k] = bufs[k] * outer_momentum + d
            theta0[k] = theta0[k] - outer_lr * (d + outer_momentum * bufs[k])
        for mdl in models:
            params = list(mdl.parameters())
            with torch.no_grad():
                for k in fragments[f]:
                    params[k].copy_(torch.lerp(theta0[k], params[k].detach(), alpha))
    return [[p.detach().clone() for p in mdl.parameters()] for mdl in models]
