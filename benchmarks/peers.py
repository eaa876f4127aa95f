"""The peers of ``benchmarks/wan.py --peers``: torchft's DiLoCo and Streaming DiLoCo on the same job, and the
dead-worker runs (torchft and FG-DiLoCo).

:func:`peer_worker` is one worker of such a run, inside its network namespace. It runs the example job's one
training loop (:class:`fgdiloco.pretrain.loop.Loop`) with the job's recipe (the same GPT, corpus, token cache, train
/ validation split, seed, per-rank batch stream, AdamW parameter groups, learning-rate schedule and gradient
clipping, evaluation windows: :mod:`fgdiloco.pretrain.recipe`), so it differs from ``train_worker`` only in what
synchronises the replicas and in how it reports:

* ``backend="torchft"``: :class:`TorchftDiLoCo` plugs ``torchft.local_sgd.DiLoCo`` into the loop (torchft 0.2.0,
  Meta's fault-tolerant trainer; DiLoCo: Douillard et al., arXiv 2311.08105; Streaming DiLoCo: Douillard et al.,
  arXiv 2501.18512). One replica group per worker (group world size 1): its own ``TCPStore`` and ``Manager`` in its
  own namespace, a reconfigurable ``torchft.ProcessGroupGloo`` across replicas, the quorum from one
  ``torchft_lighthouse`` in worker 0's namespace (the orchestrator starts it). ``fragments=1`` is DiLoCo;
  ``fragments=F > 1`` with ``fragment_sync_delay >= 1`` is Streaming DiLoCo: fragment ``f`` starts its all-reduce
  ``fragment_sync_delay`` inner steps before it is needed and the F fragments take turns every H / F steps, so each
  is synchronised every H steps. The outer optimizer is ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum,
  nesterov=True)`` per fragment, the optimizer FG-DiLoCo's outer step uses (same pseudo-gradient sign: round-start
  minus local parameters).
* ``backend="fgdiloco"``: the job's :class:`fgdiloco.pretrain.sync.FGDiLoCoSync`, used here for the dead-worker
  runs only, because ``train_worker``'s rows all-reduce its metrics over the world group every round, which a dead
  worker breaks.

The world Gloo group carries nothing while training but the stop flag (``max_seconds``: one 1-element all-reduce
per round, outside the timed part, as ``train_worker`` does for its metrics; not in dead-worker runs) and one
barrier before training (every torchft ``Manager`` heartbeats to the lighthouse before the first quorum). Each rank
keeps one row per outer round (:class:`RankRows`: times, blocked seconds, utilisation, veth byte counters, torchft
participants and commits), evaluates its kept weights after training (the loop's deferred evaluation: none between
rounds) and writes ``rank<i>.jsonl``; :func:`fgdiloco.pretrain.merge.write_merged` turns the files into the
``metrics.jsonl`` / ``summary.json`` that ``wan.py`` reads.

Utilisation for torchft = 1 - (seconds inside torchft's optimizer hooks, where it starts the quorum and the
all-reduce, waits for them, commits and takes the outer step) / round seconds: the "seconds not blocked in
communication / wall" that ``wan.py`` uses for DDP and local SGD.

Fault injection: rank ``die_rank`` calls ``os._exit(DIED_EXIT_CODE)`` right after inner step ``die_at_step``
(mid-round; the loop's ``after_step``). :func:`fgdiloco.pretrain.comparison.dead_worker_cost` measures what that
cost the survivors. The peer options are :data:`fgdiloco.pretrain.comparison.PEER_DEFAULTS`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fgdiloco.pretrain.comparison import DIED_EXIT_CODE, check_peer
from fgdiloco.pretrain.config import TrainConfig
from fgdiloco.pretrain.data import split_tokens
from fgdiloco.pretrain.loop import Loop, Outcome, Periodic, Point, Reporter
from fgdiloco.pretrain.model import fragments_of
from fgdiloco.pretrain.recipe import Batches, build_model, eval_batches, inner_optimizer, load_tokens, net_bytes
from fgdiloco.pretrain.sync import FGDiLoCoSync

__all__ = ["RankRows", "TorchftDiLoCo", "peer_worker", "process_cpu_seconds"]


# ---------------------------------------------------------------------------------------------------- torchft
class TorchftDiLoCo(Periodic):
    """torchft's ``DiLoCo`` (Streaming DiLoCo with ``fragments > 1``) as the loop's synchroniser: one replica group
    per worker, its ``Manager`` on this worker's own store, the quorum from the lighthouse ``peer["lighthouse"]``.
    Blocked seconds: those inside torchft's optimizer post-step hook (ours run just before and just after it)."""

    method = "torchft"
    label = "torchft DiLoCo"

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, cfg: TrainConfig, peer: dict[str, Any],
                 rank: int, world: int):
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        super().__init__(model, inner, sync_every=cfg.sync_every, grad_clip=cfg.grad_clip)
        logging.getLogger("torchft").setLevel(logging.WARNING)
        addr = os.environ["FGDB_ADDR"]
        timeout = datetime.timedelta(seconds=cfg.collective_timeout)
        self.store = dist.TCPStore(addr, peer["store_port"], is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), state_dict=model.state_dict, load_state_dict=model.load_state_dict,
            min_replica_size=peer["min_replicas"] if peer["min_replicas"] is not None else max(world - 1, 1),
            use_async_quorum=False, replica_id=f"fgdb_replica_{rank}", store_addr=addr, store_port=self.store.port,
            rank=0, world_size=1, lighthouse_addr=peer["lighthouse"], hostname=addr, port=peer["manager_port"],
            init_sync=False,  # same seed: identical initial weights (torchft's advice)
            timeout=timeout, quorum_timeout=datetime.timedelta(seconds=cfg.join_timeout))
        frags = fragments_of(model, peer["fragments"])
        outers = [torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
                  for f in frags]
        self._t_hook = 0.0
        inner.register_step_post_hook(self._before)  # before torchft's own hook, registered by DiLoCo(...)
        self.diloco = DiLoCo(self.manager, frags, inner, outers if len(outers) > 1 else outers[0],
                             sync_every=cfg.sync_every, should_quantize=peer["should_quantize"],
                             fragment_sync_delay=peer["fragment_sync_delay"],
                             fragment_update_alpha=float(peer["fragment_update_alpha"]))
        self._entered = False

    def _before(self, *_: Any) -> None:
        self._t_hook = time.perf_counter()

    def _after(self, *_: Any) -> None:
        self.blocked += time.perf_counter() - self._t_hook

    def start(self) -> int:
        dist.barrier()  # every replica's Manager is heartbeating before anyone trains: the first quorum has all
        self.diloco.__enter__()
        self._entered = True
        self.inner.register_step_post_hook(self._after)  # after torchft's
        return super().start()

    def round_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        m = self.manager
        return {"participants": m.num_participants(), "commits": m.current_step(), "errored": m.errored() is not None}

    def close(self) -> None:
        if self._entered:
            self._entered = False
            self.diloco.__exit__(None, None, None)


