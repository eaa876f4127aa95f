"""The peers of ``benchmarks/wan.py --peers``: torchft's DiLoCo and Streaming DiLoCo on the same job, and the
dead-worker runs (torchft and FG-DiLoCo).

:func:`peer_worker` is one worker of such a run, inside its network namespace. It trains exactly the job of
``fgdiloco.pretrain.worker.train_worker`` (the same GPT, corpus, token cache, train / validation split, seed, per-rank
batch stream, AdamW parameter groups, learning-rate schedule and gradient clipping, evaluation windows) and differs
only in what synchronises the replicas:

* ``backend="torchft"``: ``torchft.local_sgd.DiLoCo`` (torchft 0.2.0, Meta's fault-tolerant trainer; DiLoCo:
  Douillard et al., arXiv 2311.08105; Streaming DiLoCo: Douillard et al., arXiv 2501.18512). One replica group per
  worker (group world size 1): its own ``TCPStore`` and ``Manager`` in its own namespace, a reconfigurable
  ``torchft.ProcessGroupGloo`` across replicas, the quorum from one ``torchft_lighthouse`` in worker 0's namespace
  (the orchestrator starts it). ``fragments=1`` is DiLoCo; ``fragments=F > 1`` with ``fragment_sync_delay >= 1`` is
  Streaming DiLoCo: fragment ``f`` starts its all-reduce ``fragment_sync_delay`` inner steps before it is needed and
  the F fragments take turns every H / F steps, so each is synchronised every H steps. The outer optimizer is
  ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)`` per fragment, the optimizer FG-DiLoCo's
  outer step uses (same pseudo-gradient sign: round-start minus local parameters).
* ``backend="fgdiloco"``: ``fgdiloco.FGDiLoCo`` as in ``train_worker``, used here for the dead-worker runs only,
  because ``train_worker`` all-reduces its metrics over the world group every round, which a dead worker breaks.

The world Gloo group carries nothing while training but the stop flag (``max_seconds``: one 1-element all-reduce
per round, outside the timed part, as ``train_worker`` does for its metrics; not in dead-worker runs) and one
barrier before training (every torchft ``Manager`` heartbeats to the lighthouse before the first quorum). Each rank
writes ``rank<i>.jsonl`` (one row per outer round: times, blocked seconds, utilisation, veth byte counters, torchft
participants and commits) and evaluates its kept weights after training (no evaluation between rounds);
:func:`merge_rank_rows` turns the files into the ``metrics.jsonl`` / ``summary.json`` that ``wan.py`` reads.

Utilisation for torchft = 1 - (seconds inside torchft's optimizer hooks, where it starts the quorum and the
all-reduce, waits for them, commits and takes the outer step) / round seconds: the "seconds not blocked in
communication / wall" that ``wan.py`` uses for DDP and local SGD.

Fault injection: rank ``die_rank`` calls ``os._exit(DIED_EXIT_CODE)`` right after inner step ``die_at_step``
(mid-round). :func:`dead_worker_cost` measures what that cost the survivors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: exit code of the worker killed on purpose (the orchestrator does not count it as a failure)
DIED_EXIT_CODE = 17

#: peer options and their defaults (the "peer" entry of a run's config)
PEER_DEFAULTS: dict[str, Any] = {
    "backend": "torchft",  # "torchft" or "fgdiloco"
    "fragments": 1,
    "fragment_sync_delay": 0,
    "fragment_update_alpha": 0.0,
    "should_quantize": False,
    "lighthouse": None,  # "http://<addr>:<port>" (torchft)
    "store_port": 29600,  # this replica's TCPStore, in its own namespace (torchft)
    "manager_port": 29610,  # this replica's ManagerServer (torchft)
    "min_replicas": None,  # torchft Manager.min_replica_size; None: workers - 1 (one failure tolerated)
    "die_rank": None,
    "die_at_step": None,
    "stop_flag": True,  # all-reduce the max_seconds stop flag over the world group each round
}


def check_peer(peer: dict[str, Any], sync_every: int, workers: int) -> dict[str, Any]:
    """``peer`` completed with :data:`PEER_DEFAULTS` and checked against the job.

    Raises:
        ValueError: an unknown key or backend, ``fragments`` not dividing ``sync_every``, ``fragment_sync_delay``
            not in ``[0, sync_every / fragments)``, ``fragment_update_alpha`` not in [0, 1], or a fault outside the
            job (``die_rank`` not in ``[1, workers)``: rank 0 hosts the store and the lighthouse).
    """
    unknown = sorted(set(peer) - set(PEER_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown peer option(s) {unknown}; allowed: {', '.join(PEER_DEFAULTS)}")
    p = {**PEER_DEFAULTS, **peer}
    if p["backend"] not in ("torchft", "fgdiloco"):
        raise ValueError(f"backend must be 'torchft' or 'fgdiloco', got {p['backend']!r}")
    f = p["fragments"]
    if not isinstance(f, int) or f < 1 or sync_every % f:
        raise ValueError(f"fragments must be an integer >= 1 dividing sync_every={sync_every}, got {f!r}")
    d = p["fragment_sync_delay"]
    if not isinstance(d, int) or not 0 <= d < sync_every // f:
        raise ValueError(f"fragment_sync_delay must be an integer in [0, {sync_every // f}) "
                         f"(sync_every / fragments), got {d!r}")
    if not 0.0 <= float(p["fragment_update_alpha"]) <= 1.0:
        raise ValueError(f"fragment_update_alpha must be in [0, 1], got {p['fragment_update_alpha']!r}")
    if p["die_rank"] is not None:
        if not isinstance(p["die_rank"], int) or not 1 <= p["die_rank"] < workers:
            raise ValueError(f"die_rank must be an integer in [1, {workers}) (rank 0 hosts the store and the "
                             f"lighthouse), got {p['die_rank']!r}")
        if not isinstance(p["die_at_step"], int) or p["die_at_step"] < 1:
            raise ValueError(f"die_at_step must be an integer >= 1 with die_rank, got {p['die_at_step']!r}")
    return p


def fragments_of(model: Any, n: int) -> list[Any]:
    """Split the example GPT into ``n`` torchft fragments (``nn.ModuleList``s), in forward order: the blocks in
    ``n`` contiguous groups, the token / position embeddings (the token embedding is tied to the output head) with
    the first, the final LayerNorm with the last. Every trainable parameter is in exactly one fragment.

    Raises:
        ValueError: ``n`` not in ``[1, n_layer]``.
    """
    import torch.nn as nn

    blocks = list(model.transformer.h)
    if not 1 <= n <= len(blocks):
        raise ValueError(f"fragments must be in [1, n_layer={len(blocks)}], got {n}")
    if n == 1:
        return [model]
    per, extra = divmod(len(blocks), n)
    out, start = [], 0
    for i in range(n):
        size = per + (1 if i < extra else 0)
        mods = blocks[start:start + size]
        start += size
        if i == 0:
            mods = [model.transformer.wte, model.transformer.wpe, *mods]
        if i == n - 1:
            mods = [*mods, model.transformer.ln_f]
        out.append(nn.ModuleList(mods))
    return out


# ---------------------------------------------------------------------------------------------------- worker side
def peer_worker(raw: dict[str, Any]) -> int:
    """One worker of a peer run (inside its namespace; torchrun-style ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` /
    ``GLOO_SOCKET_IFNAME`` set by the orchestrator). ``raw``: the run's config (``TrainConfig`` fields + ``peer``)."""
    import torch
    import torch.distributed as dist

    from fgdiloco.pretrain.data import (
        build_tokenizer,
        cache_dir_for,
        encode_corpus,
        load_text,
        sample_batch,
        split_tokens,
    )
    from fgdiloco.pretrain.model import GPT, GPTConfig
    from fgdiloco.pretrain.recipe import clip_gradients, held_out_loss, inner_optimizer, net_bytes, next_batch
    from fgdiloco.pretrain.worker import TrainConfig, make_codec

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in raw.items() if k in known}).validate()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    peer = check_peer(raw.get("peer", {}), cfg.sync_every, world)
    torch.set_num_threads(1)
    out = Path(cfg.out)
    logging.basicConfig(level=logging.WARNING)

    # the data, from the cache the orchestrator built (read only), split as train_worker splits it
    text = load_text(cfg.data)
    cache = cache_dir_for(cfg.data, cfg.cache_dir)
    tok = build_tokenizer(text, cfg.tokenizer, cfg.vocab_size, cache_dir=cache)
    tokens = encode_corpus(text, tok, cache_dir=cache).to(torch.int32).long()
    train, val = split_tokens(tokens, cfg.val_fraction)

    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout))
    inner = inner_optimizer(model, cfg)
    eval_gen = torch.Generator().manual_seed(cfg.seed + 7919)
    eval_set = [sample_batch(val, cfg.batch_size, cfg.block_size, eval_gen) for _ in range(cfg.eval_batches)]
    batch_gen = torch.Generator().manual_seed(cfg.seed * 100_003 + rank + 1)
    tokens_per_step = cfg.batch_size * cfg.block_size * world

    # the world group: FGDiLoCo's process group; for torchft only the start barrier and the stop flag
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(cfg.timeout, 60.0)))
    use_flag = peer["stop_flag"] and cfg.max_seconds is not None and peer["die_rank"] is None

    blocked = [0.0]
    t_hook = [0.0]
    manager = None
    fg = None
    ctx: Any = contextlib.nullcontext()
    if peer["backend"] == "torchft":
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        logging.getLogger("torchft").setLevel(logging.WARNING)
        addr = os.environ["FGDB_ADDR"]
        store = dist.TCPStore(addr, peer["store_port"], is_master=True, wait_for_workers=False)
        pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=cfg.timeout))
        min_rep = peer["min_replicas"] if peer["min_replicas"] is not None else max(world - 1, 1)
        manager = Manager(
            pg=pg, min_replica_size=min_rep, use_async_quorum=False, load_state_dict=model.load_state_dict,
            state_dict=model.state_dict, replica_id=f"fgdb_replica_{rank}", store_addr=addr,
            store_port=store.port, rank=0, world_size=1, lighthouse_addr=peer["lighthouse"], hostname=addr,
            port=peer["manager_port"], init_sync=False,  # same seed: identical initial weights (torchft's advice)
            timeout=datetime.timedelta(seconds=cfg.timeout), quorum_timeout=datetime.timedelta(seconds=cfg.timeout))
        frags = fragments_of(model, peer["fragments"])
        outers = [torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
                  for f in frags]

        # time torchft's hooks: ours run before (registered first) and after (registered last) its post-step hook
        def before(*_: Any) -> None:
            t_hook[0] = time.perf_counter()

        def after(*_: Any) -> None:
            blocked[0] += time.perf_counter() - t_hook[0]

        inner.register_step_post_hook(before)
        ctx = DiLoCo(manager, frags, inner, outers if len(outers) > 1 else outers[0], sync_every=cfg.sync_every,
                     should_quantize=peer["should_quantize"], fragment_sync_delay=peer["fragment_sync_delay"],
                     fragment_update_alpha=float(peer["fragment_update_alpha"]))
    else:
        from fgdiloco import FGDiLoCo

        fg = FGDiLoCo(model, inner, sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                      outer_momentum=cfg.outer_momentum, topology=cfg.topology, mix1_rounds=cfg.mix1_rounds,
                      mix2_rounds=cfg.mix2_rounds, codec=make_codec(cfg), timeout=cfg.timeout, seed=cfg.seed)

    # every replica's Manager is heartbeating before anyone trains, so the first quorum waits for all of them
    dist.barrier()
    rows: list[dict[str, Any]] = []
    kept: list[dict[str, torch.Tensor]] = []
    eval_seconds = 0.0
    net0 = net_bytes()
    cpu0 = _cpu_seconds()
    t_start = time.perf_counter()
    t_round = t_start

    def record(step: int, rnd: int, round_seconds: float | None, blocked_s: float | None,
               util: float | None, extra: dict[str, Any]) -> bool:
        nonlocal eval_seconds, t_round
        t0 = time.perf_counter()
        wall = t0 - t_start
        net = net_bytes()
        stop = cfg.max_seconds is not None and wall - eval_seconds >= cfg.max_seconds
        if use_flag:
            flag = torch.tensor([1.0 if stop else 0.0])
            dist.all_reduce(flag)  # all ranks stop after the same round
            stop = bool(flag.item() > 0)
        rows.append({"rank": rank, "step": step, "round": rnd, "tokens": step * tokens_per_step,
                     "wall_seconds": wall, "train_seconds": wall - eval_seconds, "round_seconds": round_seconds,
                     "blocked_seconds": blocked_s, "utilisation": util, "net_tx_bytes": net[0] - net0[0],
                     "net_rx_bytes": net[1] - net0[1], **extra})
        kept.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        eval_seconds += time.perf_counter() - t0
        t_round = time.perf_counter()
        return stop

    steps_done = 0
    stopped = False
    with ctx:
        if manager is not None:
            inner.register_step_post_hook(after)
        record(0, 0, None, None, None, {})
        for step in range(cfg.steps):
            x, y = next_batch(inner, cfg, step, train, batch_gen)
            _, loss = model(x, y)
            loss.backward()
            clip_gradients(model.parameters(), cfg)
            inner.step()
            inner.zero_grad(set_to_none=True)
            steps_done = step + 1
            if peer["die_rank"] == rank and steps_done == peer["die_at_step"]:
                sys.stdout.flush()
                os._exit(DIED_EXIT_CODE)  # a dead worker: no goodbye to anyone
            if steps_done % cfg.sync_every and steps_done != cfg.steps:
                continue
            rnd = -(-steps_done // cfg.sync_every)
            if fg is not None:
                if fg.round < rnd:
                    fg.sync()  # the last, shorter round
                st = fg.last_round
                extra = {"failed_exchanges": st.failed_exchanges, "mix2_seconds": st.mix2_seconds,
                         "mix1_wait_seconds": st.mix1_wait_seconds}
                stop = record(steps_done, rnd, st.round_seconds, st.round_seconds - st.inner_seconds,
                              st.utilisation, extra)
            else:
                rs = max(time.perf_counter() - t_round, 1e-9)
                extra = {"participants": manager.num_participants(), "commits": manager.current_step(),
                         "errored": manager.errored() is not None}
                stop = record(steps_done, rnd, rs, blocked[0], min(max(1.0 - blocked[0] / rs, 0.0), 1.0), extra)
                blocked[0] = 0.0
            if stop and steps_done != cfg.steps:
                stopped = True
                break
    train_seconds = rows[-1]["train_seconds"]
    cpu_train = _cpu_seconds() - cpu0
    if fg is not None:
        fg.close()
    for row, weights in zip(rows, kept):  # deferred evaluation, after training
        model.load_state_dict(weights)
        row["eval_loss"] = held_out_loss(model, eval_set)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{rank}.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out / f"rank{rank}.jsonl")
    # CPU seconds this worker process used while training (all its threads: torchft's heartbeat / RPC threads and
    # Gloo's included) against the training wall seconds: the overhead a shared core pays beside the inner steps
    done = {"rank": rank, "steps": steps_done, "stopped_early": stopped, "train_seconds": train_seconds,
            "train_cpu_seconds": cpu_train, "threads": _threads(),
            "peer": peer, "config": dataclasses.asdict(cfg), "torch": torch.__version__}
    if manager is not None:
        import torchft

        done.update(torchft=getattr(torchft, "__version__", None) or _dist_version("torchft"),
                    commits=manager.current_step())
    (out / f"rank{rank}.done.json").write_text(json.dumps(done, indent=1) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # torchft's Rust threads and Gloo pairs with a dead peer can hang an orderly interpreter exit; all results are
    # written, so leave now
    os._exit(0)


def _cpu_seconds() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


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


# ---------------------------------------------------------------------------------------------------- analysis
def read_rank_rows(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """``{rank: rows}`` from the ``rank<i>.jsonl`` files of a peer run."""
    out = {}
    for p in sorted(run_dir.glob("rank*.jsonl")):
        rank = int(p.stem[4:])
        out[rank] = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


def merge_rank_rows(per_rank: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows ``wan.py`` reads (``metrics.jsonl``) from the ranks' own rows: rank 0's row per evaluation point,
    with ``eval_loss`` rank 0's, and ``eval_loss_mean``, ``utilisation_mean``, ``net_tx_bytes_mean`` and
    ``net_rx_bytes_mean`` the means over the ranks that reached that step (a dead rank drops out of later means).

    Raises:
        ValueError: no rank 0 rows.
    """
    if not per_rank.get(0):
        raise ValueError("rank 0 wrote no rows")
    by_step = {r: {row["step"]: row for row in rows} for r, rows in per_rank.items()}

    def mean(key: str, step: int) -> float | None:
        v = [by_step[r][step][key] for r in by_step if step in by_step[r] and by_step[r][step].get(key) is not None]
        return sum(v) / len(v) if v else None

    merged = []
    for row in per_rank[0]:
        s = row["step"]
        m = dict(row)
        m.update(eval_loss_mean=mean("eval_loss", s), utilisation_mean=mean("utilisation", s),
                 net_tx_bytes_mean=mean("net_tx_bytes", s), net_rx_bytes_mean=mean("net_rx_bytes", s),
                 ranks=sum(1 for r in by_step if s in by_step[r]))
        merged.append(m)
    return merged


def write_merged(run_dir: Path) -> list[dict[str, Any]]:
    """Write ``metrics.jsonl`` and ``summary.json`` of a peer run from its per-rank files; returns the rows."""
    rows = merge_rank_rows(read_rank_rows(run_dir))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done0 = json.loads((run_dir / "rank0.done.json").read_text()) if (run_dir / "rank0.done.json").is_file() else {}
    util = [r["utilisation_mean"] for r in rows[1:] if r.get("utilisation_mean") is not None]
    summary = {"method": "peer", "steps": done0.get("steps"), "stopped_early": done0.get("stopped_early"),
               "utilisation": sum(util) / len(util) if util else None, "bytes_sent": None,
               "failed_exchanges": sum(r.get("failed_exchanges") or 0 for r in rows),
               "config": done0.get("config"), "peer": done0.get("peer"), "torchft": done0.get("torchft"),
               "commits": done0.get("commits"), "cpu_per_train_second": _cpu_fraction(run_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return rows


def _cpu_fraction(run_dir: Path) -> float | None:
    """Mean over ranks of CPU seconds / training wall seconds (1.0 = one core busy all the time)."""
    v = []
    for p in run_dir.glob("rank*.done.json"):
        d = json.loads(p.read_text())
        if d.get("train_cpu_seconds") is not None and d.get("train_seconds"):
            v.append(d["train_cpu_seconds"] / d["train_seconds"])
    return sum(v) / len(v) if v else None


def dead_worker_cost(rows: list[dict[str, Any]], die_at_step: int, sync_every: int) -> dict[str, Any]:
    """What one dead worker cost a survivor, from that survivor's own rows (one per outer round).

    * ``stall_seconds``: the blocked seconds above normal, summed over the round the worker died in and the
      rounds after it: ``sum(max(0, blocked_k - median(blocked before the death)))``;
    * ``rounds_lost``: outer updates that did not happen (torchft: rounds whose commit failed, so their inner steps
      were discarded and the parameters reset to the round start; FG-DiLoCo never discards a round: 0), and
      ``discarded_seconds``: the inner-compute seconds of those rounds;
    * ``seconds_lost`` = stall + discarded seconds: what the survivors would have gained had the worker left
      cleanly;
    * ``failed_exchanges`` (FG-DiLoCo) and ``participants_after`` (torchft) for the record.

    Raises:
        ValueError: no round before the death (nothing to call normal), or no round after it.
    """
    died_round = -(-die_at_step // sync_every)
    train = [r for r in rows if r["round"] > 0]
    before = [r["blocked_seconds"] for r in train if r["round"] < died_round]
    after = [r for r in train if r["round"] >= died_round]
    if not before or not after:
        raise ValueError(f"need rounds before and after the death (round {died_round}); got rounds "
                         f"{[r['round'] for r in train]}")
    normal = statistics.median(before)
    stall = sum(max(0.0, r["blocked_seconds"] - normal) for r in after)
    lost_rounds: list[int] = []
    discarded = 0.0
    if any("commits" in r for r in train):
        last_normal = max((r for r in train if r["round"] < died_round), key=lambda r: r["round"])
        per_round = max(round(last_normal["commits"] / last_normal["round"]), 1)  # fragment syncs per round
        prev = last_normal["commits"]
        for r in after:
            got = r["commits"] - prev
            if got < per_round:
                lost_rounds.append(r["round"])
                discarded += (per_round - got) / per_round * (r["round_seconds"] - r["blocked_seconds"])
            prev = r["commits"]
    return {
        "died_at_step": die_at_step,
        "died_in_round": died_round,
        "normal_blocked_seconds": normal,
        "stall_seconds": stall,
        "rounds_lost": len(lost_rounds),
        "lost_rounds": lost_rounds,
        "discarded_seconds": discarded,
        "seconds_lost": stall + discarded,
        "blocked_seconds_by_round": {r["round"]: r["blocked_seconds"] for r in train},
        "failed_exchanges": sum(r.get("failed_exchanges") or 0 for r in after),
        "participants_after": [r.get("participants") for r in after] if any("participants" in r for r in after)
        else None,
    }
