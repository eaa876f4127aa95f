"""The wrapper's checkpoint format: what ``FGDiLoCo.state_dict`` writes (:func:`pack`), the checks
``load_state_dict`` runs before anything changes (:func:`validate_state`) and the parts of a load that can fail on
their own and are undone (:func:`load_codecs_and_inner`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..factor.codec import Codec
from .optimizer import TorchOuter
from .state import OuterState
from .torchstate import check_torch_state, clone_state

__all__ = ["STATE_VERSION", "load_codecs_and_inner", "pack", "validate_state"]

# 4: + "fragments", "outer_optimizer" (a torch outer optimizer's {"class": its class, "torch": its state_dict}, or
#    None; "class" is absent from states written before it was recorded) and "overlap_delta" (the pseudo-gradient
#    an overlapped Mix2 was mixing when the state was saved, or None);
# 3: + the model's trainable parameters and buffers ("params", "buffers") and the key "generation";
# 2: fp32 outer momentum owned by the wrapper ("momentum"); 1: outer momentum as a torch.optim.SGD state ("outer")
STATE_VERSION = 4
_STATE_KEYS = ("version", "inner", "anchor", "round", "steps_in_round", "seed", "topology", "world_size", "rank",
               "fingerprint", "codec", "mix1_codec")
_STATE_KEYS_BY_VERSION = {1: ("outer",), 2: ("momentum",), 3: ("momentum", "params", "buffers", "generation"),
                          4: ("momentum", "params", "buffers", "generation", "fragments", "outer_optimizer",
                              "overlap_delta")}


def pack(outer: OuterState, inner: torch.optim.Optimizer, model: torch.nn.Module, params: list[torch.Tensor], *,
         header: dict[str, Any], codecs: list[Codec], mix1_codec: Codec,
         overlap_delta: list[torch.Tensor] | None) -> dict[str, Any]:
    """The state dict of version :data:`STATE_VERSION`: ``header`` (``fragments``, ``sync_every``, ``seed``,
    ``topology``, ``world_size``, ``rank``, ``fingerprint``) and copies of the states (``codecs``: Mix2's, one per
    fragment; ``overlap_delta``: the pseudo-gradient an overlapped Mix2 is mixing, or None). Every tensor is a copy,
    the inner and outer optimizers' states included: later steps do not change a state dict already taken."""
    torch_outer = isinstance(outer.optimizer, TorchOuter)
    return {
        "version": STATE_VERSION,
        "inner": clone_state(inner.state_dict()),
        "momentum": [] if torch_outer else [m.detach().clone() for m in outer.momentum],
        "outer_optimizer": outer.optimizer.state_dict() if torch_outer else None,
        "fragments": header["fragments"],
        "overlap_delta": None if overlap_delta is None else [d.detach().clone() for d in overlap_delta],
        "anchor": [t.detach().clone() for t in outer.theta0],
        "params": [p.detach().clone() for p in params],
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "round": outer.round,
        "steps_in_round": outer.steps_in_round,
        "generation": outer.generation,
        **{k: header[k] for k in ("sync_every", "seed", "topology", "world_size", "rank", "fingerprint")},
        "codec": {"name": codecs[0].name, "state": codecs[0].state_dict(),
                  "fragments": [c.state_dict() for c in codecs[1:]]},
        "mix1_codec": {"name": mix1_codec.name, "state": mix1_codec.state_dict()},
    }


def load_codecs_and_inner(state: dict[str, Any], codecs: list[Codec], mix1_codec: Codec,
                          inner: torch.optim.Optimizer) -> None:
    """Load the codecs' states (Mix2's, one per fragment, then Mix1's) and the inner optimizer's (copies of its
    tensors: later steps leave the state dict as it was) from a validated state dict.

    Raises:
        ValueError: another number of fragments' codec states, or a codec state that does not load; the codecs and
            the inner optimizer are restored to what they held first.
    """
    codecs = [*codecs, mix1_codec]
    saved = [state["codec"]["state"], *state["codec"].get("fragments", []), state["mix1_codec"]["state"]]
    if len(saved) != len(codecs):
        raise ValueError(f"state dict has the codec states of {len(saved) - 1} fragment(s), this run has "
                         f"{len(codecs) - 1}")
    backup = ([c.state_dict() for c in codecs], inner.state_dict())
    try:
        for codec, st in zip(codecs, saved):
            codec.load_state_dict(st)
        inner.load_state_dict(clone_state(state["inner"]))
    except Exception as e:
        for codec, st in zip(codecs, backup[0]):
            codec.load_state_dict(st)
        inner.load_state_dict(backup[1])
        raise ValueError(f"state dict's codec or inner optimizer state does not load: {type(e).__name__}: "
                         f"{e}") from e


