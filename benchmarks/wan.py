"""What FG-DiLoCo buys over a slow network: the same pretraining job, side by side, on shaped links.

Run from the repository root, as root (network namespaces)::

    python -m benchmarks.wan             # full run, ~30 min on 2 cores; writes benchmarks/results/wan.json + PNGs
    python -m benchmarks.wan --quick     # ~2-minute smoke version (100 Mbit/s only, short runs)
    pip install -e ".[bench]"            # torchft, for --peers only
    python -m benchmarks.wan --peers     # every method + torchft's DiLoCo / Streaming DiLoCo at 10 and 100 Mbit/s,
                                         # then the dead-worker runs (~40 min); writes results/wan_peers.json + PNGs
    python -m benchmarks.wan --peers --quick   # ~5-minute check of that path: 100 Mbit/s, 60 steps, 4 methods
    python -m benchmarks.wan --peers --grid --bandwidths 100,10   # the tuning grid of both sides (~12 min)
    python -m benchmarks.wan --peers --seeds 0,1,2 --cpus-per-worker 0.45   # each worker a host of 0.45 of a core
    python -m benchmarks.wan --peers --seeds 0,1,2 --cpus-per-worker 0.35 --quota-training-thread
                                         # the share on each worker's training thread only, its other threads on
                                         # the spare cores (a GPU host's regime; cgroup v1)

Four workers, each in its own network namespace (``benchmarks/netns.py``: veth pairs to a bridge, both ends shaped
with ``tc ... tbf`` at 10, 100 and 1000 Mbit/s; addresses in 10.213.0.0/24 that exist only inside those
namespaces), train the example GPT of ``fgdiloco pretrain`` on its bundled public-domain corpus (same seed, same
batches per worker, same token budget) with ``fgdiloco.pretrain.worker.train_worker`` under:

* ``ddp``: ``DistributedDataParallel``, gradients all-reduced every step;
* ``diloco``: ``FGDiLoCo(topology="allreduce", codec="dense")`` = DiLoCo;
* ``localsgd``: PyTorch's own ``PeriodicModelAverager`` (period = H; local SGD with parameter averaging);
* ``fg-*``: FG-DiLoCo (random topology) with ``mix2_rounds`` in {0, 1} x codec in {dense, LowRank(rank=4, int8)};
* ``torchft-diloco`` / ``torchft-streaming`` (``--peers``): torchft's ``DiLoCo`` and Streaming DiLoCo on the same
  job (``benchmarks/peers.py``), the lighthouse in worker 0's namespace; their table's ratios are to torchft DiLoCo.
  ``--peers`` also kills one worker mid-round in a run of torchft DiLoCo, Streaming DiLoCo and FG-DiLoCo (LowRank,
  r2=1) at 100 Mbit/s and reports the seconds and rounds that cost the survivors.

Per method: compute utilisation (inner-compute seconds / wall seconds; for DDP and local SGD: seconds not blocked
in communication / wall seconds, measured the same way), wall seconds and tokens to reach DiLoCo's final held-out
loss, held-out loss at equal tokens, bytes each worker sent **measured on its veth** (``tx_bytes`` counters: TCP/IP
headers, the store and all traffic included, for every method), and each one's ratio to DiLoCo. Held-out loss is
the mean over the 4 replicas (identical replicas for DDP/DiLoCo/local SGD after averaging).

4 workers share 2 CPU cores here (OMP_NUM_THREADS=1 each), so every step is slowed by oversubscription, equally
for all methods; utilisation and time ratios are what carries over, not absolute seconds. Evaluation time is
excluded from every time (``train_seconds``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fgdiloco.pretrain.comparison import (
    DIED_EXIT_CODE,
    FAMILY,
    FG_GRID,
    JOB,
    LABEL,
    METHODS,
    OUTER_GRID,
    OUTER_GRID_BASES,
    PEERS,
    STREAMING_GRID,
    compare,
    dead_worker_cost,
    known_method,
    outer_variant,
    peer_targets,
    ratio_key,
    row_loss,
    seed_summary,
    targets,
)
from fgdiloco.pretrain.merge import read_rank_rows, write_merged

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"

#: --peers: the dead-worker runs (one worker os._exit()s mid-round), at 100 Mbit/s
FAULT_METHODS = ("torchft-diloco", "torchft-streaming", "fg-lowrank-r2=1")
FAULT_RANK = 3
#: FG-DiLoCo's exchange timeout in the dead-worker runs: the 5 s in which torchft's lighthouse declares a replica
#: dead by default (heartbeat_timeout_ms=5000), so both get the same failure-detection budget
FAULT_TIMEOUT = 5.0


# ---------------------------------------------------------------------------------------------------- worker side
def worker_main(config_path: str) -> int:
    """One worker, inside its namespace: torchrun-style env vars are set by the orchestrator."""
    from benchmarks.netns import confine_training_thread

    confine_training_thread()  # --quota-training-thread: only this thread, the inner steps', under the quota
    import fgdiloco
    from fgdiloco.pretrain.config import TrainConfig
    from fgdiloco.pretrain.worker import train_worker

    print(f"[wan worker] fgdiloco from {Path(fgdiloco.__file__).parent}", flush=True)
    raw = json.loads(Path(config_path).read_text())
    if "peer" in raw:
        from benchmarks.peers import peer_worker

        return peer_worker(raw)
    dropped = sorted(set(raw) - set(TrainConfig.names()))
    if dropped:
        print(f"[wan worker] this fgdiloco has no {dropped}: ignored", flush=True)
    train_worker(TrainConfig.from_dict(raw, strict=False))
    return 0


# ---------------------------------------------------------------------------------------------------- analysis
def _rows(run_dir: Path) -> list[dict[str, Any]]:
    p = run_dir / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def summarise_run(name: str, bw: float, run_dir: Path, meta: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    rows = _rows(run_dir)
    spath = run_dir / "summary.json"
    s = json.loads(spath.read_text()) if spath.is_file() else {}
    out: dict[str, Any] = {"method": name, "label": LABEL[name], "family": FAMILY.get(name, "fgdiloco"),
                           "bandwidth_mbit": bw, **meta}
    cfg = METHODS[name]
    # CPU seconds / training second, mean over the ranks (the rank files of every run through benchmarks/peers.py)
    out["cpu_per_train_second"] = s.get("cpu_per_train_second")
    if "peer" in cfg:
        out.update({"codec": "fp32 all-reduce", "peer": s.get("peer"), "torchft": s.get("torchft"),
                    "commits": s.get("commits"), "sync_every": job["sync_every"]})
    else:
        codec = cfg.get("codec", "dense")
        out.update({"codec": codec + (f"_r{cfg.get('codec_rank', 4)}_int8" if codec == "lowrank" else ""),
                    "topology": cfg.get("topology"), "mix1_rounds": cfg.get("mix1_rounds", 1),
                    "mix2_rounds": cfg.get("mix2_rounds", 1), "sync_every": job["sync_every"]})
    if not rows or len(rows) < 2:
        out["error"] = out.get("error") or "no metrics"
        return out
    train_rows = rows[1:]
    last = rows[-1]
    clock = "train_seconds_slowest" if "train_seconds_slowest" in last else "train_seconds"  # the job's time
    wall = last[clock]
    util_rows = [r for r in train_rows if r.get("round_seconds") and r.get("utilisation_mean") is not None]
    rs = sum(r["round_seconds"] for r in util_rows)
    # total-time utilisation: sum of compute seconds / sum of round seconds (means over ranks where logged)
    util = (sum(r["utilisation_mean"] * r["round_seconds"] for r in util_rows) / rs) if rs else s.get("utilisation")
    steps_done = last["step"]
    rounds = last["round"]
    tx = last.get("net_tx_bytes_mean")
    out.update({
        "steps": steps_done,
        "rounds": rounds,
        "tokens": last["tokens"],
        "train_seconds": wall,
        "utilisation": util,
        "round_seconds": wall / rounds if rounds else None,
        "step_seconds_compute": (util * wall / steps_done) if util is not None and steps_done else None,
        "initial_loss": row_loss(rows[0]),
        "final_loss": row_loss(last),
        "final_loss_rank0": last["eval_loss"],
        "wire_tx_bytes_per_worker": tx,
        "wire_rx_bytes_per_worker": last.get("net_rx_bytes_mean"),
        "wire_tx_bytes_per_round": tx / rounds if tx and rounds else None,
        "frame_bytes_per_worker": s.get("bytes_sent_per_worker", s.get("bytes_sent")),
        "capped": bool(s.get("stopped_early")) or steps_done < job["steps"],
        "failed_exchanges": s.get("failed_exchanges"),
        "train_config": s.get("config"),
        "mix2_seconds_mean": _mean(r.get("mix2_seconds") for r in train_rows),
        "mix1_wait_seconds_mean": _mean(r.get("mix1_wait_seconds") for r in train_rows),
        "mix1_seconds_mean": _mean(r.get("mix1_seconds") for r in train_rows),
        "outer_seconds": None,
        "clock": clock,
        "curve": [{"tokens": r["tokens"], "train_seconds": r[clock], "loss": row_loss(r)} for r in rows],
    })
    return out


def _mean(xs: Any) -> float | None:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None



# ---------------------------------------------------------------------------------------------------- plots
def plot(runs: list[dict[str, Any]], bandwidths: list[float], table: dict[str, Any], out: Path,
         name: str = "wan_loss.png") -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    colors = {"ddp": "C3", "diloco": "C0", "localsgd": "C5", "fg-dense-r2=0": "C4", "fg-dense-r2=1": "C1",
              "fg-lowrank-r2=0": "C9", "fg-lowrank-r2=1": "C2", "torchft-diloco": "C7", "torchft-streaming": "C8",
              "fg-stream-f2": "C6", "fg-stream-f2-t2-a0.5": "C1"}
    spare = iter(matplotlib.colormaps["tab20"].colors[1::2] * 2)  # the tuning grid's other points
    for r in runs:
        colors.setdefault(r["method"], next(spare))
    fig, axes = plt.subplots(2, len(bandwidths), figsize=(5.2 * len(bandwidths), 8), squeeze=False)
    for j, bw in enumerate(bandwidths):
        for r in runs:
            if r["bandwidth_mbit"] != bw or r.get("error"):
                continue
            c = r["curve"]
            kw = dict(color=colors[r["method"]],
                      lw=1.4 if r["method"] in ("diloco", "fg-lowrank-r2=1", "torchft-diloco") else 1.0,
                      ls="--" if r["method"].startswith("torchft") else "-",
                      label=r["label"] + (" (capped)" if r["capped"] else ""))
            axes[0][j].plot([p["train_seconds"] for p in c], [p["loss"] for p in c], **kw)
            axes[1][j].plot([p["tokens"] / 1e6 for p in c], [p["loss"] for p in c], **kw)
        t = table.get(f"{bw:g}")
        for i in (0, 1):
            if t:
                axes[i][j].axhline(t["target_loss"], ls=":", color="grey", lw=0.8, label="target: DiLoCo final")
            axes[i][j].grid(alpha=0.3)
            axes[i][j].set_ylabel("held-out loss (mean over workers)")
        axes[0][j].set_title(f"{bw:g} Mbit/s per worker (tbf, 4 workers)", fontsize=10)
        axes[0][j].set_xlabel("wall seconds (training; evaluation excluded)")
        axes[1][j].set_xlabel("tokens seen by all workers (millions)")
        axes[0][j].legend(fontsize=7)
    sep = "\n" if len(bandwidths) == 1 else "; "
    fig.suptitle(f"Same job, same tokens per worker{sep}4 workers share 2 CPU cores (compute slowed equally for all)",
                 fontsize=10)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def plot_dead_worker(fault_runs: list[dict[str, Any]], out: Path,
                     name: str = "wan_peers_dead_worker.png") -> str | None:
    """Blocked seconds per outer round (mean over the survivors) of each dead-worker run, the death marked."""
    ok = [r for r in fault_runs if not r.get("error") and not (r.get("dead_worker") or {}).get("error")]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in ok:
        d = r["dead_worker"]
        # round keys are ints in memory and strings once read back from the JSON
        per = [{int(k): v for k, v in c["blocked_seconds_by_round"].items()} for c in d["per_rank"].values()
               if "error" not in c]
        rounds = sorted({k for c in per for k in c})
        mean = [statistics.mean(c[k] for c in per if k in c) for k in rounds]
        ax.plot(rounds, mean, "o-", ms=3, label=f"{LABEL[r['method']]}: {d['seconds_lost']:.1f} s lost, "
                                                f"{d['rounds_lost']:g} rounds lost")
    d0 = ok[0]["dead_worker"]
    died = d0.get("died_in_round", -(-d0["die_at_step"] // ok[0]["sync_every"]))
    ax.axvline(died, ls=":", color="grey", label=f"worker {d0['die_rank']} dies (step {d0['die_at_step']})")
    ax.set_xlabel("outer round")
    ax.set_ylabel("seconds blocked in the round (mean over survivors)")
    ax.set_title(f"One dead worker at {ok[0]['bandwidth_mbit']:g} Mbit/s, 4 workers", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------------------------------- orchestrator
def _prepare_data(job: dict[str, Any], cache: Path) -> None:
    """Build (or load) the tokenizer and token cache once, before any worker starts."""
    from fgdiloco.pretrain.data import build_tokenizer, encode_corpus, load_text

    text = load_text(None)
    tok = build_tokenizer(text, "bpe", job["vocab_size"], cache_dir=cache)
    encode_corpus(text, tok, cache_dir=cache)


def snapshot_code(dest_root: Path) -> dict[str, Any]:
    """Extract ``fgdiloco/`` of the repository's HEAD commit into ``dest_root/<commit>``: every worker of every run
    imports this frozen copy, so code that others change in the working tree meanwhile cannot leak into a run."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "fgdiloco"], capture_output=True,
                           text=True).stdout.split("\n")
    dest = dest_root / f"code-{head[:12]}"
    if not (dest / "fgdiloco" / "__init__.py").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", head, "fgdiloco"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout, check=True)
    return {"commit": head, "path": str(dest),
            "working_tree_changes_not_used": [d.strip() for d in dirty if d.strip()]}


