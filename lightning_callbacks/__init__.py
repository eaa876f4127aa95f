"""Lightning integration of fgdiloco: ``Trainer(strategy="fgdiloco")`` and callbacks that show the gossip.

* :class:`FGDiLoCoStrategy` runs Factored Gossip DiLoCo with one process per replica; registered as ``"fgdiloco"``
  (popen launcher, the default) and ``"fgdiloco_spawn"`` (``start_method="spawn"``).
* :class:`GossipMonitor` logs each outer round's diagnostics and warns when replicas drift apart.

Importing this package (or ``fgdiloco``) registers the strategy names; Lightning itself is imported only when one
of the classes is used or when the user imports Lightning (see :mod:`lightning_callbacks._register`). Where the
unified ``lightning`` package is installed, ``LightningFGDiLoCoStrategy`` / ``LightningGossipMonitor`` are the
``lightning.pytorch`` twins and the names are registered there as well.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ._register import ensure_registered

# The lightning.pytorch twins exist only where the unified ``lightning`` package is installed.
_TWINS = ("LightningFGDiLoCoStrategy", "LightningGossipMonitor")
_HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None

__all__ = [
    "FGDiLoCoStrategy",
    "GossipMonitor",
    "ConsensusGrowthWarning",
    "replica_checkpoint_path",
    *(_TWINS if _HAS_LIGHTNING else ()),
]

_LAZY = {
    "FGDiLoCoStrategy": "strategy",
    "LightningFGDiLoCoStrategy": "strategy",
    "replica_checkpoint_path": "strategy",
    "GossipMonitor": "monitor",
    "LightningGossipMonitor": "monitor",
    "ConsensusGrowthWarning": "monitor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _TWINS and not _HAS_LIGHTNING:
        raise AttributeError(f"{name} is the lightning.pytorch twin and needs the 'lightning' package "
                             "(pip install lightning); with pytorch_lightning use the names without 'Lightning'")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


ensure_registered()