# ---------------------------------------------------------------------------------------------------- rows
class RankRows(Reporter):
    """One row per outer round of this rank (``rank<i>.jsonl``), evaluated after training. With ``stop_flag`` the
    ranks agree on stopping at ``max_seconds`` through one all-reduce per round over the world group."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, stop_flag: bool):
        self.cfg, self.rank, self.stop_flag = cfg, rank, stop_flag
        self.tokens_per_step = cfg.batch_size * cfg.block_size * world
        self.rows: list[dict[str, Any]] = []
        self._by_point: dict[int, dict[str, Any]] = {}
        self._net0 = (0.0, 0.0)

    def start(self) -> None:
        self._net0 = net_bytes()

    def record(self, point: Point) -> bool:
        net = net_bytes()
        stop = self.cfg.max_seconds is not None and point.train_seconds >= self.cfg.max_seconds
        if self.stop_flag:
            flag = torch.tensor([1.0 if stop else 0.0])
            dist.all_reduce(flag)  # all ranks stop after the same round
            stop = bool(flag.item() > 0)
        s = point.stats or {}
        row = {"rank": self.rank, "step": point.step, "round": point.round,
               "tokens": point.step * self.tokens_per_step, "wall_seconds": point.wall_seconds,
               "train_seconds": point.train_seconds, "round_seconds": s.get("round_seconds"),
               "blocked_seconds": None, "utilisation": s.get("utilisation"), "net_tx_bytes": net[0] - self._net0[0],
               "net_rx_bytes": net[1] - self._net0[1]}
        if "inner_seconds" in s:  # FG-DiLoCo's RoundStats
            row["blocked_seconds"] = s["round_seconds"] - s["inner_seconds"]
            row.update({k: s[k] for k in ("failed_exchanges", "mix2_seconds", "mix1_wait_seconds")})
        elif s:  # torchft's
            row["blocked_seconds"] = s["blocked_seconds"]
            row.update({k: s[k] for k in ("participants", "commits", "errored")})
        self.rows.append(row)
        self._by_point[id(point)] = row
        return stop

    def evaluated(self, point: Point, loss: float) -> None:
        self._by_point.pop(id(point))["eval_loss"] = loss


# ---------------------------------------------------------------------------------------------------- worker side
def peer_worker(raw: dict[str, Any]) -> int:
    """One worker of a peer run (inside its namespace; torchrun-style ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` /
    ``GLOO_SOCKET_IFNAME`` set by the orchestrator). ``raw``: the run's config (``TrainConfig`` fields + ``peer``).
    Leaves with ``os._exit``: torchft's threads and Gloo pairs with a dead peer can hang an orderly exit."""
    cfg = TrainConfig.from_dict({k: v for k, v in raw.items() if k != "peer"}, strict=False).validate()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    peer = check_peer(raw.get("peer", {}), cfg.sync_every, world)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)

    tokens, vocab, _ = load_tokens(cfg)  # from the cache the orchestrator built (read only)
    train, val = split_tokens(tokens, cfg.val_fraction)
    model = build_model(cfg, vocab)
    inner = inner_optimizer(model, cfg)
    eval_set = eval_batches(cfg, val)
    batches = Batches(cfg, train, inner, rank)
    # the world group: FGDiLoCo's process group; for torchft only the start barrier and the stop flag
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(cfg.collective_timeout, 60.0)))
    if peer["backend"] == "torchft":
        sync: Any = TorchftDiLoCo(model, inner, cfg, peer, rank, world)
    else:
        sync = FGDiLoCoSync(model, inner, cfg.fgdiloco_config(), grad_clip=cfg.grad_clip)
    rows = RankRows(cfg, rank, world, stop_flag=bool(peer["stop_flag"] and cfg.max_seconds is not None
                                                     and peer["die_rank"] is None))

    def die_here(step: int) -> None:
        if peer["die_rank"] == rank and step == peer["die_at_step"]:
            sys.stdout.flush()
            os._exit(DIED_EXIT_CODE)  # a dead worker: no goodbye to anyone

    outcome = Loop(sync, rows, batches, eval_set, steps=cfg.steps, sync_every=cfg.sync_every, deferred=True,
                   after_step=die_here).run()
    _write_results(Path(cfg.out), rank, rows.rows, outcome, cfg, peer, sync)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # all results are written


def _write_results(out: Path, rank: int, rows: list[dict[str, Any]], outcome: Outcome, cfg: TrainConfig,
                   peer: dict[str, Any], sync: Any) -> None:
    """``rank<i>.jsonl`` (atomically) and ``rank<i>.done.json``: steps, CPU seconds this worker process used while
    training (all its threads: torchft's heartbeat / RPC threads and Gloo's included) against the training wall
    seconds (the overhead a shared core pays beside the inner steps), the configuration and versions."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{rank}.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out / f"rank{rank}.jsonl")
    done = {"rank": rank, "steps": outcome.steps, "stopped_early": outcome.stopped,
            "train_seconds": rows[-1]["train_seconds"], "train_cpu_seconds": outcome.cpu_seconds,
            "threads": _threads(), "peer": peer, "config": cfg.as_dict(), "torch": torch.__version__}
    if isinstance(sync, TorchftDiLoCo):
        import torchft

        done.update(torchft=getattr(torchft, "__version__", None) or _dist_version("torchft"),
                    commits=sync.manager.current_step())
    (out / f"rank{rank}.done.json").write_text(json.dumps(done, indent=1) + "\n")


def _threads() -> int | None:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("Threads:")))
    return None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (``/proc/<pid>/stat``), None when unreadable."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
