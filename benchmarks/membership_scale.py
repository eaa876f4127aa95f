"""What a round start costs against the slot count: store operations and seconds, 4 live workers in 4..64 slots.

Run from the repository root::

    python -m benchmarks.membership_scale          # ~30 s; writes benchmarks/results/membership_scale.json

A real gossip store (:class:`fgdiloco.elastic.GossipStore`, a ``TCPStore`` on loopback) and 4 live workers'
:class:`~fgdiloco.elastic.membership.ElasticMembership` in this process (each with its own store clients and
heartbeat thread); the other slots stay empty, as a job started with ``--slots`` larger than its workers, or one
that lost most of its workers. For each slot count every worker runs ``--rounds`` round starts (the membership's
``before_round``: is the store reachable, where is the live round, publish this worker's round, answer joiners)
on an outer optimizer stand-in that is at the live round; reported per round start: the store operations (every
call on a store client, each a round trip; ``has_extended_api`` is local and not counted) and the median and 90th
percentile seconds; plus what joining costs once (the first worker creates every slot's keys) and the heartbeat's
operations per beat. The claim checked: a round start's operations do not grow with the slot count (the slots'
counters come in one ``multi_get``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"
WORKERS = 4


class _Counting:
    """A store client that counts the operations made through it (one round trip each)."""

    def __init__(self, inner: dist.Store, counts: list[int]):
        self._inner, self._counts = inner, counts

    def clone(self) -> _Counting:  # the membership's pooled connections and its heartbeat's are clones
        self._counts[0] += 1
        return _Counting(self._inner.clone(), self._counts)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or name == "has_extended_api":
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._counts[0] += 1
            return attr(*args, **kwargs)
        return call


class _Outer:
    """The part of :class:`~fgdiloco.outer.FGDiLoCo` a round start uses, at round ``round`` with state."""

    fresh, steps_in_round, join_timeout = False, 0, 5.0

    def __init__(self, rank: int):
        self.rank, self.round = rank, 0

    def committed_state(self) -> tuple[int, bytes]:
        return self.round, b"state"

    def jump(self, live: int) -> None:
        self.round = live


def measure(slots: int, rounds: int) -> dict[str, Any]:
    from fgdiloco.elastic import GossipStore
    from fgdiloco.elastic.membership import ElasticMembership

    server = GossipStore("127.0.0.1", 0)
    ns = f"scale{slots}"
    members, counts, join_ops, join_s = [], [], [], []
    try:
        for r in range(WORKERS):
            c = [0]
            client = _Counting(dist.TCPStore("127.0.0.1", server.port, is_master=False), c)
            t0 = time.perf_counter()
            m = ElasticMembership(client, r, slots, ns)  # type: ignore[arg-type]
            join_s.append(time.perf_counter() - t0)
            join_ops.append(c[0])
            m._service.stop()  # heartbeats are counted below, one by one, not inside round starts
            members.append(m)
            counts.append(c)
        outers = [_Outer(r) for r in range(WORKERS)]
        seconds: list[float] = []
        ops: list[int] = []
        for rnd in range(rounds):
            for m, o, c in zip(members, outers, counts):
                o.round = rnd
                before = c[0]
                t0 = time.perf_counter()
                m.before_round(o)
                seconds.append(time.perf_counter() - t0)
                ops.append(c[0] - before)
        # the heartbeat: operations per beat of one worker, over 10 beats
        beat_before = counts[0][0]
        t0 = time.perf_counter()
        for _ in range(10):
            members[0]._tick()
        beat_ops = (counts[0][0] - beat_before) / 10
        beat_s = (time.perf_counter() - t0) / 10
    finally:
        for m in members:
            m.close()
        server.close()
    seconds.sort()
    return {"slots": slots, "live_workers": WORKERS, "round_starts": len(ops),
            "store_ops_per_round_start": {"min": min(ops), "median": statistics.median(ops), "max": max(ops)},
            "round_start_seconds": {"median": statistics.median(seconds),
                                    "p90": seconds[int(0.9 * (len(seconds) - 1))]},
            "join_store_ops": {"first": join_ops[0], "later": statistics.median(join_ops[1:])},
            "join_seconds_first": join_s[0],
            "heartbeat_store_ops_per_beat": beat_ops, "heartbeat_seconds_per_beat": beat_s}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", default="4,8,16,32,64", help="slot counts, comma separated")
    p.add_argument("--rounds", type=int, default=50, help="round starts per worker and slot count")
    p.add_argument("--out", type=Path, default=RESULTS / "membership_scale.json")
    args = p.parse_args(argv)
    rows = [measure(int(s), args.rounds) for s in args.slots.split(",")]
    print("| slots | store ops per round start (min / median / max) | round start, median / p90 (ms) | "
          "joining: store ops (first worker / later) | heartbeat ops per beat |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        o, s, j = r["store_ops_per_round_start"], r["round_start_seconds"], r["join_store_ops"]
        print(f"| {r['slots']} | {o['min']} / {o['median']:g} / {o['max']} | {1e3 * s['median']:.2f} / "
              f"{1e3 * s['p90']:.2f} | {j['first']} / {j['later']:g} | {r['heartbeat_store_ops_per_beat']:g} |")
    flat = len({r["store_ops_per_round_start"]["max"] for r in rows}) == 1
    print(f"[membership_scale] round-start store operations independent of the slot count: {flat}")
    result = {"benchmark": "membership_scale", "command": "python -m benchmarks.membership_scale", "rows": rows,
              "round_start_ops_independent_of_slots": flat}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
