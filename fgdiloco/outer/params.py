"""Which parameters the wrapper synchronises, and the watch that nothing trains on one worker only."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SyncedParameters"]


class SyncedParameters:
    """The trainable parameters (``requires_grad``) of ``model``, in ``named_parameters`` order: what both mixes
    and the outer step act on.

    Raises:
        ValueError: ``model`` has no trainable parameter, ``inner`` does not hold all of them, or ``inner`` holds a
            trainable tensor that is not one of them (it would be trained but never synchronised).
    """

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer):
        self.model, self.inner = model, inner
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model has no trainable parameters (requires_grad=True) to synchronise")
        held = {id(p) for group in inner.param_groups for p in group["params"]}
        missing = [n for n, p in named if id(p) not in held]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"inner_optimizer does not hold {len(missing)} of the model's trainable parameters "
                             f"({shown}); build it from model.parameters()")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._ids = {id(p) for p in self.params}
        extra = self.unsynchronised()
        if extra:
            raise ValueError(f"inner_optimizer holds {len(extra)} trainable parameter(s) that are not trainable "
                             f"parameters of model ({', '.join(extra[:5])}): they would be trained but never "
                             "synchronised; build it from model.parameters()")
        self._held = self._count_held()

    def _count_held(self) -> int:
        return sum(len(g["params"]) for g in self.inner.param_groups)

    def unsynchronised(self) -> list[str]:
        """Trainable parameters of the model or the inner optimizer that are not synchronised (added with
        ``add_param_group``, unfrozen, or never part of the model), by name or shape."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out, seen = [], set()
        for p in [p for g in self.inner.param_groups for p in g["params"]] + list(self.model.parameters()):
            if p.requires_grad and id(p) not in self._ids and id(p) not in seen:
                seen.add(id(p))
                out.append(names.get(id(p), f"<tensor of shape {tuple(p.shape)} not in model>"))
        return out

    def check(self) -> None:
        """Raise ``RuntimeError`` naming any trainable parameter that is not synchronised, or a synchronised one
        that was frozen since (checked at every round start; a walk over the parameters)."""
        frozen = [n for n, p in zip(self.names, self.params) if not p.requires_grad]
        if frozen:
            raise RuntimeError(
                f"{len(frozen)} synchronised parameter(s) were frozen (requires_grad=False) after FGDiLoCo was built "
                f"({', '.join(frozen[:5])}): the outer step would still move them (its momentum) and Mix1 average "
                "them. Freeze parameters before building the wrapper (build a new one after freezing)")
        extra = self.unsynchronised()
        if extra:
            raise RuntimeError(
                f"{len(extra)} trainable parameter(s) are not synchronised by FGDiLoCo ({', '.join(extra[:5])}): "
                "a parameter added to the inner optimizer (add_param_group) or unfrozen after the wrapper was built "
                "would train on this worker only. Build the wrapper after the model and inner optimizer are "
                "complete, or freeze the parameter (requires_grad=False)")

    def check_if_added(self) -> None:
        """:meth:`check` when the inner optimizer's parameter count changed (cheap: at every inner step)."""
        if self._count_held() != self._held:
            self.check()