def lighthouse_binary() -> str:
    """Path of torchft's ``torchft_lighthouse`` next to this Python (``pip install -e ".[bench]"``).

    Raises:
        SystemExit: torchft is not installed in this environment.
    """
    cand = Path(sys.executable).with_name("torchft_lighthouse")
    found = str(cand) if cand.is_file() else shutil.which("torchft_lighthouse")
    if not found:
        raise SystemExit("the torchft methods need torchft: pip install -e \".[bench]\" (torchft_lighthouse not "
                         "found next to this Python)")
    return found


def run_one(net: Any, name: str, bw: float, job: dict[str, Any], run_dir: Path, port: int, cap_s: float | None,
            hard_s: float, code: dict[str, Any], cache: Path, fault: dict[str, Any] | None = None,
            barrier_free: bool = False) -> dict[str, Any]:
    """Run method ``name`` once on the cluster's links and summarise it. ``fault``: ``{"die_rank", "die_at_step"}``
    for a dead-worker run (through ``benchmarks/peers.py`` for every method; no time cap). ``barrier_free``: every
    method through ``benchmarks/peers.py`` with no collective between the workers but the method's own (each rank
    keeps its rows, merged after training; no stop flag, so no ``cap_s``): the row collective of
    ``train_worker`` is a barrier at every round whose waits the workers' clocks exclude, which hides the skew
    between workers that a method without a global all-reduce would otherwise pay in its exchanges."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    method = json.loads(json.dumps(METHODS[name]))
    if (fault is not None or barrier_free) and "peer" not in method:
        method["peer"] = {"backend": "fgdiloco"}
    if barrier_free:
        method["peer"]["stop_flag"] = False
        cap_s = None
    peer = method.get("peer")
    cfg = {k: v for k, v in job.items() if k != "workers"}
    cfg.update(workers=job["workers"], out=str(run_dir), quiet=True, timeout=120.0, eval_every=1, cache_dir=str(cache),
               max_seconds=cap_s, net_counters=True, eval_deferred=True, **method)
    lighthouse = None
    if peer is not None:
        if fault is not None:
            peer.update(fault)
            if peer["backend"] == "fgdiloco":
                cfg["timeout"] = FAULT_TIMEOUT
        if peer["backend"] == "torchft":
            # fresh ports for every run (a run's sockets may linger in TIME_WAIT in the next); the store and the
            # manager listen in each worker's own namespace, the lighthouse in worker 0's
            lh_port = port + 300
            # every quorum holds all workers; a dead-worker run goes on with one fewer
            peer.update(lighthouse=f"http://{net.addrs[0]}:{lh_port}", store_port=port + 100, manager_port=port + 200,
                        min_replicas=job["workers"] - (1 if fault else 0))
    cfg_path = run_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    env_common = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                  "PYTHONPATH": f"{code['path']}:{ROOT}"}  # fgdiloco from the frozen snapshot (also the cwd, which
    # python -m puts first on sys.path), benchmarks from this checkout
    procs = []
    t0 = time.perf_counter()
    if peer is not None and peer["backend"] == "torchft":
        # the lighthouse listens on worker 0's address only: reachable inside the namespaces, nowhere else
        lh_log = open(run_dir / "lighthouse.log", "w")  # noqa: SIM115 - closed below
        lighthouse = (net.popen(0, [lighthouse_binary(), "--bind", f"{net.addrs[0]}:{lh_port}", "--min_replicas",
                                    str(peer["min_replicas"])], stdout=lh_log, stderr=subprocess.STDOUT,
                                   quota=False), lh_log)  # a service of the job's, not worker 0's work
    expected = {fault["die_rank"]: DIED_EXIT_CODE} if fault else {}
    for i in range(job["workers"]):
        env = {**env_common, **net.dist_env(i, port), "FGDB_ADDR": net.addrs[i]}
        log = open(run_dir / f"rank{i}.log", "w")  # noqa: SIM115 - closed below
        procs.append((net.popen(i, [sys.executable, "-m", "benchmarks.wan", "--worker", str(cfg_path)], env=env,
                                cwd=code["path"], stdout=log, stderr=subprocess.STDOUT), log))

    def failed(i: int, p: subprocess.Popen) -> bool:
        return p.poll() is not None and p.returncode != expected.get(i, 0)

    error = None
    try:
        deadline = t0 + hard_s
        while any(p.poll() is None for p, _ in procs):
            if time.perf_counter() > deadline:
                error = f"killed after {hard_s:.0f} s"
                break
            if any(failed(i, p) for i, (p, _) in enumerate(procs)):
                time.sleep(2.0)  # give the others a moment to report, then stop
                if any(p.poll() is None for p, _ in procs):
                    error = "a worker failed"
                    break
            time.sleep(0.2)
    finally:
        if lighthouse is not None:
            from benchmarks.peers import process_cpu_seconds

            lighthouse_cpu = process_cpu_seconds(lighthouse[0].pid)
        for p, log in procs + ([lighthouse] if lighthouse else []):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    rcs = [p.returncode for p, _ in procs]
    if error is None and any(rc != expected.get(i, 0) for i, rc in enumerate(rcs)):
        error = f"worker exit codes {rcs}"
    meta = {"process_seconds": round(time.perf_counter() - t0, 1), "exit_codes": rcs}
    if lighthouse is not None:  # CPU seconds the lighthouse used over the whole run (in worker 0's namespace)
        meta["lighthouse_cpu_seconds"] = lighthouse_cpu
    if peer is not None and (run_dir / "rank0.jsonl").is_file():
        write_merged(run_dir)
    if error and (run_dir / "summary.json").is_file():
        # rank 0 wrote the complete summary: the failure came after training (seen once: a worker aborted with
        # "terminate called without an active exception" at interpreter exit); keep the measurements
        meta["exit_warning"] = error
        error = None
    if error:
        tail = (run_dir / "rank0.log").read_text()[-1500:] if (run_dir / "rank0.log").is_file() else ""
        meta["error"] = error
        meta["log_tail"] = tail
    return summarise_run(name, bw, run_dir, meta, job)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="2-minute smoke run: 100 Mbit/s, fewer steps")
    ap.add_argument("--peers", action="store_true",
                    help="add torchft's DiLoCo and Streaming DiLoCo (pip install -e '.[bench]') and the dead-worker "
                         "runs (not with --seeds, --outer-grid or --no-faults); default bandwidths 10,100; writes "
                         "wan_peers.json")
    ap.add_argument("--no-faults", action="store_true", help="with --peers: skip the dead-worker runs")
    ap.add_argument("--fault-methods", default=None,
                    help=f"with --peers: the methods of the dead-worker runs, comma separated (default "
                         f"{','.join(FAULT_METHODS)})")
    ap.add_argument("--grid", action="store_true",
                    help="with --peers: the tuning grid only (torchft DiLoCo and both sides' F/tau/alpha grids)")
    ap.add_argument("--outer-grid", action="store_true",
                    help="with --peers: the outer optimizer's grid (lr x momentum, the same for both sides) on each "
                         "side's best F/tau/alpha setting, and torchft DiLoCo as the target; default 100 Mbit/s; "
                         "writes wan_peers_outer.json")
    ap.add_argument("--seeds", default=None,
                    help="with --peers: comma-separated seeds (e.g. 0,1,2); every method runs once per seed, default "
                         "methods torchft DiLoCo and each side's best setting of the --grid run, default 100 Mbit/s, "
                         "every method without the per-round row collective (no time cap); reports each method's "
                         "mean and spread over the seeds; writes wan_peers_seeds.json")
    ap.add_argument("--bandwidths", default=None, help="Mbit/s, comma separated (default 10,100,1000)")
    ap.add_argument("--methods", default=None, help=f"comma separated subset of {','.join(METHODS)}")
    ap.add_argument("--steps", type=int, default=None, help="inner steps per worker (token budget)")
    ap.add_argument("--cap-seconds", type=float, default=None,
                    help="training-time cap per run (a capped run reports the tokens it reached)")
    ap.add_argument("--sensitivity-h", type=int, default=None,
                    help="also run DiLoCo and FG-DiLoCo (LowRank, r2=1) at 100 Mbit/s with this H (full run: 20)")
    ap.add_argument("--cpus-per-worker", type=float, default=None,
                    help="CPU cores each worker's processes may use (a CFS quota per worker namespace), e.g. 0.45 for "
                         "4 workers on 2 cores: each worker is then a host of its own, and one that waits for the "
                         "network no longer lends its core to the others (default: no limit)")
    ap.add_argument("--quota-training-thread", action="store_true",
                    help="with --cpus-per-worker: the quota holds each worker's training thread only; its other "
                         "threads (gossip, Gloo, torchft's manager) run beside it without a limit, as on a GPU host "
                         "whose spare cores carry the communication (cgroup v1)")
    ap.add_argument("--out", default=None, help="JSON output (default benchmarks/results/wan.json)")
    ap.add_argument("--runs-dir", default="/tmp/fgdiloco-wan", help="per-run outputs (metrics.jsonl, logs)")
    ap.add_argument("--reanalyse", metavar="JSON", help="recompute tables, targets and the plot of a finished run")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.reanalyse:
        return reanalyse(Path(args.reanalyse))
    if args.quota_training_thread and not args.cpus_per_worker:
        raise SystemExit("--quota-training-thread needs --cpus-per-worker (the training thread's quota)")
    if os.geteuid() != 0:
        raise SystemExit("benchmarks.wan needs root (network namespaces)")
    from benchmarks.netns import NetnsCluster

    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else None
    if seeds is not None and not args.peers:
        raise SystemExit("--seeds compares against torchft: use it with --peers")
    job = dict(JOB)
    if args.quick:
        job.update(steps=60)
    if args.steps:
        job["steps"] = args.steps
    default_bw = ("100" if args.quick or args.outer_grid or seeds else "10,100") if args.peers else (
        "100" if args.quick else "10,100,1000")
    bandwidths = [float(x) for x in (args.bandwidths or default_bw).split(",")]
    if args.methods:
        methods = args.methods.split(",")
    elif args.peers and seeds:
        methods = ["torchft-diloco", *OUTER_GRID_BASES]
    elif args.peers and args.outer_grid:
        methods = ["torchft-diloco", *(outer_variant(base, lr, mom) for base in OUTER_GRID_BASES
                                       for lr, mom in OUTER_GRID)]
    elif args.peers and args.grid:
        methods = ["torchft-diloco", *STREAMING_GRID, *FG_GRID]
    elif args.peers:
        methods = (["diloco", "torchft-diloco", "torchft-streaming", "fg-lowrank-r2=1"] if args.quick
                   else list(METHODS))
    else:
        methods = (["diloco", "fg-lowrank-r2=1", "localsgd", "ddp"] if args.quick
                   else [m for m in METHODS if m not in PEERS])
    fault_methods = args.fault_methods.split(",") if args.fault_methods else list(FAULT_METHODS)
    for m in methods + fault_methods:
        if not known_method(m):
            raise SystemExit(f"unknown method {m!r}; use {', '.join(METHODS)}")
    if seeds and "torchft-diloco" not in methods:
        raise SystemExit("--seeds measures every method against torchft DiLoCo's final loss: add torchft-diloco to "
                         "--methods")
    faults = [m for m in fault_methods if args.peers and not args.no_faults and not args.outer_grid and not seeds]
    if any("peer" in METHODS[m] for m in methods + faults):
        lighthouse_binary()  # fails early without torchft
    # --peers --quick: torchft's rounds take up to 3 s each on the loaded 2 cores; 15 s would cut its short run
    cap = args.cap_seconds if args.cap_seconds else ((60.0 if args.peers else 15.0) if args.quick else 150.0)
    stem = ("wan_peers_outer" if args.outer_grid else "wan_peers_seeds" if seeds else "wan_peers") if args.peers \
        else "wan"
    out_path = Path(args.out) if args.out else RESULTS / (f"{stem}_quick.json" if args.quick else f"{stem}.json")
    runs_dir = Path(args.runs_dir) / (("peers-" if args.peers else "") + ("quick" if args.quick else "full"))
    t_all = time.perf_counter()
    print(f"[wan] job: {job}", flush=True)
    code = snapshot_code(Path(args.runs_dir))
    print(f"[wan] workers import fgdiloco from commit {code['commit'][:12]} ({code['path']})", flush=True)
    cache = Path(args.runs_dir) / "cache"
    _prepare_data(job, cache)
    result: dict[str, Any] = {
        "benchmark": "wan",
        "command": "python -m benchmarks.wan" + (" --peers" if args.peers else "") + (" --quick" if args.quick else "")
                   + (" --grid" if args.grid else "") + (" --outer-grid" if args.outer_grid else "")
                   + (f" --bandwidths {args.bandwidths}" if args.bandwidths else "")
                   + (f" --methods {args.methods}" if args.methods else "")
                   + (f" --seeds {args.seeds}" if args.seeds else "")
                   + (f" --cpus-per-worker {args.cpus_per_worker:g}" if args.cpus_per_worker else "")
                   + (" --quota-training-thread" if args.quota_training_thread else ""),
        "job": job, "workers": job["workers"], "methods": {m: METHODS[m] for m in methods}, "code": code,
        "bandwidths_mbit": bandwidths, "cap_seconds": cap,
        "notes": [
            "4 workers share 2 CPU cores (OMP_NUM_THREADS=1 each): compute per step is slowed by oversubscription "
            "equally for all methods; other engineers' jobs shared the machine too.",
            "bytes: tx_bytes of each worker's veth (inside its namespace) from the first to the last evaluation, "
            "mean over workers: IP/TCP headers, the TCPStore and all Gloo traffic included, for every method.",
            "utilisation: FG-DiLoCo / DiLoCo: RoundStats inner seconds / round seconds; DDP: 1 - (seconds from the "
            "last gradient bucket being ready to backward() returning) / wall; local SGD: 1 - (seconds in "
            "PeriodicModelAverager.average_parameters) / wall; all means over workers, evaluation excluded.",
            f"a run is capped at {cap:g} s of training; a capped run reports the tokens it reached.",
            "held-out loss: mean over the 4 replicas of the loss on the same held-out batches; weights are kept at "
            "every round and evaluated after training (eval_deferred), so nothing but training runs between rounds.",
            "no propagation delay is emulated (netem does not exist in this kernel): RTT is ~0.02 ms.",
        ] + ([
            f"--quota-training-thread: the {args.cpus_per_worker:g}-core quota holds each worker's training (main) "
            "thread only; its other threads run in a cgroup of their own without a limit (the machine's spare "
            "cores), as on a GPU host; a thread the training thread starts is moved out within 2 ms.",
        ] if args.quota_training_thread else []) + ([
            "torchft (benchmarks/peers.py): one replica group per worker (Manager + TCPStore in its namespace), "
            "torchft.ProcessGroupGloo across replicas, torchft_lighthouse in worker 0's namespace bound to its "
            "address; lighthouse min_replicas = Manager min_replica_size = 4 (dead-worker runs: 3); default "
            "heartbeat timeout (5 s); init_sync=False (same seed). Utilisation: 1 - seconds inside torchft's "
            "optimizer hooks / round seconds. should_quantize off: it needs Triton (GPU kernels); without it torchft "
            "sends fp32 anyway.",
            f"dead-worker runs: worker {FAULT_RANK} os._exit()s mid-round; no time cap; FG-DiLoCo through "
            f"benchmarks/peers.py with timeout {FAULT_TIMEOUT:g} s (torchft's default heartbeat timeout).",
        ] if args.peers else []),
    }
    runs: list[dict[str, Any]] = []
    extra_h = args.sensitivity_h if args.sensitivity_h is not None else (None if args.quick or args.peers else 20)
    sens_runs: list[dict[str, Any]] = []
    port = 29400
    with NetnsCluster(job["workers"], rate_mbit=bandwidths[0], cpus_per_worker=args.cpus_per_worker,
                      quota_training_thread=args.quota_training_thread) as net:
        result["network"] = {"namespaces": net.names, "addresses": net.addrs, "isolation": net.isolation_check(),
                             "rtt": net.measure_rtt(), "shaping_check": [], "cpus_per_worker": args.cpus_per_worker,
                             "quota_training_thread": args.quota_training_thread}
        for seed, bw in [(seed, bw) for seed in (seeds or [job["seed"]]) for bw in bandwidths]:
            net.set_rate(bw)
            chk = net.measure_throughput(0, 1, seconds=1.5 if args.quick else 2.0)
            chk["qdisc"] = net.qdiscs(0)
            result["network"]["shaping_check"].append(chk)
            print(f"[wan] {bw:g} Mbit/s: shaping check {chk['mbit_per_s']:.1f} Mbit/s measured", flush=True)
            for name in methods:
                port += 1
                t0 = time.perf_counter()
                run_dir = runs_dir / (f"seed{seed}" if seeds else "") / f"{bw:g}mbit" / name
                r = run_one(net, name, bw, dict(job, seed=seed), run_dir, port, cap_s=cap, hard_s=cap * 3 + 180,
                            code=code, cache=cache, barrier_free=bool(seeds))
                r["seed"] = seed
                runs.append(r)
                if r.get("error"):
                    print(f"[wan] {bw:g} Mbit/s {name}: ERROR {r['error']}\n{r.get('log_tail', '')}", flush=True)
                else:
                    print(f"[wan] seed {seed}, {bw:g} Mbit/s {name:<16} util {100 * (r['utilisation'] or 0):5.1f} %  "
                          f"train {r['train_seconds']:6.1f} s  tokens {r['tokens'] / 1e6:.2f}M  "
                          f"loss {r['final_loss']:.3f}  tx {(r['wire_tx_bytes_per_worker'] or 0) / 1e6:7.2f} MB  "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
                result["runs"] = runs
                out_path.parent.mkdir(parents=True, exist_ok=True)
                out_path.write_text(json.dumps(result, indent=1) + "\n")
        if extra_h and 100.0 in bandwidths:
            net.set_rate(100.0)
            job_h = dict(job, sync_every=extra_h)
            for name in ("diloco", "fg-lowrank-r2=1"):
                port += 1
                r = run_one(net, name, 100.0, job_h, runs_dir / f"100mbit-H{extra_h}" / name, port, cap_s=cap,
                            hard_s=cap * 3 + 180, code=code, cache=cache)
                sens_runs.append(r)
                print(f"[wan] sensitivity H={extra_h}, 100 Mbit/s {name:<16} "
                      f"util {100 * (r.get('utilisation') or 0):5.1f} %  "
                      f"train {r.get('train_seconds') or 0:6.1f} s  loss {r.get('final_loss') or 0:.3f}", flush=True)
        fault_runs: list[dict[str, Any]] = []
        if faults:
            bw_f = 100.0 if 100.0 in bandwidths else bandwidths[0]
            net.set_rate(bw_f)
            rounds = -(-job["steps"] // job["sync_every"])
            fault = {"die_rank": FAULT_RANK,
                     "die_at_step": job["sync_every"] * max(rounds // 3, 1) + job["sync_every"] // 2}
            for name in faults:
                port += 1
                rdir = runs_dir / f"{bw_f:g}mbit-dead-worker" / name
                r = run_one(net, name, bw_f, job, rdir, port, cap_s=None, hard_s=cap * 3 + 180, code=code,
                            cache=cache, fault=fault)
                r["dead_worker"] = fault_summary(rdir, fault, job)
                fault_runs.append(r)
                d = r["dead_worker"]
                print(f"[wan] dead worker, {bw_f:g} Mbit/s {name:<18} "
                      + (f"ERROR {r.get('error') or d.get('error')}" if r.get("error") or d.get("error") else
                         f"seconds lost {d['seconds_lost']:.2f} (stall {d['stall_seconds']:.2f}, discarded "
                         f"{d['discarded_seconds']:.2f})  rounds lost {d['rounds_lost']}"), flush=True)
                result["dead_worker_runs"] = fault_runs
                out_path.write_text(json.dumps(result, indent=1) + "\n")
    if seeds:  # the tables and targets below are the first seed's; the summary is over all of them
        result["seed_tables"] = {seed: compare([r for r in runs if r["seed"] == seed], bandwidths, "torchft-diloco")
                                 for seed in seeds}
        result["seed_summary"] = seed_summary(result["seed_tables"], f"{bandwidths[0]:g}")
        runs = [r for r in runs if r["seed"] == seeds[0]]
    table = compare(runs, bandwidths)
    result["table"] = table
    if any(r["method"] == "torchft-diloco" for r in runs):
        result["peers_table"] = compare(runs, bandwidths, "torchft-diloco")
        result["targets_vs_torchft"] = peer_targets(result["peers_table"])
    if sens_runs:
        result["sensitivity"] = {"sync_every": extra_h, "bandwidth_mbit": 100.0, "runs": sens_runs,
                                 "table": compare(sens_runs, [100.0])}
    result["targets_100mbit"] = targets(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(runs, bandwidths, table, out_path.parent if not args.quick else Path(runs_dir),
                          name=f"{out_path.stem}_loss.png")
    if result.get("dead_worker_runs"):
        result["plot_dead_worker"] = plot_dead_worker(result["dead_worker_runs"],
                                                      out_path.parent if not args.quick else Path(runs_dir),
                                                      name=f"{out_path.stem}_dead_worker.png")
    result["seconds"] = round(time.perf_counter() - t_all, 1)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print_tables(result)
    print(f"[wan] wrote {out_path} and {result['plot']} in {result['seconds']:.0f} s")
    return 0


def reanalyse(path: Path) -> int:
    """Recompute the comparison (tables, targets, plot) of a finished wan.json from its measured curves."""
    result = json.loads(path.read_text())
    for r in result["runs"]:
        known_method(r["method"])  # outer-optimizer variants: registered by name
    bandwidths = result["bandwidths_mbit"]
    runs = result["runs"]
    if result.get("seed_summary"):
        seeds = result["seed_summary"]["seeds"]
        result["seed_tables"] = {seed: compare([r for r in runs if r["seed"] == seed], bandwidths, "torchft-diloco")
                                 for seed in seeds}
        result["seed_summary"] = seed_summary(result["seed_tables"], f"{bandwidths[0]:g}")
        runs = [r for r in runs if r["seed"] == seeds[0]]
    result["table"] = compare(runs, bandwidths)
    result["targets_100mbit"] = targets(result["table"])
    if result.get("sensitivity"):
        result["sensitivity"]["table"] = compare(result["sensitivity"]["runs"], [100.0])
    if any(r["method"] == "torchft-diloco" for r in runs):
        result["peers_table"] = compare(runs, bandwidths, "torchft-diloco")
        result["targets_vs_torchft"] = peer_targets(result["peers_table"])
    result["plot"] = plot(runs, bandwidths, result["table"], path.parent,
                          name=Path(result.get("plot") or "wan_loss.png").name)
    if result.get("dead_worker_runs"):
        result["plot_dead_worker"] = plot_dead_worker(
            result["dead_worker_runs"], path.parent,
            name=Path(result.get("plot_dead_worker") or f"{path.stem}_dead_worker.png").name)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print_tables(result)
    return 0


def fault_summary(run_dir: Path, fault: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """:func:`fgdiloco.pretrain.comparison.dead_worker_cost` for each survivor of a dead-worker run, and their
    mean."""
    per_rank = read_rank_rows(run_dir)
    costs = {}
    for rank, rows in sorted(per_rank.items()):
        if rank == fault["die_rank"]:
            continue
        try:
            costs[rank] = dead_worker_cost(rows, fault["die_at_step"], job["sync_every"])
        except ValueError as e:
            costs[rank] = {"error": str(e)}
    ok = [c for c in costs.values() if "error" not in c]
    if not ok:
        return {"error": "no survivor rows" if not costs else next(iter(costs.values()))["error"], "per_rank": costs}
    mean = {k: sum(c[k] for c in ok) / len(ok) for k in ("seconds_lost", "stall_seconds", "discarded_seconds",
                                                         "rounds_lost", "normal_blocked_seconds")}
    return {**fault, "died_in_round": ok[0]["died_in_round"], "survivors": sorted(costs), **mean,
            "lost_rounds": ok[0]["lost_rounds"],
            "failed_exchanges": sum(c["failed_exchanges"] for c in ok),
            "participants_after": ok[0]["participants_after"],
            "survivor_train_seconds": per_rank[0][-1]["train_seconds"] if per_rank.get(0) else None,
            "per_rank": costs}


def dead_worker_table(fault_runs: list[dict[str, Any]]) -> str:
    """Markdown: one row per dead-worker run (means over the survivors)."""
    lines = ["| method | worker dies at step (round) | seconds lost by each survivor | stall s | discarded compute s "
             "| rounds lost | normal blocked s / round | survivors' train s |", "|---|---|---|---|---|---|---|---|"]
    for r in fault_runs:
        d = r.get("dead_worker") or {}
        if r.get("error") or d.get("error"):
            lines.append(f"| {LABEL[r['method']]} | error: {r.get('error') or d.get('error')} | | | | | | |")
            continue
        lines.append(f"| {LABEL[r['method']]} | {d['die_at_step']} ({-(-d['die_at_step'] // r['sync_every'])}) | "
                     f"{d['seconds_lost']:.2f} | {d['stall_seconds']:.2f} | {d['discarded_seconds']:.2f} | "
                     f"{d['rounds_lost']:g} | {d['normal_blocked_seconds']:.3f} | "
                     f"{_fmt(d.get('survivor_train_seconds'), 's')} |")
    return "\n".join(lines)


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "s":
        return f"{v:.1f}"
    if kind == "mb":
        return f"{v / 1e6:.2f}"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "loss":
        return f"{v:.3f}"
    if kind == "mtok":
        return f"{v / 1e6:.2f}M"
    return str(v)


def markdown_tables(result: dict[str, Any], key: str = "table") -> str:
    """Per bandwidth: one row per method, each number followed by its ratio to the table's reference method
    (DiLoCo; torchft DiLoCo for ``key="peers_table"``)."""
    lines = []
    src = result.get("sensitivity", {}).get("table", {}) if key == "sensitivity" else result.get(key, {})

    def cell(v: Any, q: Any, kind: str) -> str:
        return _fmt(v, kind) + ("" if v is None or q is None else f" ({q:.2f}x)")

    for bw, t in src.items():
        ref = t.get("reference", "diloco")
        lines.append(f"\n**{bw} Mbit/s**: target = {LABEL[ref]}'s final held-out loss {t['target_loss']:.3f} (loose "
                     f"target +1 %: {t['loose_target_loss']:.3f}); equal tokens = {t['equal_tokens'] / 1e6:.2f}M. "
                     f"In brackets: ratio to {LABEL[ref]}.\n")
        lines.append("| method | utilisation | train s | loss @ equal tokens | s to target | tokens to target | "
                     "s to target +1 % | MB sent / worker (veth) |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for m, r in t["methods"].items():
            q = r[ratio_key(ref)]
            cap = f" (capped: {_fmt(r['tokens'], 'mtok')} tokens)" if r["capped"] else ""
            lines.append(
                f"| {LABEL[m]}{cap} | {cell(r['utilisation'], q['utilisation'], 'pct')} | "
                f"{cell(r['train_seconds'], q['train_seconds'], 's')} | "
                f"{cell(r['loss_at_equal_tokens'], q['loss_at_equal_tokens'], 'loss')} | "
                f"{cell(r['seconds_to_target'], q['seconds_to_target'], 's')} | "
                f"{cell(r['tokens_to_target'], q['tokens_to_target'], 'mtok')} | "
                f"{cell(r['seconds_to_loose_target'], q['seconds_to_loose_target'], 's')} | "
                f"{cell(r['wire_tx_bytes_per_worker'], q['wire_tx_bytes_per_worker'], 'mb')} |")
    return "\n".join(lines)


def seed_table(summary: dict[str, Any]) -> str:
    """Markdown: per method, each seed's held-out loss at equal tokens and seconds to the target, mean and spread;
    then the paired FG-DiLoCo / Streaming DiLoCo loss differences."""
    seeds = summary["seeds"]
    lines = [f"| method | loss @ equal tokens, seeds {', '.join(map(str, seeds))} | mean | spread | "
             "s to target per seed | s to target +1 % per seed | mean | train s, mean | utilisation, mean |",
             "|---|---|---:|---:|---|---|---:|---:|---:|"]
    for m, row in summary["methods"].items():
        loss, sec, loose = row["loss_at_equal_tokens"], row["seconds_to_target"], row["seconds_to_loose_target"]
        lines.append(f"| {LABEL[m]} | {' / '.join(_fmt(v, 'loss') for v in loss['per_seed'])} | "
                     f"{_fmt(loss['mean'], 'loss')} | {_fmt(loss['spread'], 'loss')} | "
                     f"{' / '.join(_fmt(v, 's') for v in sec['per_seed'])} | "
                     f"{' / '.join(_fmt(v, 's') for v in loose['per_seed'])} | {_fmt(loose['mean'], 's')} | "
                     f"{_fmt(row['train_seconds']['mean'], 's')} | {_fmt(row['utilisation']['mean'], 'pct')} |")
    for pair, d in summary["fg_vs_streaming"].items():
        per = " / ".join("-" if r is None else f"{100 * r:+.2f} %" for r in d["relative_loss_difference_per_seed"])
        mean = "-" if d["mean"] is None else f"{100 * d['mean']:+.2f} %"
        lines.append(f"\n{pair}: loss difference per seed {per}, mean {mean}; FG-DiLoCo lower or equal in "
                     f"{d['fg_lower_in_seeds']} of {len(seeds)} seeds")
    return "\n".join(lines)


def print_tables(result: dict[str, Any]) -> None:
    if result.get("seed_summary"):
        print(f"\n[wan] over seeds {result['seed_summary']['seeds']} (the tables after this one are seed "
              f"{result['seed_summary']['seeds'][0]}'s)")
        print(seed_table(result["seed_summary"]))
    print(markdown_tables(result))
    if result.get("peers_table"):
        print("\n[wan] against torchft")
        print(markdown_tables(result, "peers_table"))
        print("[wan] targets against torchft (each side's best setting):", json.dumps(result.get("targets_vs_torchft"),
                                                                         indent=1))
    if result.get("dead_worker_runs"):
        print("\n" + dead_worker_table(result["dead_worker_runs"]))
    if result.get("sensitivity"):
        print(f"\n[wan] sensitivity: H = {result['sensitivity']['sync_every']} at 100 Mbit/s")
        print(markdown_tables(result, "sensitivity"))
    print("[wan] targets at 100 Mbit/s:", json.dumps(result.get("targets_100mbit"), indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
