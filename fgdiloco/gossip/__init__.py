"""Gossip: topologies (who talks to whom), transports (how bytes move), and the mix itself."""

from .membership import Membership, StoreMembership, StoreUnreachable
from .mix import Mixer, MixResult, PeerHealth
from .topology import (
    TOPOLOGIES,
    AllReduceTopology,
    ExponentialTopology,
    RandomTopology,
    RingTopology,
    Topology,
    make_topology,
)
from .transport import DistributedTransport, ExchangeError, LocalHub, LocalTransport, PeerDeclined, PeerLeft, Transport

__all__ = [
    "TOPOLOGIES",
    "AllReduceTopology",
    "DistributedTransport",
    "ExchangeError",
    "ExponentialTopology",
    "LocalHub",
    "LocalTransport",
    "Membership",
    "MixResult",
    "Mixer",
    "PeerDeclined",
    "PeerLeft",
    "PeerHealth",
    "RandomTopology",
    "RingTopology",
    "StoreMembership",
    "StoreUnreachable",
    "Topology",
    "Transport",
    "make_topology",
]
