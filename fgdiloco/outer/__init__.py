"""The outer loop: the FGDiLoCo wrapper, its round state machine and diagnostics."""

from .stats import RoundStats
from .wrapper import FGDiLoCo

__all__ = ["FGDiLoCo", "RoundStats"]
