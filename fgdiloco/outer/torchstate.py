"""Checks of a torch optimizer's ``state_dict()`` against the optimizer it is to load into, without changing it
(the inner optimizer's state and a torch outer optimizer's, in a checkpoint; :mod:`.checkpoint`).

``torch.optim.Optimizer.load_state_dict`` checks only the parameter groups' sizes: a per-parameter state of the
wrong shape, a missing key (Adam's ``step``) or a value that is not a tensor loads, and the next step fails, or the
load itself fails half-way. :func:`check_torch_state` compares every state tensor with the one a step of the
optimizer creates for that parameter and loads the state into a trial copy of the optimizer, then steps the copy.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch

__all__ = ["check_structure", "check_torch_state", "clone_state"]


def clone_state(state: Any) -> Any:
    """A copy of an optimizer state dict whose tensors are clones (an optimizer's ``state_dict()`` and its
    ``load_state_dict()`` both share the tensors: a later step would change the copy in place)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone_state(v) for v in state)
    return copy.deepcopy(state)


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def check_structure(key: str, saved: Any, opt: torch.optim.Optimizer, owner: str = "optimizer") -> list[Any]:
    """Check that ``saved`` is a torch optimizer state dict whose parameter groups match ``opt``'s in number and
    size; returns its parameter ids in group order. ``owner``: what ``opt`` is (in messages).

    Raises:
        ValueError: not a dict of ``state`` and ``param_groups``, groups that do not match, a parameter id listed
            twice, or a state for an id no group lists.
    """
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or not isinstance(groups, list) \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise ValueError(f"state dict {key!r} must be a torch optimizer's state_dict() (a dict of 'state' and "
                         "'param_groups', each group with its 'params')")
    sizes, own_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in opt.param_groups]
    if sizes != own_sizes:
        raise ValueError(f"state dict {key!r} has parameter groups of sizes {sizes}, the {owner} {own_sizes}")
    ids = [i for g in groups for i in g["params"]]
    if len(set(ids)) != len(ids):
        raise ValueError(f"state dict {key!r} lists a parameter id in two places")
    listed = set(ids)
    stray = [k for k in saved["state"] if k not in listed]
    if stray:
        raise ValueError(f"state dict {key!r} holds a state for the parameter id {stray[0]!r}, which no parameter "
                         "group lists")
    return ids


def _trial_copy(opt: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """A copy of ``opt`` over fresh zero tensors shaped like its parameters, with an empty state and no hooks (the
    wrapper's step hooks and an LR scheduler are left out); None when the optimizer cannot be copied."""
    params = _params(opt)
    memo: dict[int, Any] = {id(p): torch.zeros_like(p, requires_grad=p.requires_grad) for p in params}
    memo[id(opt.state)] = defaultdict(dict)
    for name, value in vars(opt).items():
        if name.endswith("_hooks") and isinstance(value, dict):
            memo[id(value)] = type(value)()
    try:
        return copy.deepcopy(opt, memo)
    except Exception:  # an optimizer that holds something uncopyable (a process group): structural checks only
        return None


def _step(opt: torch.optim.Optimizer) -> None:
    """One step of ``opt`` with zero gradients (through its class: an LR scheduler patches the instance's ``step``
    with one that steps the optimizer it was made for)."""
    with torch.no_grad():
        for p in _params(opt):
            p.grad = torch.zeros_like(p)
    type(opt).step(opt)


def _reference(trial: torch.optim.Optimizer) -> list[dict[Any, torch.Size]] | None:
    """Per parameter (in group order), the state tensors' shapes a step of ``trial`` creates; None when a step
    without a closure fails (an optimizer such as LBFGS: no reference, no shape check)."""
    try:
        _step(trial)
    except Exception:
        return None
    return [{k: v.shape for k, v in trial.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
            for p in _params(trial)]


def _check_param_state(key: str, name: str, saved: Any, reference: dict[Any, torch.Size], owner: str) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"state dict {key!r} state of {name} must be a dict, got {type(saved).__name__}")
    if not saved:  # no state yet: the next step creates it
        return
    for k, shape in reference.items():
        if k not in saved:
            raise ValueError(f"state dict {key!r} state of {name} lacks {k!r}")
        value = saved[k]
        if shape == () and isinstance(value, (int, float)) and not isinstance(value, bool):
            continue  # a step count as a number (older torch): the trial load and step decide
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state dict {key!r} state {k!r} of {name} must be a tensor, got {type(value).__name__}")
        if value.shape != shape:
            raise ValueError(f"state dict {key!r} state {k!r} of {name} has shape {tuple(value.shape)}, the "
                             f"{owner}'s has {tuple(shape)}")


def check_torch_state(key: str, saved: Any, opt: torch.optim.Optimizer, names: list[str],
                      owner: str = "optimizer") -> None:
    """Check that ``saved`` loads into ``opt`` and steps, without changing ``opt``: its structure
    (:func:`check_structure`); every parameter's state (``names``: one per parameter of ``opt``, in group order)
    holds the tensors a step of ``opt`` creates for it, of the same shapes; and it loads into a trial copy of ``opt``
    (over zero tensors shaped like its parameters), which then steps.

    Raises:
        ValueError: any of these fails (the message names ``key``, the parameter and the state's key).
    """
    ids = check_structure(key, saved, opt, owner)
    trial = _trial_copy(opt)
    if trial is None:
        return
    reference = _reference(trial)
    if reference is not None:
        position = {i: j for j, i in enumerate(ids)}
        for pid, st in saved["state"].items():
            _check_param_state(key, names[position[pid]], st, reference[position[pid]], owner)
    try:
        trial.load_state_dict(clone_state(saved))  # a copy: loading shares the tensors, the step would change them
        if reference is not None:
            _step(trial)
    except Exception as e:
        raise ValueError(f"state dict {key!r} does not load into the {owner}: {type(e).__name__}: {e}") from e
