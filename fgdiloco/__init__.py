"""fgdiloco: Factored Gossip DiLoCo for PyTorch.

Workers take ``sync_every`` local inner steps, then synchronise without a global all-reduce: a non-blocking gossip
mix of parameters (Mix1) that overlaps the next inner steps, and a blocking gossip mix of compressed
pseudo-gradients (Mix2), followed by a local Nesterov outer step (Hewa Koneputugodage et al., ICML 2026).
"""

from .config import FGDiLoCoConfig
from .factor import BF16, Codec, Dense, FrameError, Int8, LowRank, decode_frame, encode_frame, layout_fingerprint
from .gossip import (
    DistributedTransport,
    ExchangeError,
    LocalHub,
    Membership,
    StoreUnreachable,
    Topology,
    Transport,
    make_topology,
)
from .mesh import ReplicaMesh
from .outer import FGDiLoCo, RoundStats

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "Codec",
    "Dense",
    "DistributedTransport",
    "ExchangeError",
    "FGDiLoCo",
    "FGDiLoCoConfig",
    "FrameError",
    "Int8",
    "LocalHub",
    "LowRank",
    "Membership",
    "ReplicaMesh",
    "RoundStats",
    "StoreUnreachable",
    "Topology",
    "Transport",
    "decode_frame",
    "encode_frame",
    "layout_fingerprint",
    "make_topology",
]
