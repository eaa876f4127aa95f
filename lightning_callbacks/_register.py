"""Register the ``"fgdiloco"`` strategy names with Lightning, without importing Lightning.

Lightning has no entry-point group for strategies: ``Trainer(strategy="fgdiloco")`` works only after
``StrategyRegistry.register`` ran in that process. ``import fgdiloco`` and ``import
lightning_callbacks`` both call :func:`ensure_registered`, but importing ``pytorch_lightning`` costs about 2 s,
which plain-PyTorch users of ``fgdiloco`` (every ``torchrun`` rank) should not pay. So:

* a Lightning namespace (``pytorch_lightning``, ``lightning.pytorch``) that is already imported gets the strategies
  registered at once;
* for one that is not imported yet, a small import hook on ``sys.meta_path`` waits for its top-level package to
  finish importing and registers right after that. The hook touches no other import.

Registration never raises into the importer: a failure becomes a warning.

This module must stay free of Lightning and fgdiloco imports (``fgdiloco/__init__.py`` imports it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
import warnings
from typing import Any

__all__ = ["ensure_registered"]

# top-level module of each Lightning namespace -> function (in lightning_callbacks.strategy) that registers there
_NAMESPACES = {"pytorch_lightning": "_register_pytorch_lightning", "lightning.pytorch": "_register_lightning"}
_STRATEGY = f"{__package__}.strategy"

_lock = threading.RLock()
_done: set[str] = set()


def _warn(name: str, error: BaseException) -> None:
    warnings.warn(f"fgdiloco: could not register the 'fgdiloco' strategies with {name}: {type(error).__name__}: "
                  f"{error}", RuntimeWarning, stacklevel=3)


def strategy_loaded(module: Any) -> None:
    """Called as the last statement of :mod:`lightning_callbacks.strategy`: register its classes with every
    Lightning namespace it found (it imports all installed ones)."""
    with _lock:
        for name, fn in _NAMESPACES.items():
            if name in _done or not hasattr(module, fn):
                continue
            _done.add(name)
            try:
                getattr(module, fn)()
            except Exception as e:  # noqa: BLE001 - never break the user's import
                _warn(name, e)


def _register(namespace: str) -> None:
    """Make sure ``namespace`` gets the names. Importing :mod:`lightning_callbacks.strategy` can import a Lightning
    namespace and so come back here while that module is half-initialised: its last line registers then."""
    with _lock:
        if namespace in _done:
            return
        module = sys.modules.get(_STRATEGY)
        if module is not None and not _fully_imported(_STRATEGY):
            return  # strategy_loaded() will register
        try:
            if module is None:
                importlib.import_module(_STRATEGY)  # registers through strategy_loaded()
            else:
                strategy_loaded(module)
        except Exception as e:  # noqa: BLE001 - never break the user's import
            _done.add(namespace)
            _warn(namespace, e)


def _fully_imported(name: str) -> bool:
    module = sys.modules.get(name)
    if module is None:
        return False
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for a watched namespace it asks the other finders for the real spec and chains a
    registration call after the module's own ``exec_module``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _NAMESPACES or fullname in _done:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _register(fullname)

        loader.exec_module = exec_module  # the loader object is this spec's own (one per find)
        return spec


_hook: _RegisterAfterImport | None = None


def ensure_registered() -> None:
    """Register with every Lightning namespace that is imported now, and with the others as soon as they are.

    Cheap and idempotent: safe to call from any import.
    """
    global _hook
    with _lock:
        pending = False
        for name in _NAMESPACES:
            if name in _done:
                continue
            if _fully_imported(name):
                _register(name)
            else:
                pending = True
        if pending and _hook is None:
            _hook = _RegisterAfterImport()
            sys.meta_path.insert(0, _hook)
