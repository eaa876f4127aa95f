"""What does gossip cost a worker in CPU? The codecs' work per gossip round, and a whole job with and without mixing.

Run from the repository root::

    python -m benchmarks.gossip_cpu            # about four minutes on 2 cores, with nothing else running

Why: under ``benchmarks.wan --peers --cpus-per-worker 0.45`` an FG-DiLoCo worker uses its whole core share while it
trains (it overlaps its gossip with the inner steps), so every CPU second its gossip threads spend lengthens its
rounds; torchft's workers wait on the network instead. This benchmark says how much CPU the gossip takes.

1. **Codec work per gossip round**, one worker's side (encode its message, frame it, check and decode the peer's,
   the pair session's arithmetic), on the model of ``benchmarks.wan``'s job (the example GPT, 2 layers of width
   128, vocabulary 1024, 536 k parameters) with random pseudo-gradients of its shapes: the median over 17 rounds of
   the thread CPU time of :func:`fgdiloco.gossip.mix.pair_round_in_process` for one pair, halved. Codecs: Mix2's
   ``LowRank(8)`` and ``LowRank(4)`` (int8 factors), Mix1's ``BF16()`` (with the frame's zstd) and ``Dense()``.
2. **A whole job**: ``fgdiloco pretrain`` with the WAN job's model and FG-DiLoCo's best setting there (rank 8,
   two Mix2 rounds on the exponential graph, tau = 4, Mix1 without momentum; 4 elastic workers, 30 rounds of
   H = 10), and the same job with ``--mix1-rounds 0 --mix2-rounds 0`` (no gossip at all), each ``--repeats`` times,
   alternating, after an untimed short job that caches the tokenizer. Reported: the CPU seconds of the job's whole
   process tree (``getrusage`` of the waited-for children: workers, torchrun agents, the store, the launcher) and
   their difference per worker and outer round, which is the gossip's CPU (the rest of the job is the same in
   both). On the 2-core machine a job's CPU varies by several seconds from run to run, which is the size of the
   difference: read it with its per-repeat values.

Results go to ``benchmarks/results/gossip_cpu.json``; benchmarks/RESULTS.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fgdiloco.factor import BF16, Dense, LowRank
from fgdiloco.gossip.mix import pair_round_in_process
from fgdiloco.pretrain.comparison import JOB, METHODS
from fgdiloco.pretrain.model import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
#: benchmarks.wan's job and FG-DiLoCo's best setting there (``fgdiloco.pretrain.comparison``)
FG_BEST = "fg-lowrank-t4-nm-r8-m2-exp"
VARIANTS = {"gossip": [], "no gossip": ["--mix1-rounds", "0", "--mix2-rounds", "0"]}


def _flags(settings: dict) -> list[str]:
    """``fgdiloco pretrain`` flags for TrainConfig fields (``{"n_layer": 2}`` -> ``["--n-layer", "2"]``)."""
    out = []
    for key, value in settings.items():
        out += [f"--{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


JOB_ARGV = [*_flags({**JOB, **METHODS[FG_BEST]}), "--eval-every", "10", "--quiet"]
CODECS = {"LowRank(8)": lambda: LowRank(8), "LowRank(4)": lambda: LowRank(4), "BF16()": BF16, "Dense()": Dense}


def codec_cpu(make, shapes: list[torch.Size], reps: int = 20) -> float:
    """Median thread CPU seconds of one worker's side of a pair's gossip round (the first 3 rounds left out)."""
    codecs = [make() for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(reps):
        values = [[torch.randn(s, generator=g) * 1e-3 for s in shapes] for _ in range(2)]
        t0 = time.thread_time()
        pair_round_in_process(codecs, values, [1, 0])
        times.append((time.thread_time() - t0) / 2)
    return statistics.median(times[3:])


def job_cpu(extra: list[str], folder: Path) -> dict:
    """CPU seconds of one ``fgdiloco pretrain`` job's process tree, and its summary's numbers."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "fgdiloco", "pretrain", *JOB_ARGV, *extra, "--cache-dir",
                    str(folder / "cache"), "--out", str(folder / "run"), "--overwrite"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    s = json.loads((folder / "run" / "summary.json").read_text())
    return {"cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "train_seconds": s["train_seconds"], "rounds": s["rounds"], "workers": s["workers"],
            "final_eval_loss_mean": s["final_eval_loss_mean"], "utilisation": s["utilisation"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each job variant (alternating)")
    ap.add_argument("--out", type=Path, default=RESULTS / "gossip_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = GPT(GPTConfig(**{k: JOB[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")}))
    shapes = [p.shape for p in model.parameters()]
    codecs = {name: codec_cpu(make, shapes) for name, make in CODECS.items()}
    for name, sec in codecs.items():
        print(f"[gossip_cpu] {name:11s} {1e3 * sec:5.1f} ms of CPU per gossip round, one worker's side", flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        job_cpu(["--steps", "20"], Path(tmp))  # untimed: trains the tokenizer into the cache the timed jobs share
        for i in range(args.repeats):
            for name, extra in VARIANTS.items():
                run = job_cpu(extra, Path(tmp))
                runs[name].append(run)
                print(f"[gossip_cpu] job, {name:9s} (run {i}): {run['cpu_seconds']:.1f} CPU s, "
                      f"{run['train_seconds']:.1f} s training, loss {run['final_eval_loss_mean']:.4f}", flush=True)
    worker_rounds = runs["gossip"][0]["workers"] * runs["gossip"][0]["rounds"]
    mean = {name: statistics.mean(r["cpu_seconds"] for r in rs) for name, rs in runs.items()}
    per_round = (mean["gossip"] - mean["no gossip"]) / worker_rounds
    summary = {
        "codec_cpu_ms_per_gossip_round": {k: round(1e3 * v, 2) for k, v in codecs.items()},
        "fg_best_codec_cpu_ms_per_outer_round": round(1e3 * (2 * codecs["LowRank(8)"] + codecs["BF16()"]), 2),
        "job_cpu_seconds_mean": mean,
        "gossip_cpu_seconds_per_worker_round": per_round,
        "gossip_cpu_seconds_per_worker_round_each_repeat": [
            (g["cpu_seconds"] - n["cpu_seconds"]) / worker_rounds for g, n in zip(runs["gossip"], runs["no gossip"])],
        "job_cpu_seconds": {name: [r["cpu_seconds"] for r in rs] for name, rs in runs.items()},
    }
    print(f"[gossip_cpu] gossip: {1e3 * per_round:.0f} ms of CPU per worker and outer round (codec work "
          f"{summary['fg_best_codec_cpu_ms_per_outer_round']:.0f} ms of it)", flush=True)
    result = {"benchmark": "gossip_cpu", "command": "python -m benchmarks.gossip_cpu " + " ".join(argv or []),
              "job": JOB_ARGV, "torch": torch.__version__, "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return result


if __name__ == "__main__":
    main()
