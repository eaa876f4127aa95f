"""What a death, a hang and a join cost in an elastic job, measured where users launch it: ``fgdiloco launch``
(each worker its own ``torchrun`` job with restarts, a gossip store no worker hosts) running
``examples/elastic_gpt.py`` (a small GPT on the bundled public-domain text).

Run from the repository root::

    python -m benchmarks.faults            # writes benchmarks/results/faults.json

Three jobs of ``--workers`` workers on the same work (``--rounds`` outer rounds of H = ``--sync-every``), one after
the other in this process tree:

* ``clean``: nothing happens;
* ``death``: worker ``W-1`` calls ``os._exit`` at round ``--crash-round``; torchrun restarts it, it loads its own
  checkpoint (every round) and rejoins at the live round;
* ``hang``: worker 1 is SIGSTOPped for ``--hang-seconds`` at round ``--crash-round`` and continued.

Reported per job: wall seconds of the survivors' training (ratio against ``clean``), held-out loss (mean over
workers; ratio against ``clean``), failed exchanges, and for the faulty worker: seconds from the death to the
restarted process running again (``restart_seconds``: torchrun's restart, two Python + torch start-ups), from the
death to its first trained round after rejoining (``rejoin_seconds``), and the rounds it missed (``rounds_lost``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "elastic_gpt.py")
OUT = ROOT / "benchmarks" / "results" / "faults.json"


def _run(folder: Path, args: argparse.Namespace, extra: list[str], env: dict[str, str],
         hang: tuple[int, float] | None = None) -> dict:
    folder.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fgdiloco", "launch", "--workers", str(args.workers), "--max-restarts", "2",
           "--log-dir", str(folder / "logs"), SCRIPT, "--rounds", str(args.rounds), "--sync-every",
           str(args.sync_every), "--checkpoint-dir", str(folder / "ckpt"), "--results", str(folder / "res"), *extra]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hung_at = None
    if hang is not None:
        worker, seconds = hang
        log = folder / "logs" / f"worker{worker}.log"
        while f"round {args.crash_round - 1:3d}" not in (log.read_text() if log.exists() else ""):
            if proc.poll() is not None:
                raise RuntimeError(f"the job ended before worker {worker} reached round {args.crash_round}")
            time.sleep(0.1)
        pid = int((folder / "res" / f"worker{worker}.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        hung_at = time.time()
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"fgdiloco launch failed ({proc.returncode}):\n{out[-3000:]}")
    res = {int(f.stem[6:]): json.loads(f.read_text()) for f in (folder / "res").glob("worker*.json")}
    logs = {k: (folder / "logs" / f"worker{k}.log").read_text(errors="replace") for k in res}
    return {"results": res, "logs": logs, "launch_seconds": time.time() - t0, "hung_at": hung_at,
            "rounds": args.rounds}


def _round_times(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"round +(\d+) .* at (\d+\.\d+)", log)}


def _summary(run: dict, faulty: int | None, clean: dict | None) -> dict:
    res, logs = run["results"], run["logs"]
    losses = [w["held_out_loss"] for w in res.values()]
    survivors = [k for k in res if k != faulty]
    spans = []
    for k in survivors:
        t = _round_times(logs[k])
        spans.append(max(t.values()) - min(t.values()))
    row = {
        "held_out_loss": sum(losses) / len(losses),
        "survivor_train_seconds": max(spans),
        "failed_exchanges": {k: res[k]["failed_exchanges"] for k in sorted(res)},
        "launch_seconds": run["launch_seconds"],
    }
    if clean is not None:
        row["loss_vs_clean"] = row["held_out_loss"] / clean["held_out_loss"]
        row["survivor_seconds_vs_clean"] = row["survivor_train_seconds"] / clean["survivor_train_seconds"]
    if faulty is not None:
        log = logs[faulty]
        death = re.search(r"dying at round (\d+) .* at (\d+\.\d+)", log)
        t_fault = float(death.group(2)) if death else run["hung_at"]
        fault_round = int(death.group(1)) if death else None
        back = re.search(r"resumed from .* at round \d+ at (\d+\.\d+)", log)
        rounds = res[faulty]["rounds_trained"]
        after = {r: t for r, t in _round_times(log).items() if t > t_fault + 0.5}
        first = min(after) if after else None
        if death:  # the restarted process trained rounds first_after .. end; the ones between are lost
            lost = (first - fault_round) if first is not None else None
        else:  # a hang: the same process finishes its round, then jumps to the live round
            fault_round = max((r for r, t in _round_times(log).items() if t <= t_fault), default=-1) + 1
            lost = run["rounds"] - len(rounds)
        row.update(fault_round=fault_round, restart_seconds=float(back.group(1)) - t_fault if back else None,
                   rejoin_seconds=(after[first] - t_fault) if first is not None else None,
                   first_round_after=first, rounds_lost=lost, rejoins=res[faulty]["rejoins"],
                   faulty_rounds_trained=len(rounds))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=120)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--crash-round", type=int, default=5)
    p.add_argument("--hang-seconds", type=float, default=15.0)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(Path(tmp) / "xdg"))
        code = ("from fgdiloco.pretrain import data; t = data.load_text(None); c = data.cache_dir_for(None); "
                "data.encode_corpus(t, data.build_tokenizer(t, 'bpe', vocab_size=1024, cache_dir=c), cache_dir=c)")
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        clean = _summary(_run(Path(tmp) / "clean", args, [], env), None, None)
        print(f"clean: held-out {clean['held_out_loss']:.4f}, training {clean['survivor_train_seconds']:.1f} s")
        faulty = args.workers - 1
        death = _summary(_run(Path(tmp) / "death", args, ["--crash-worker", str(faulty), "--crash-round",
                                                          str(args.crash_round)], env), faulty, clean)
        print(f"death: held-out {death['held_out_loss']:.4f} ({death['loss_vs_clean']:.3f}x clean), survivors "
              f"{death['survivor_seconds_vs_clean']:.2f}x clean's time; restart {death['restart_seconds']:.1f} s, "
              f"rejoined {death['rejoin_seconds']:.1f} s after the death, {death['rounds_lost']} rounds lost")
        hang = _summary(_run(Path(tmp) / "hang", args, [], env, hang=(1, args.hang_seconds)), 1, clean)
        print(f"hang ({args.hang_seconds:.0f} s): held-out {hang['held_out_loss']:.4f} ({hang['loss_vs_clean']:.3f}x "
              f"clean), survivors {hang['survivor_seconds_vs_clean']:.2f}x clean's time; back in "
              f"{hang['rejoin_seconds']:.1f} s, {hang['rounds_lost']} rounds lost")
    result = {"config": vars(args), "clean": clean, "death": death, "hang": hang,
              "note": "2-core machine; all workers share it, so a restart's torch import competes with training"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