# ---------------------------------------------------------------------------------------------------- validation
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_tensors(key: str, saved: Any, like: list[torch.Tensor], names: list[str],
                   each: str = "one per trainable parameter") -> None:
    if not isinstance(saved, (list, tuple)) or len(saved) != len(like):
        n = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
        raise ValueError(f"state dict {key!r} must be a list of {len(like)} tensors ({each}), got {n}")
    for name, t, ref in zip(names, saved, like):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"state dict {key!r} entry for {name} must be a floating-point tensor, got "
                             f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"state dict {key!r} entry for {name} has shape {tuple(t.shape)}, the model's "
                             f"parameter has {tuple(ref.shape)}")


def _check_header(state: Any, expect: dict[str, Any]) -> int:
    if not isinstance(state, dict) or state.get("version") not in _STATE_KEYS_BY_VERSION:
        got = f"version {state.get('version')!r}" if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not an FGDiLoCo state dict of version {', '.join(map(str, _STATE_KEYS_BY_VERSION))} "
                         f"(got {got})")
    version = state["version"]
    for key in _STATE_KEYS + _STATE_KEYS_BY_VERSION[version]:
        if key not in state:
            raise ValueError(f"state dict (version {version}) lacks the key {key!r}")
    if state["fingerprint"] != expect["fingerprint"]:
        raise ValueError("state dict was saved for another model layout (parameter names, shapes or dtypes)")
    for key in ("rank", "world_size"):
        if state[key] != expect[key]:
            raise ValueError(f"state dict was saved by {key}={state[key]!r}, this worker has {key}="
                             f"{expect[key]}: load each worker's own state dict"
                             + (" into the same number of workers" if key == "world_size" else ""))
    for key in ("codec", "mix1_codec"):
        entry = state[key]
        if not isinstance(entry, dict) or not isinstance(entry.get("state"), dict):
            raise ValueError(f"state dict {key!r} must be a dict with 'name' and 'state'")
        if entry.get("name") != expect[key]:
            raise ValueError(f"state dict was saved with {key}={entry.get('name')!r}, this run uses "
                             f"{expect[key]!r}")
    if state["seed"] != expect["seed"]:
        raise ValueError(f"state dict was saved with seed={state['seed']}, this run uses seed={expect['seed']}; "
                         "the gossip schedule would change")
    if state["topology"] != expect["topology"]:
        raise ValueError(f"state dict was saved with topology={state['topology']!r}, this run uses "
                         f"{expect['topology']!r}")
    return version


def _saved_momentum(state: dict[str, Any], like: list[torch.Tensor]) -> list[torch.Tensor]:
    if state["version"] != 1:
        return state["momentum"]
    outer = state["outer"]
    if not isinstance(outer, dict) or not isinstance(outer.get("state"), dict):
        raise ValueError("state dict 'outer' (version 1) must be a torch.optim.SGD state dict")
    momentum = [outer["state"].get(i, {}).get("momentum_buffer") for i in range(len(like))]
    return [torch.zeros_like(t) if m is None else m for m, t in zip(momentum, like)]


def _check_buffers(state: dict[str, Any], model: torch.nn.Module) -> None:
    if not _is_int(state["generation"]) or state["generation"] < 0:
        raise ValueError(f"state dict 'generation' must be an int >= 0, got {state['generation']!r}")
    buffers, own = state["buffers"], dict(model.named_buffers())
    if not isinstance(buffers, dict) or set(buffers) != set(own):
        got = sorted(buffers) if isinstance(buffers, dict) else type(buffers).__name__
        raise ValueError(f"state dict 'buffers' must hold the model's buffers {sorted(own)}, got {got}")
    for n, b in buffers.items():
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != tuple(own[n].shape):
            raise ValueError(f"state dict buffer {n!r} must be a tensor of shape {tuple(own[n].shape)}")


def _check_inner(state: dict[str, Any], inner: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of.get(id(p), f"parameter {j} of the inner optimizer")
             for j, p in enumerate(p for g in inner.param_groups for p in g["params"])]
    check_torch_state("inner", state["inner"], inner, names, "inner optimizer")


