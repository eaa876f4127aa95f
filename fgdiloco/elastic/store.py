"""The gossip store of an elastic job: a ``TCPStore`` served by a process that is not a worker."""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["GossipStore"]


class GossipStore:
    """The job's gossip store: a ``torch.distributed.TCPStore`` served by this process, which is not a worker,
    so no worker's death takes it down. ``fgdiloco store`` runs one until it is stopped; ``fgdiloco launch`` and
    ``fgdiloco pretrain`` run one for their workers.

    Args:
        host: interface to listen on (``"0.0.0.0"``: all, for workers on other machines).
        port: TCP port (0: one the OS picks; see :attr:`port`).
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in [0, 65536), got {port!r}")
        self.host = host
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60), use_libuv=True)
        self.port: int = self.store.port

    @property
    def address(self) -> str:
        """``HOST:PORT`` for workers on this machine (``FGDILOCO_STORE``)."""
        return f"{'localhost' if self.host in ('0.0.0.0', '::', '') else self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving (workers still connected see their next store operation fail)."""
        del self.store
