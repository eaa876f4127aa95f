"""What the both-or-neither exchange protocol costs per exchange (loopback Gloo, 2 forked ranks).

Run from the repository root::

    python -m benchmarks.exchange_latency

Side by side on one established private pair group, median of ``--repeats`` exchanges:

* ``one payload each way``: the frame of a pseudo-gradient (``--elements`` fp32 elements, dense) sent once each way
  on an open channel: the transfer alone, what the protocol before the accept byte did;
* ``+ accept byte``: the same, then the one-byte accept each way that makes the exchange both-or-neither;
* ``low rank, two messages + accept``: :class:`~fgdiloco.factor.LowRank`'s pair-agreed projection of a
  ``256 × 512`` matrix (its two messages and the accept byte);
* ``Mixer pair round (dense)``: the whole pairwise gossip round as the mixer runs it, with framing and checks.

The extra latency of the protocol is the difference of the first two rows (one round trip of one byte). Results:
``benchmarks/results/exchange_latency.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _rank_main(rank: int, world: int, elements: int, repeats: int) -> dict:
    from fgdiloco.factor import Dense, LowRank, encode_frame
    from fgdiloco.gossip import DistributedTransport, make_topology
    from fgdiloco.gossip.mix import Mixer

    t = DistributedTransport(timeout=30.0)
    peer = 1 - rank
    x = [torch.randn(elements)]
    body, _ = Dense().encode(x)
    frame = encode_frame(Dense(), body, sender=rank, round=0, fingerprint=b"\0" * 8)
    out: dict[str, list[float]] = {"one payload each way": [], "+ accept byte": [],
                                   "low rank, two messages + accept": [], "Mixer pair round (dense)": []}
    channel = t.open(peer, key="bench/channel")
    for _ in range(repeats):
        t0 = time.perf_counter()
        channel.exchange(frame)
        out["one payload each way"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        channel.exchange(frame)
        channel.exchange(b"\x01")
        out["+ accept byte"].append(time.perf_counter() - t0)
    topo = make_topology("random", 2, 0)
    dense = Mixer("mix2", topo, t, Dense(), 1, b"\0" * 8, 30.0)
    low = Mixer("mixl", topo, t, LowRank(rank=4), 1, b"\0" * 8, 30.0)
    m = [torch.randn(256, 512)]
    for r in range(repeats):
        dense.prepare(r)
        low.prepare(r)
        for key in (f"mix2/{r}", f"mixl/{r}"):  # the set-up finishes in the background during the inner steps
            t._prepared[(peer, key)][0].result()
        t0 = time.perf_counter()
        dense.run(x, r)
        out["Mixer pair round (dense)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        low.run(m, r)
        out["low rank, two messages + accept"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fgdiloco.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        res = run_ranks(_rank_main, 2, tmp, args.elements, args.repeats, timeout=600)
    table = {k: max(r[k] for r in res) for k in res[0]}
    table["accept byte (difference)"] = table["+ accept byte"] - table["one payload each way"]
    for k, v in table.items():
        print(f"{k:34s} {v:8.3f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "exchange_latency.json").write_text(json.dumps(
        {"elements": args.elements, "repeats": args.repeats, "median_ms": table,
         "note": "loopback Gloo on the 2-core dev machine, other jobs running"}, indent=1))
    return table


if __name__ == "__main__":
    main()