def _check_overlap_delta(state: dict[str, Any], outer: OuterState, names: list[str],
                         fragments: list[list[int]]) -> None:
    if state["overlap_delta"] is None:
        return
    frag = fragments[state["round"] % len(fragments)]
    _check_tensors("overlap_delta", state["overlap_delta"], [outer.params[i] for i in frag], [names[i] for i in frag],
                   f"one per parameter of fragment {state['round'] % len(fragments)}, whose round is next")


def _check_outer(state: dict[str, Any], version: int, expect: dict[str, Any], outer: OuterState,
                 names: list[str]) -> dict[str, Any]:
    torch_outer = state.get("outer_optimizer") is not None
    if version >= 4 and torch_outer != expect["torch_outer"]:
        raise ValueError("state dict was saved with another kind of outer optimizer (a torch optimizer's state "
                         "and the built-in Nesterov momentum do not load into each other)")
    if torch_outer:
        return {"momentum": [], "outer_optimizer": outer.optimizer.prepare_load(state["outer_optimizer"], names)}
    momentum = _saved_momentum(state, outer.theta0)
    _check_tensors("outer" if version == 1 else "momentum", momentum, outer.theta0, names)
    return {"momentum": momentum, "outer_optimizer": None}


def validate_state(state: Any, *, expect: dict[str, Any], outer: OuterState, names: list[str],
                   model: torch.nn.Module, inner: torch.optim.Optimizer, sync_every: int,
                   fragments: list[list[int]]) -> dict[str, Any]:
    """Check a ``state_dict`` against this worker without changing anything. ``expect``: this worker's
    ``fingerprint``, ``rank``, ``world_size``, ``codec`` and ``mix1_codec`` names, ``seed``, ``topology`` name,
    ``fragments`` count and ``torch_outer`` (a torch outer optimizer, whose state is its own ``state_dict``);
    ``fragments``: the parameter indices of each fragment.

    The inner optimizer's state and a torch outer optimizer's are checked in full
    (:func:`~fgdiloco.outer.torchstate.check_torch_state`: every state tensor against the one a step creates for its
    parameter, then a trial load and step of a copy of the optimizer).

    Returns:
        ``momentum``: the built-in outer momentum (version 1 states keep it as an SGD state; [] for a torch outer
        optimizer) and ``outer_optimizer``: the torch outer optimizer's state dict to load (its saved state with the
        hyperparameters of this run's construction), or None; what :meth:`OuterState.load` takes.

    Raises:
        ValueError: not a state dict of a known version, a missing key (named), another model layout, rank, world
            size, codec, seed, topology or number of fragments, tensors of the wrong type or shape (``overlap_delta``
            included), an inner or torch outer optimizer state that does not match its optimizer (groups, a missing
            state key, a state tensor of the wrong type or shape, or one that does not load), or a state saved with
            another outer optimizer (the built-in one or another torch optimizer class).
    """
    version = _check_header(state, expect)
    if not _is_int(state["round"]) or state["round"] < 0:
        raise ValueError(f"state dict 'round' must be an int >= 0, got {state['round']!r}")
    steps = state["steps_in_round"]
    if not _is_int(steps) or not 0 <= steps < sync_every:
        raise ValueError(f"state dict 'steps_in_round' must be an int in [0, {sync_every}) (inner steps between "
                         f"outer rounds), got {steps!r}")
    _check_tensors("anchor", state["anchor"], outer.theta0, names)
    if version >= 4 and state["fragments"] != expect["fragments"]:
        raise ValueError(f"state dict was saved with fragments={state['fragments']!r}, this run uses "
                         f"{expect['fragments']!r}")
    if version >= 3:
        _check_tensors("params", state["params"], outer.params, names)
        _check_buffers(state, model)
    if version >= 4:
        _check_overlap_delta(state, outer, names, fragments)
    checked = _check_outer(state, version, expect, outer, names)
    _check_inner(state, inner, model)
    if version < STATE_VERSION:
        warnings.warn(f"FGDiLoCo state dict of an older format (version {version}, this build writes "
                      f"{STATE_VERSION}) without the model's weights: "
                      + ("the model's parameters are set from the saved round-start anchor" if
                         state["steps_in_round"] == 0 else "load the model's weights after building the "
                         "wrapper (broadcast_init overwrites them with rank 0's)"), stacklevel=3)
    return checked
