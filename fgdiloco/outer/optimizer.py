"""The outer optimizer: what turns the mixed pseudo-gradient into the next round-start parameters.

* :class:`NesterovOuter` (the default): SGD with (Nesterov) momentum on fp32 master copies, ``torch.optim.SGD``'s
  rule without dampening, as DiLoCo (Douillard et al., arXiv 2311.08105) uses it. Its state is one momentum buffer
  per parameter.
* :class:`TorchOuter`: any ``torch.optim.Optimizer``, built by the user's factory over fp32 master copies of the
  round-start parameters (``FGDiLoCo(..., outer_optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))``).
  SNOO and GPA report the gain of DiLoCo-style methods comes from Nesterov momentum on the pseudo-gradient; this is
  the door to trying other outer steps.

Mix1 also gossips the outer optimizer's state when ``mix_momentum`` is on: the momentum buffer of SGD, the first
and second moments of Adam / AdamW (:data:`MIXABLE`), each averaged like the parameters (linear state; the second
moment stays positive under averaging). A state the wrapper does not know how to mix is refused with a clear error
(pass ``mix_momentum=False`` to keep it local).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .torchstate import check_structure, check_torch_state, clone_state

__all__ = ["MIXABLE", "NesterovOuter", "OuterOptimizer", "TorchOuter", "build_outer"]

#: Outer optimizers whose state Mix1 can mix, and the per-parameter state tensors it mixes (in this order).
MIXABLE: dict[type, tuple[str, ...]] = {
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.Adam: ("exp_avg", "exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq"),
}


class OuterOptimizer:
    """The interface: per parameter index, the mixable state tensors, and the step."""

    #: state tensors per parameter that Mix1 mixes (0: none)
    state_per_param: int = 1

    def state(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """The mixable state of the parameters ``indices``, ``state_per_param`` tensors each, grouped by kind."""
        raise NotImplementedError

    def set_state(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Replace that state by mixed values (the same layout as :meth:`state`)."""
        raise NotImplementedError

    def step(self, indices: Sequence[int], theta: Sequence[torch.Tensor],
             delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """New fp32 round-start values of the parameters ``indices`` from the mixed round-start values ``theta``
        and the mixed pseudo-gradients ``delta`` (nothing is changed in place)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class NesterovOuter(OuterOptimizer):
    """SGD with momentum ``mu`` (Nesterov when ``nesterov`` and ``mu > 0``) and learning rate ``lr``, on fp32 masters:
    ``m ← μ·m + Δ̄``; ``θ ← θ̄ − η·(Δ̄ + μ·m)`` (Nesterov) or ``θ̄ − η·m``."""

    def __init__(self, like: Sequence[torch.Tensor], *, lr: float, mu: float, nesterov: bool):
        self.lr, self.mu, self.nesterov = lr, mu, nesterov and mu > 0
        self.momentum = [torch.zeros_like(t, dtype=torch.float32) for t in like]

    def state(self, indices: Sequence[int]) -> list[torch.Tensor]:
        return [self.momentum[i] for i in indices]

    def set_state(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        for i, t in zip(indices, tensors):
            self.momentum[i] = t

    @torch.no_grad()
    def step(self, indices: Sequence[int], theta: Sequence[torch.Tensor],
             delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for i, t, d in zip(indices, theta, delta):
            if self.mu > 0:
                m = self.momentum[i].mul(self.mu).add_(d)
                self.momentum[i] = m
                step = d.add(m, alpha=self.mu) if self.nesterov else m
            else:
                step = d
            out.append(t.sub(step, alpha=self.lr))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": [m.detach().clone() for m in self.momentum]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum = [m.detach().to(device=o.device, dtype=torch.float32, copy=True)
                         for m, o in zip(state["momentum"], self.momentum)]


class TorchOuter(OuterOptimizer):
    """A ``torch.optim.Optimizer`` built by ``factory(masters)`` over fp32 master copies of the round-start
    parameters. A step sets the masters to the mixed round-start values and their ``.grad`` to the mixed
    pseudo-gradients, steps the optimizer, and returns copies (only the given indices carry a gradient, so a
    fragment's step leaves the others alone).

    Raises:
        TypeError: the factory did not return a ``torch.optim.Optimizer`` over exactly the masters.
        ValueError: ``mix=True`` with an optimizer whose state the wrapper cannot mix (:data:`MIXABLE`).
    """

    def __init__(self, factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 like: Sequence[torch.Tensor], *, mix: bool):
        self.masters = [torch.zeros_like(t, dtype=torch.float32).requires_grad_(True) for t in like]
        opt = factory(self.masters)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(opt).__name__}")
        held = [p for g in opt.param_groups for p in g["params"]]
        if len(held) != len(self.masters) or {id(p) for p in held} != {id(p) for p in self.masters}:
            raise TypeError("outer_optimizer must build its optimizer over exactly the parameters it is given")
        self.opt = opt
        self.keys: tuple[str, ...] = ()
        if mix:
            kind = next((k for k in MIXABLE if type(opt) is k), None)
            if kind is None:
                known = ", ".join(f"torch.optim.{k.__name__} ({', '.join(v)})" for k, v in MIXABLE.items())
                raise ValueError(f"mix_momentum=True gossips the outer optimizer's state in Mix1, which it knows how "
                                 f"to do for {known}, not for {type(opt).__name__}: use one of those, or "
                                 "mix_momentum=False to keep the outer state local")
            self.keys = MIXABLE[kind]
        self.state_per_param = len(self.keys)

    def _buffer(self, i: int, key: str) -> torch.Tensor:
        got = self.opt.state.get(self.masters[i], {}).get(key)
        return torch.zeros_like(self.masters[i], dtype=torch.float32) if got is None else got.detach().clone()

    def state(self, indices: Sequence[int]) -> list[torch.Tensor]:
        return [self._buffer(i, key) for key in self.keys for i in indices]

    @torch.no_grad()
    def set_state(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        it = iter(tensors)
        for key in self.keys:
            for i in indices:
                value = next(it)
                state = self.opt.state.get(self.masters[i])
                if state and key in state:  # before the first step there is no state yet (all zeros anyway)
                    state[key].copy_(value)

    def step(self, indices: Sequence[int], theta: Sequence[torch.Tensor],
             delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            for p in self.masters:
                p.grad = None
            for i, t, d in zip(indices, theta, delta):
                self.masters[i].copy_(t)
                self.masters[i].grad = d.to(torch.float32).clone()
        self.opt.step()
        with torch.no_grad():
            out = [self.masters[i].detach().clone() for i in indices]
            for i in indices:
                self.masters[i].grad = None
        return out

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's class (``"torch.optim.adam.Adam"``) and ``state_dict()``, with copies of its
        tensors."""
        return {"class": _class_name(self.opt), "torch": clone_state(self.opt.state_dict())}

    def prepare_load(self, state: Any, names: Sequence[str] | None = None) -> dict[str, Any]:
        """Check a :meth:`state_dict` without changing anything; returns the torch state dict to load
        (:meth:`load_prepared`): the saved per-parameter state (moments, step counts) with the hyperparameters of
        this optimizer as it was constructed (learning rate, betas, weight decay...), not the saved ones.
        ``names``: the parameters' names, one per master (in messages).

        Raises:
            ValueError: not such a state dict, one saved with another optimizer class (both named; a state dict
                written before the class was recorded: other hyperparameter names), or a state that does not load
                or step (:func:`~fgdiloco.outer.torchstate.check_torch_state`: groups, a missing state key, a
                state tensor of the wrong type or shape).
        """
        if not isinstance(state, dict) or not isinstance(state.get("torch"), dict):
            raise ValueError("state dict 'outer_optimizer' must be a torch outer optimizer's state (a dict with "
                             "'class' and 'torch', its state_dict())")
        own, saved_class = _class_name(self.opt), state.get("class")
        if saved_class is not None and saved_class != own:
            raise ValueError(f"state dict 'outer_optimizer' was saved by {saved_class}, this run's outer optimizer "
                             f"is {own}: the state of one does not load into the other")
        saved = state["torch"]
        check_structure("outer_optimizer", saved, self.opt, "outer optimizer")
        current = self.opt.state_dict()["param_groups"]
        if saved_class is None:
            settings = [sorted(set(g) - {"params", "param_names"}) for g in (*current, *saved["param_groups"])]
            if settings[:len(current)] != settings[len(current):]:
                raise ValueError(f"state dict 'outer_optimizer' was saved by another torch optimizer (settings "
                                 f"{settings[-1]}), this run's outer optimizer is {own} ({settings[0]})")
        merged = {"state": saved["state"],
                  "param_groups": [{**g, "params": s["params"]} for g, s in zip(current, saved["param_groups"])]}
        index = {id(m): i for i, m in enumerate(self.masters)}
        names = list(names) if names is not None else [f"parameter {i}" for i in range(len(self.masters))]
        check_torch_state("outer_optimizer", merged, self.opt,
                          [names[index[id(p)]] for g in self.opt.param_groups for p in g["params"]], "outer optimizer")
        return merged

    def load_prepared(self, prepared: dict[str, Any]) -> None:
        """Load what :meth:`prepare_load` returned (copies of its tensors)."""
        self.opt.load_state_dict(clone_state(prepared))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check and load a :meth:`state_dict` (:meth:`prepare_load`: the hyperparameters stay this optimizer's).

        Raises:
            ValueError: as :meth:`prepare_load`; nothing has changed then.
        """
        self.load_prepared(self.prepare_load(state))


def _class_name(opt: torch.optim.Optimizer) -> str:
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def build_outer(config: Any, like: Sequence[torch.Tensor]) -> OuterOptimizer:
    """The outer optimizer of ``config`` (:class:`~fgdiloco.FGDiLoCoConfig`) for tensors shaped like ``like``: by
    name (``"sgd"``, ``"adam"``, ``"adamw"``: ``outer_lr``, and ``outer_momentum`` as momentum or first beta) or
    the user's factory."""
    c = config
    if c.outer_optimizer is None:
        return NesterovOuter(like, lr=c.outer_lr, mu=c.outer_momentum, nesterov=c.nesterov)
    by_name = {
        "sgd": lambda p: torch.optim.SGD(p, lr=c.outer_lr, momentum=c.outer_momentum,
                                         nesterov=c.nesterov and c.outer_momentum > 0),
        "adam": lambda p: torch.optim.Adam(p, lr=c.outer_lr, betas=(c.outer_momentum, 0.999)),
        "adamw": lambda p: torch.optim.AdamW(p, lr=c.outer_lr, betas=(c.outer_momentum, 0.999)),
    }
    factory = by_name[c.outer_optimizer] if isinstance(c.outer_optimizer, str) else c.outer_optimizer
    return TorchOuter(factory, like, mix=c.mix_momentum)
