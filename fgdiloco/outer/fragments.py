"""Fragments of the model (Streaming DiLoCo, Douillard et al., arXiv 2501.18512): each has its own outer round.

The trainable parameters are split into F fragments. Fragment ``f``'s outer rounds end at the inner steps
``s ≡ (f + 1)·H/F (mod H)``: one fragment every H/F steps, each every H steps (torchft's ``model_fragments``
schedule), so a blocking Mix2 moves about 1/F of the bytes and a round's blocking time is spread over the round.
Every fragment sync is one *outer round* of the wrapper (``FGDiLoCo.round`` counts them; ``RoundStats.fragment``
says whose it was), so with F = 1 nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["split_fragments"]


def split_fragments(spec: Any, names: Sequence[str], params: Sequence[torch.Tensor]) -> list[list[int]]:
    """The parameter indices of each fragment.

    Args:
        spec: ``F`` (an int: contiguous runs of the trainable parameters, in order, of about equal element counts,
            every fragment at least one tensor), or a list of fragments, each an ``nn.Module`` or a list of
            parameters (as torchft's ``model_fragments``).
        names, params: the wrapper's trainable parameters.

    Raises:
        ValueError: more fragments than parameters, or a list that leaves a trainable parameter out, names one
            twice or names one that is not trainable in the model.
        TypeError: a fragment that is neither a module nor a list of tensors.
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        return _by_size(spec, params)
    index = {id(p): i for i, p in enumerate(params)}
    out: list[list[int]] = []
    seen: dict[int, int] = {}
    for f, frag in enumerate(spec):
        if isinstance(frag, nn.Module):
            tensors = [p for p in frag.parameters() if p.requires_grad]
        elif isinstance(frag, (list, tuple)) and all(isinstance(p, torch.Tensor) for p in frag):
            tensors = list(frag)
        else:
            raise TypeError(f"fragments[{f}] must be an nn.Module or a list of parameters, got {type(frag).__name__}")
        ids = []
        for p in tensors:
            if id(p) not in index:
                raise ValueError(f"fragments[{f}] holds a tensor of shape {tuple(p.shape)} that is not a trainable "
                                 "parameter of the model")
            if id(p) in seen:
                raise ValueError(f"{names[index[id(p)]]} is in fragments[{seen[id(p)]}] and fragments[{f}]: every "
                                 "trainable parameter must be in exactly one fragment")
            seen[id(p)] = f
            ids.append(index[id(p)])
        if not ids:
            raise ValueError(f"fragments[{f}] holds no trainable parameter")
        out.append(sorted(ids))
    missing = [names[i] for i in range(len(params)) if i not in {j for frag in out for j in frag}]
    if missing:
        raise ValueError(f"fragments leave {len(missing)} trainable parameter(s) out ({', '.join(missing[:5])}): "
                         "every trainable parameter must be in exactly one fragment")
    return out


def _by_size(count: int, params: Sequence[torch.Tensor]) -> list[list[int]]:
    """Contiguous runs of about ``1/count`` of the elements each (at least one tensor each), split where the running
    element count is nearest each ``k/count`` of the total."""
    n = len(params)
    if count > n:
        raise ValueError(f"fragments={count} is more than the model's {n} trainable parameter tensors")
    cum, total = [], 0
    for p in params:
        total += p.numel()
        cum.append(total)
    bounds = [0]
    for k in range(1, count):
        b = 1 + min(range(n), key=lambda i: abs(cum[i] - k * total / count))  # the split nearest k/count of it
        bounds.append(min(max(b, bounds[-1] + 1), n - (count - k)))
    bounds.append(n)
    return [list(range(bounds[k], bounds[k + 1])) for k in range(count)]
