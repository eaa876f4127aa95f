"""fgdiloco: Factored Gossip DiLoCo for PyTorch.

Workers take ``sync_every`` local inner steps, then synchronise without a global all-reduce: a non-blocking gossip
mix of parameters (Mix1) that overlaps the next inner steps, and a blocking gossip mix of compressed
pseudo-gradients (Mix2), followed by a local Nesterov outer step (Hewa Koneputugodage et al., ICML 2026).
"""

from .factor import BF16, Codec, Dense, FrameError, Int8, LowRank, decode_frame, encode_frame, layout_fingerprint
from .gossip import DistributedTransport, ExchangeError, LocalHub, Topology, Transport, make_topology
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
    "FrameError",
    "Int8",
    "LocalHub",
    "LowRank",
    "ReplicaMesh",
    "RoundStats",
    "Topology",
    "Transport",
    "decode_frame",
    "encode_frame",
    "layout_fingerprint",
    "make_topology",
]

# Register Trainer(strategy="fgdiloco") with Lightning. Cheap: Lightning is not imported here; the names are registered
# now if it already is, else right after it is (lightning_callbacks/_register.py). Must stay last: registering imports
# lightning_callbacks.strategy, which imports fgdiloco.outer.
try:
    from lightning_callbacks._register import ensure_registered as _ensure_lightning_registered
except ImportError:  # lightning_callbacks not installed with this copy of fgdiloco
    pass
else:
    _ensure_lightning_registered()
