"""A chaos benchmark for elastic jobs: an ``fgdiloco launch`` job of real ``torchrun`` workers
(``examples/elastic_gpt.py``, a tiny GPT) under a seeded schedule of faults, one every few seconds, against the same
job without faults.

Run from the repository root::

    python -m benchmarks.chaos                 # writes benchmarks/results/chaos.json
    python -m benchmarks.chaos --pipeline      # the 2-stage variant: benchmarks/results/chaos_pipeline.json

The fault kinds (``--kinds``, drawn with ``--weights``; each at a time drawn around every ``--interval`` seconds):

* ``kill``: SIGKILL of a worker (its pid from ``<results>/worker<k>.pid``); torchrun restarts it, it loads its own
  checkpoint and rejoins;
* ``stop``: SIGSTOP of a worker for 5-20 s (``--stop-seconds``), then SIGCONT; it catches up with the live round;
* ``leave``: a clean departure (SIGUSR1: the example's ``--chaos`` makes the worker ``close()`` and exit 0); its slot
  is free for a joiner;
* ``join``: a new worker into a free slot (a spare one, or a departed worker's): ``fgdiloco launch --store ADDR
  --slots S --first-worker K --workers 1`` with its own checkpoint folder, so it joins fresh and adopts a live
  peer's state;
* ``bad_frames``: a worker sends corrupt (a byte flipped) or foreign (another layout's fingerprint) frames for
  ``--bad-rounds`` outer rounds (SIGUSR2); its peers reject them;
* ``store``: SIGKILL of the gossip store (the launcher's ``python -m fgdiloco.elastic.serve`` child), which the
  launcher restarts; the workers reconnect and re-publish.

Victims are drawn (seeded) among the workers that are up when the fault comes; a kind that cannot happen then (no
free slot to join, too few workers up to take one down) is replaced by one that can. No fault is injected during
the last ``--quiet-rounds`` rounds.

Reported per fault kind: count; rounds the victim lost (its last round before the fault to its first round after
the fault ended, minus one); seconds the others lost (for each fault, until the next one: the window's length minus
the rounds the workers up at the fault finished in it times the clean run's median round, averaged over them).
Overall: final held-out loss (mean over the workers that finished every round) against the clean run's, the
survivors' training time (first round to the last worker's last round) against the clean run's, exchanges that
waited out their full timeout (and hangs: two in a row on one worker with the same peer), workers lost that the
schedule did not kill for good (a slot neither departed nor finished), and files missing on disk (every tenure of
a slot must leave its checkpoint and its results).

The pipeline variant (``--pipeline``) runs ``examples/elastic_pipeline.py`` under ``fgdiloco launch --stages 2``
(one torchrun job of 2 stage processes per replica) with ``kill`` (SIGKILL of one stage process, pids from the
lives files), ``stop`` and ``store`` faults, and reports the same for its replicas (loss: the mean of the last 5
training losses of the last stage).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "elastic_gpt.py")
PIPE_SCRIPT = str(ROOT / "examples" / "elastic_pipeline.py")
OUT = ROOT / "benchmarks" / "results" / "chaos.json"
OUT_PIPE = ROOT / "benchmarks" / "results" / "chaos_pipeline.json"
KINDS = ("kill", "stop", "leave", "join", "bad_frames", "store")
ROUND_RE = re.compile(r"worker (\d+) round +(\d+) .* at (\d+\.\d+)")
PIPE_ROUND_RE = re.compile(r"worker (\d+) stage (\d+) round +(\d+) .* at (\d+\.\d+)")
TIMED_OUT_RE = re.compile(r"with rank (\d+) timed out after (\d+\.\d+) s")
NO_STATE_RE = re.compile(r"no peer sent its state|starts without slot")


# ---------------------------------------------------------------------------------------------------- schedule
def make_schedule(n: int, interval: float, seed: int, kinds: list[str], weights: list[float],
                  stop_seconds: tuple[float, float]) -> list[dict]:
    """``n`` faults: each its time (seconds after the job's first round), kind, SIGSTOP length and a number in
    [0, 1) that picks its victim among those up when it comes. Deterministic in ``seed``."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += interval * rng.uniform(0.5, 1.5)
        out.append({"i": i, "at": round(t, 3), "kind": rng.choices(kinds, weights)[0],
                    "seconds": round(rng.uniform(*stop_seconds), 2), "pick": rng.random(),
                    "fallback": rng.sample(kinds, len(kinds))})
    return out


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _serving(pid: int) -> bool:
    """Whether process ``pid`` holds an established TCP connection: the serving store child does (the workers'
    connections), its standby does not. (Both hold the listening socket: the supervisor hands it to both.)"""
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01":  # ESTABLISHED
                    inodes.add(fields[9])
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def _store_pid(launcher: int) -> int | None:
    """The gossip store child of the ``fgdiloco launch`` process ``launcher`` (``fgdiloco.elastic.serve``) that serves
    the store now (not its standby)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"fgdiloco.elastic.serve" in cmd and b"--parent" in cmd and cmd[cmd.index(b"--parent") + 1] == \
                str(launcher).encode() and _serving(int(d.name)):
            return int(d.name)
    return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _rounds(log: Path, stage: int | None = None) -> list[tuple[int, float]]:
    """(round, time) of every outer round a worker's log reports (``stage``: a pipeline replica's stage's)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    if stage is not None:
        return [(int(m.group(3)), float(m.group(4))) for m in PIPE_ROUND_RE.finditer(text)
                if int(m.group(2)) == stage]
    return [(int(m.group(2)), float(m.group(3))) for m in ROUND_RE.finditer(text)]


# ---------------------------------------------------------------------------------------------------- the job
class Tenure:
    """One occupant of a slot: the main launch's worker, or a joiner's own launch (its own folders)."""

    def __init__(self, slot: int, folder: Path, index: int, proc: subprocess.Popen | None = None):
        self.slot, self.index, self.proc = slot, index, proc
        self.res, self.ckpt, self.logs = folder / "res", folder / "ckpt", folder / "logs"
        self.state = "joining"  # joining | up | down (killed) | stopped | leaving | left | done
        self.killed_pid: int | None = None
        self.until = 0.0
        self.started = time.time()

    def pid(self) -> int | None:
        return _read_int(self.res / f"worker{self.slot}.pid")

    def log(self) -> Path:
        return self.logs / f"worker{self.slot}.log"


def _worker_args(args: argparse.Namespace, t: Tenure) -> list[str]:
    return [SCRIPT, "--rounds", str(args.rounds), "--sync-every", str(args.sync_every), "--n-layer", "1",
            "--n-embd", str(args.n_embd), "--vocab-size", str(args.vocab_size), "--block-size", "32",
            "--batch-size", "4", "--timeout", str(args.timeout), "--checkpoint-dir", str(t.ckpt), "--results",
            str(t.res), "--chaos", "--chaos-bad-rounds", str(args.bad_rounds)]


def _launch_cmd(args: argparse.Namespace, t: Tenure, workers: int, first: int, store: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "fgdiloco", "launch", "--workers", str(workers), "--slots",
           str(args.workers + args.spare), "--max-restarts", str(args.max_restarts), "--log-dir", str(t.logs)]
    if store is not None:
        cmd += ["--store", store, "--first-worker", str(first)]
    return cmd + _worker_args(args, t)


def run_job(folder: Path, args: argparse.Namespace, env: dict[str, str], faults: list[dict] | None) -> dict:
    """Run the job (with the fault schedule ``faults``, or clean); returns what happened."""
    folder.mkdir(parents=True)
    main = [Tenure(k, folder, 0) for k in range(args.workers)]
    launch_log = open(folder / "launch.log", "w")  # noqa: SIM115 - closed below
    launch = subprocess.Popen(_launch_cmd(args, main[0], args.workers, 0, None), env=env, cwd=folder,
                              stdout=launch_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    slots: dict[int, Tenure | None] = {k: main[k] for k in range(args.workers)}
    slots.update({k: None for k in range(args.workers, args.workers + args.spare)})
    tenures = list(main)
    address, done_faults, t0, deadline = None, [], None, time.time() + args.job_timeout
    pending = list(faults or [])
    last_store = 0.0

    def progress() -> float:  # the median of the workers' newest rounds (one far ahead does not end the faults)
        newest = [r for t in tenures if t.state not in ("left", "done") for r, _ in _rounds(t.log())[-1:]]
        return statistics.median(newest) if newest else -1

    try:
        next_check = 0.0
        while launch.poll() is None:
            now = time.time()
            if now > deadline:
                raise TimeoutError(f"the job ran past --job-timeout {args.job_timeout} s")
            for t in tenures:  # states
                pid = t.pid()
                if t.state in ("joining", "down") and pid and pid != t.killed_pid and _alive(pid):
                    t.state = "up"
                elif t.state == "stopped" and now >= t.until:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(t.killed_pid, signal.SIGCONT)
                    t.state = "up"
                elif t.state == "leaving" and not _alive(pid):
                    t.state = "left"
                    slots[t.slot] = None
                elif t.state == "up" and not _alive(pid) and (t.res / f"worker{t.slot}.json").exists():
                    t.state = "done"
            if t0 is None:
                if all(_rounds(t.log()) for t in main):
                    t0 = time.time()
                time.sleep(0.2)
                continue
            if address is None:
                address = _address_from(folder)
            if pending and now >= t0 + pending[0]["at"] and now >= next_check:
                if progress() >= args.rounds - args.quiet_rounds:
                    pending = []
                else:
                    f = pending.pop(0)
                    done = progress()
                    late = done >= args.rounds - args.join_rounds  # a joiner needs time to start
                    rec = _inject(f, args, tenures, slots, folder, env, None if late else address, launch.pid,
                                  last_store, _seconds_left(args.rounds, done, now - t0))
                    if rec is not None:
                        if rec["kind"] == "store":
                            last_store = rec["at"]
                        done_faults.append(rec)
                        print(f"  fault {len(done_faults):3d} at {rec['at'] - t0:6.1f} s: {rec['kind']:<10} "
                              f"victim {rec.get('victim')}", flush=True)
                    next_check = now + 0.5
            time.sleep(0.1)
        for t in sorted((t for t in tenures if t.state == "stopped"), key=lambda t: t.until):
            # a stop still running when the main job ended (a joiner's): continue it when due, as during the job
            time.sleep(max(0.0, t.until - time.time()))
            with contextlib.suppress(ProcessLookupError):
                os.kill(t.killed_pid, signal.SIGCONT)
            t.state = "up"
        t_end = time.time() + args.joiner_grace
        for t in tenures:  # joiners still running: let them finish (a joiner that never reached the store does not)
            if t.proc is not None:
                try:
                    t.proc.wait(timeout=max(1.0, t_end - time.time()))
                except subprocess.TimeoutExpired:
                    os.killpg(t.proc.pid, signal.SIGKILL)  # its own session: its launcher, agent and worker
                    t.proc.wait()
    finally:
        for t in tenures:
            if t.state == "stopped" and t.killed_pid:
                os.kill(t.killed_pid, signal.SIGCONT)
        if launch.poll() is None:  # the driver failed: the whole launch goes (its agents and workers too)
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
        launch_log.close()
    launch_out = (folder / "launch.log").read_text(errors="replace")
    return {"folder": str(folder), "t0": t0, "faults": done_faults, "launch_rc": launch.returncode,
            "launch_tail": launch_out[-3000:],
            "tenures": [{"slot": t.slot, "index": t.index, "res": str(t.res), "ckpt": str(t.ckpt),
                         "log": str(t.log()), "state": t.state, "started": t.started,
                         "rc": None if t.proc is None else t.proc.returncode} for t in tenures]}


def _seconds_left(rounds: int, done: float, elapsed: float) -> float:
    """Seconds the job has left at its pace so far (``done`` of ``rounds`` in ``elapsed`` s): a kill needs a
    restart's time (``--restart-seconds``) before the end, or its restart comes after the store has gone."""
    return (rounds - done) * elapsed / max(done, 1.0)


def _address_from(folder: Path) -> str | None:
    """The gossip store's address, from the first worker's environment as its log does not name it: the launch's
    ``FGDILOCO_STORE`` is in every worker's /proc environ."""
    pid = _read_int(folder / "res" / "worker0.pid")
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for e in env:
        if e.startswith(b"FGDILOCO_STORE="):
            return e.split(b"=", 1)[1].decode()
    return None


def _inject(f: dict, args: argparse.Namespace, tenures: list[Tenure], slots: dict[int, Tenure | None],
            folder: Path, env: dict[str, str], address: str | None, launcher: int, last_store: float,
            seconds_left: float = float("inf")) -> dict | None:
    up = [t for t in tenures if t.state == "up" and _alive(t.pid())]
    out_now = sum(1 for t in tenures if t.state in ("down", "stopped", "joining", "leaving"))
    free = sorted(k for k, t in slots.items() if t is None)
    now = time.time()

    def feasible(kind: str) -> bool:
        if kind == "kill" and seconds_left < args.restart_seconds:  # its restart would come after the job's end
            return False
        if kind in ("kill", "stop", "leave"):
            return len(up) > args.min_up and out_now < args.max_out
        if kind == "bad_frames":
            return bool(up)
        if kind == "join":
            return bool(free) and address is not None
        if kind == "store":
            return now - last_store > args.store_gap and _store_pid(launcher) is not None
        return False

    kind = f["kind"] if feasible(f["kind"]) else next((k for k in f["fallback"] if feasible(k)), None)
    if kind is None:
        return None
    rec = {"i": f["i"], "planned": f["kind"], "kind": kind, "at": now, "end": now,
           "up": sorted(t.slot for t in up)}
    if kind in ("kill", "stop", "leave", "bad_frames"):
        victim = up[int(f["pick"] * len(up))]
        pid = victim.pid()
        rec.update(victim=victim.slot, tenure=victim.index, pid=pid)
        if not _alive(pid):  # it died meanwhile
            return None
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
            victim.state, victim.killed_pid = "down", pid
        elif kind == "stop":
            os.kill(pid, signal.SIGSTOP)
            victim.state, victim.killed_pid, victim.until = "stopped", pid, now + f["seconds"]
            rec["end"] = victim.until
        elif kind == "leave":
            os.kill(pid, signal.SIGUSR1)
            victim.state = "leaving"
        else:
            os.kill(pid, signal.SIGUSR2)
    elif kind == "join":
        k = free[int(f["pick"] * len(free))]
        index = 1 + max(t.index for t in tenures)
        t = Tenure(k, folder / f"join{index}", index)
        t.proc = subprocess.Popen(_launch_cmd(args, t, 1, k, address), env={**env, "FGDILOCO_MIN_WORKERS": "0"},
                                  cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        tenures.append(t)
        slots[k] = t
        rec.update(victim=k, tenure=index)
    else:
        pid = _store_pid(launcher)
        os.kill(pid, signal.SIGKILL)
        rec.update(victim="store", pid=pid)
    return rec


# ---------------------------------------------------------------------------------------------------- summary
def _lost(rounds: list[tuple[int, float]], start: float, end: float) -> tuple[int | None, float | None]:
    """Rounds lost by a worker whose fault ran from ``start`` to ``end`` (the rounds from its last one before the
    fault to its third one after it that it did not train: a hung worker first finishes the round it was in, then
    jumps), and seconds from the fault to its first round after it."""
    a = max((r for r, t in rounds if t <= start), default=-1)
    after = sorted((t, r) for r, t in rounds if t > end)
    if not after:
        return None, None
    c = max(r for _, r in after[:3])
    trained = {r for r, t in rounds if t > start and a < r <= c}
    return max(c - a - len(trained), 0), after[0][0] - start


def _median_round(run: dict) -> float:
    durs = []
    for t in run["tenures"]:
        rs = _rounds(Path(t["log"]))
        durs += [t2 - t1 for (r1, t1), (r2, t2) in zip(rs, rs[1:]) if r2 == r1 + 1]
    return statistics.median(durs) if durs else float("nan")


def _finished(run: dict, rounds: int) -> list[dict]:
    out = []
    for t in run["tenures"]:
        p = Path(t["res"]) / f"worker{t['slot']}.json"
        if p.exists():
            r = json.loads(p.read_text())
            r.update(tenure=t["index"], slot=t["slot"])
            out.append(r)
    return out


def summarise(run: dict, clean: dict | None, rounds: int, timeout: float) -> dict:
    """The report of one run (``clean``: the clean run's summary, for the ratios and the seconds lost)."""
    res = _finished(run, rounds)
    # a tenure that trained no round did not train to the last one: a joiner launched near the end can start up
    # (20-40 s) after every other worker finished, join the ended job at its last round with its own fresh model
    # and report that model's loss (one run counted one such at 6.2 among six at 3.8: 1.106x the clean loss)
    full = [r for r in res if r["final_round"] >= rounds and not r.get("left") and r.get("rounds_trained")]
    logs = {(t["slot"], t["index"]): _rounds(Path(t["log"])) for t in run["tenures"]}
    last = [max((tt for _, tt in logs[(r["slot"], r["tenure"])]), default=0.0) for r in full]
    first = min((rs[0][1] for rs in logs.values() if rs), default=0.0)
    row: dict = {
        "held_out_loss": statistics.mean(r["held_out_loss"] for r in full) if full else None,
        "workers_finished": len(full),
        "train_seconds": (max(last) - first) if last else None,
        "train_seconds_median_worker": (statistics.median(last) - first) if last else None,
        "median_round_seconds": _median_round(run),
        "failed_exchanges": sum(r["failed_exchanges"] for r in res),
        "launch_rc": run["launch_rc"],
    }
    # exchanges that waited their full timeout, and hangs (two in a row on one worker with the same peer)
    full_waits, hangs, no_state = _full_waits([Path(t["log"]) for t in run["tenures"]], timeout)
    row.update(full_timeout_waits=len(full_waits), full_timeout_detail=full_waits[:20], hangs=len(hangs),
               start_waits=no_state)
    # lost workers and files missing on disk
    lost, missing = [], []
    for t in run["tenures"]:
        js = Path(t["res"]) / f"worker{t['slot']}.json"
        ck = Path(t["ckpt"]) / f"worker{t['slot']}.pt"
        r = json.loads(js.read_text()) if js.exists() else None
        if r is None or (not r.get("left") and r["final_round"] < rounds):
            lost.append({"slot": t["slot"], "tenure": t["index"], "state": t["state"],
                         "final_round": None if r is None else r["final_round"]})
        if not js.exists():
            missing.append(str(js))
        if logs[(t["slot"], t["index"])] and not ck.exists():  # it trained a round: it checkpointed
            missing.append(str(ck))
    row.update(workers_lost=len(lost), lost_detail=lost, files_missing=len(missing), missing_detail=missing[:20])
    if clean is None:
        return row
    row["loss_vs_clean"] = row["held_out_loss"] / clean["held_out_loss"] if row["held_out_loss"] else None
    row["time_vs_clean"] = row["train_seconds"] / clean["train_seconds"] if row["train_seconds"] else None
    row["median_worker_time_vs_clean"] = (row["train_seconds_median_worker"] / clean["train_seconds_median_worker"]
                                          if row["train_seconds_median_worker"] else None)
    # per fault: rounds the victim lost, seconds the others lost
    d0 = clean["median_round_seconds"]
    faults = sorted(run["faults"], key=lambda f: f["at"])
    by_slot: dict[int, list[tuple[int, float]]] = {}
    for (slot, _), v in logs.items():
        by_slot.setdefault(slot, []).extend(v)
    per_fault = []
    t_end = max(last) if last else 0.0
    for i, f in enumerate(faults):  # the last fault's window ends with the job's last round
        t_next = faults[i + 1]["at"] if i + 1 < len(faults) else min(f["at"] + 30.0, t_end)
        entry = {"kind": f["kind"], "victim": f.get("victim"), "at": f["at"] - run["t0"],
                 "others_lost_s": _others_lost(f, t_next, by_slot, d0)}
        if f["kind"] in ("kill", "stop", "bad_frames"):
            entry["victim_rounds_lost"], entry["victim_back_s"] = _lost(logs.get((f["victim"], f["tenure"]), []),
                                                                        f["at"], f["end"])
        elif f["kind"] == "leave":
            r = next((x for x in res if x["slot"] == f["victim"] and x["tenure"] == f["tenure"]), None)
            entry["victim_rounds_lost"] = None if r is None else rounds - r["final_round"]
        elif f["kind"] == "join":
            rs = logs.get((f["victim"], f["tenure"]), [])
            entry["victim_rounds_lost"] = None
            entry["joined_at_round"] = rs[0][0] if rs else None
            entry["victim_back_s"] = rs[0][1] - f["at"] if rs else None
        else:
            lost = [_lost(v, f["at"], f["at"])[0] for (slot, _), v in logs.items() if slot in f["up"]]
            lost = [x for x in lost if x is not None]
            entry["victim_rounds_lost"] = statistics.median(lost) if lost else None
        per_fault.append(entry)
    kinds = _per_kind(per_fault)
    row.update(faults=len(per_fault), per_kind=kinds, per_fault=per_fault)
    return row


def _per_kind(per_fault: list[dict]) -> dict:
    """Per fault kind: count, rounds the victim lost, seconds until it trained again, seconds the others lost."""
    kinds = {}
    for k in KINDS:
        es = [e for e in per_fault if e["kind"] == k]
        if not es:
            continue
        vl = [e["victim_rounds_lost"] for e in es if e.get("victim_rounds_lost") is not None]
        ol = [e["others_lost_s"] for e in es if e["others_lost_s"] is not None]
        back = [e["victim_back_s"] for e in es if e.get("victim_back_s") is not None]
        kinds[k] = {"count": len(es), "victim_rounds_lost_mean": statistics.mean(vl) if vl else None,
                    "victim_rounds_lost_max": max(vl) if vl else None,
                    "victim_back_s_mean": statistics.mean(back) if back else None,
                    "others_lost_s_mean": statistics.mean(ol) if ol else None,
                    "others_lost_s_total": sum(ol) if ol else None}
    return kinds


def _full_waits(logs: list[Path], timeout: float) -> tuple[list[dict], list[dict], int]:
    """Exchanges that waited out (90 % of) their full timeout, hangs (two such in a row on one worker's log with the
    same peer, no clean round between), and starts that waited out theirs (a joiner for a peer's state, a worker for
    the first workers)."""
    full_waits, hangs, no_state = [], [], 0
    for log in logs:
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        no_state += len(NO_STATE_RE.findall(text))
        prev = None
        for line in text.splitlines():
            m = TIMED_OUT_RE.search(line)
            if m and float(m.group(2)) >= 0.9 * timeout:
                full_waits.append({"log": log.name, "peer": int(m.group(1)), "seconds": float(m.group(2))})
                if prev == int(m.group(1)):
                    hangs.append({"log": log.name, "peer": prev})
                prev = int(m.group(1))
            elif (ROUND_RE.search(line) or PIPE_ROUND_RE.search(line)) and "failed 0" in line:
                prev = None
    return full_waits, hangs, no_state


def _others_lost(f: dict, t_next: float, rounds_of: dict[int, list[tuple[int, float]]], d0: float) -> float | None:
    """Seconds the workers up at fault ``f`` (its victim aside) lost until ``t_next``: the window's length minus
    the rounds they finished in it times the clean run's median round, averaged over them."""
    lost = []
    for s in f["up"]:
        if s == f.get("victim"):
            continue
        n = sum(1 for _, tt in rounds_of.get(s, []) if f["at"] < tt <= t_next)
        lost.append((t_next - f["at"]) - n * d0)
    return statistics.mean(lost) if lost else None


def targets(row: dict, min_faults: int) -> dict:
    return {f"faults >= {min_faults}": row["faults"] >= min_faults,
            "loss within 2 % of clean": row["loss_vs_clean"] is not None and abs(row["loss_vs_clean"] - 1) <= 0.02,
            "time <= 1.15x clean": row["time_vs_clean"] is not None and row["time_vs_clean"] <= 1.15,
            "zero hangs": row["hangs"] == 0,
            "zero workers lost": row["workers_lost"] == 0,
            "zero files missing": row["files_missing"] == 0}


def table(row: dict) -> str:
    lines = ["| fault | count | rounds the victim lost (mean / max) | victim back after (mean) | "
             "seconds the others lost (mean per fault) |", "| --- | --- | --- | --- | --- |"]
    for k, v in row["per_kind"].items():
        def f(x, fmt="{:.1f}"):
            return "" if x is None else fmt.format(x)
        lines.append(f"| {k} | {v['count']} | {f(v['victim_rounds_lost_mean'])} / "
                     f"{f(v['victim_rounds_lost_max'], '{:g}')} | {f(v['victim_back_s_mean'])} s | "
                     f"{f(v['others_lost_s_mean'], '{:+.2f}')} s |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- pipeline
def _stage_pids(lives: Path) -> tuple[int, list[int]]:
    """The newest life of a pipeline replica (torchrun's restart number) and its stage processes' pids."""
    try:
        recs = [json.loads(x) for x in lives.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return -1, []
    starts = [r for r in recs if r.get("event") == "start"]
    if not starts:
        return -1, []
    life = max(r.get("restart", 0) for r in starts)
    return life, [r["pid"] for r in starts if r.get("restart", 0) == life]


def run_pipeline_job(folder: Path, args: argparse.Namespace, env: dict[str, str], faults: list[dict] | None) -> dict:
    """The 2-stage pipeline job (``--workers`` replicas of 2 stage processes), with the schedule ``faults`` or
    clean: SIGKILL or SIGSTOP of one stage process, SIGKILL of the store."""
    folder.mkdir(parents=True)
    logs, n = folder / "logs", args.workers
    cmd = [sys.executable, "-m", "fgdiloco", "launch", "--workers", str(n), "--stages", "2", "--max-restarts",
           str(args.max_restarts), "--log-dir", str(logs), PIPE_SCRIPT, "--rounds", str(args.rounds), "--sync-every",
           str(args.sync_every), "--checkpoint-dir", str(folder / "ckpt"), "--results", str(folder / "res"),
           "--log-rounds"]
    launch_log = open(folder / "launch.log", "w")  # noqa: SIM115 - closed below
    launch = subprocess.Popen(cmd, env=env, cwd=folder, stdout=launch_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    state = {k: {"state": "up", "life": 0, "pid": None, "until": 0.0} for k in range(n)}
    pending, done, t0, last_store = list(faults or []), [], None, 0.0
    deadline = time.time() + args.job_timeout
    try:
        while launch.poll() is None:
            now = time.time()
            if now > deadline:
                raise TimeoutError(f"the pipeline job ran past --job-timeout {args.job_timeout} s")
            if t0 is None:
                if all(_rounds(logs / f"worker{k}.log", 1) for k in range(n)):
                    t0 = now
                time.sleep(0.2)
                continue
            for k, st in state.items():
                life, pids = _stage_pids(logs / f"worker{k}.lives")
                if st["state"] == "down" and life > st["life"] and len(pids) == 2 and all(map(_alive, pids)):
                    st["state"], st["life"] = "up", life
                elif st["state"] == "stopped" and now >= st["until"]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(st["pid"], signal.SIGCONT)
                    st["state"] = "up"
            progress = max((r for k in range(n) for r, _ in _rounds(logs / f"worker{k}.log", 1)[-1:]), default=-1)
            if pending and now >= t0 + pending[0]["at"]:
                f = pending.pop(0)
                if progress >= args.rounds - args.quiet_rounds:
                    pending = []
                    continue
                up = [k for k, st in state.items() if st["state"] == "up"]
                kind = f["kind"]
                if kind == "store" and (now - last_store <= args.store_gap or _store_pid(launch.pid) is None):
                    kind = "kill"
                if kind != "store" and (len(up) <= args.min_up or not up):
                    continue
                if kind == "kill" and _seconds_left(args.rounds, progress, now - t0) < args.restart_seconds:
                    continue
                rec = {"i": f["i"], "planned": f["kind"], "kind": kind, "at": now, "end": now, "up": up}
                if kind == "store":
                    pid = _store_pid(launch.pid)
                    os.kill(pid, signal.SIGKILL)
                    last_store = now
                    rec.update(victim="store", pid=pid)
                else:
                    k = up[int(f["pick"] * len(up))]
                    life, pids = _stage_pids(logs / f"worker{k}.lives")
                    if len(pids) != 2 or not all(map(_alive, pids)):
                        state[k].update(state="down", life=life - 1)  # between lives: up again at its next one
                        continue
                    stage = int(f["pick"] * 1000) % len(pids)
                    pid = pids[stage]
                    rec.update(victim=k, tenure=0, stage=stage, pid=pid)
                    try:
                        if kind == "kill":
                            os.kill(pid, signal.SIGKILL)
                            state[k].update(state="down", life=life)
                        else:
                            os.kill(pid, signal.SIGSTOP)
                            state[k].update(state="stopped", pid=pid, until=now + f["seconds"])
                            rec["end"] = now + f["seconds"]
                    except ProcessLookupError:  # the life ended meanwhile (torchrun restarts the replica)
                        state[k].update(state="down", life=life)
                        continue
                done.append(rec)
                print(f"  fault {len(done):3d} at {now - t0:6.1f} s: {kind:<6} victim {rec['victim']}"
                      + (f" stage {rec['stage']}" if "stage" in rec else ""), flush=True)
            time.sleep(0.1)
    finally:
        for st in state.values():
            if st["state"] == "stopped":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(st["pid"], signal.SIGCONT)
        if launch.poll() is None:  # the driver failed: the whole launch goes (its agents and workers too)
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
        launch_log.close()
    return {"folder": str(folder), "t0": t0, "faults": done, "launch_rc": launch.returncode,
            "launch_tail": (folder / "launch.log").read_text(errors="replace")[-3000:]}


def summarise_pipeline(run: dict, clean: dict | None, args: argparse.Namespace) -> dict:
    folder, n, rounds = Path(run["folder"]), args.workers, args.rounds
    logs = {k: _rounds(folder / "logs" / f"worker{k}.log", 1) for k in range(n)}
    losses, lost, missing = [], [], []
    for k in range(n):
        for s in (0, 1):
            js = folder / "res" / f"worker{k}.stage{s}.json"
            ck = folder / "ckpt" / f"worker{k}.stage{s}.pt"
            r = json.loads(js.read_text()) if js.exists() else None
            if r is None or r["round"] < rounds:
                lost.append({"replica": k, "stage": s, "round": None if r is None else r["round"]})
            if r is not None and s == 1 and r["losses"]:
                losses.append(statistics.mean(r["losses"][-4 * args.sync_every:]))
            missing += [str(x) for x in (js, ck) if not x.exists()]
    durs = [t2 - t1 for v in logs.values() for (r1, t1), (r2, t2) in zip(v, v[1:]) if r2 == r1 + 1]
    last = [v[-1][1] for v in logs.values() if v]
    first = min((v[0][1] for v in logs.values() if v), default=0.0)
    full_waits, hangs, _ = _full_waits([folder / "logs" / f"worker{k}.log" for k in range(n)], 60.0)
    row = {"final_train_loss": statistics.mean(losses) if losses else None, "train_seconds": max(last) - first,
           "median_round_seconds": statistics.median(durs) if durs else None, "launch_rc": run["launch_rc"],
           "full_timeout_waits": len(full_waits), "hangs": len(hangs), "workers_lost": len(lost),
           "lost_detail": lost, "files_missing": len(missing), "missing_detail": missing[:20]}
    if clean is None:
        return row
    row["loss_vs_clean"] = row["final_train_loss"] / clean["final_train_loss"] if row["final_train_loss"] else None
    row["time_vs_clean"] = row["train_seconds"] / clean["train_seconds"]
    faults = sorted(run["faults"], key=lambda f: f["at"])
    per_fault = []
    for i, f in enumerate(faults):  # the last fault's window ends with the job's last round
        t_next = faults[i + 1]["at"] if i + 1 < len(faults) else min(f["at"] + 30.0, max(last))
        entry = {"kind": f["kind"], "victim": f.get("victim"), "stage": f.get("stage"), "at": f["at"] - run["t0"],
                 "others_lost_s": _others_lost(f, t_next, logs, clean["median_round_seconds"])}
        if f["kind"] == "store":
            ls = [_lost(v, f["at"], f["at"])[0] for k, v in logs.items() if k in f["up"]]
            ls = [x for x in ls if x is not None]
            entry["victim_rounds_lost"] = statistics.median(ls) if ls else None
        else:
            entry["victim_rounds_lost"], entry["victim_back_s"] = _lost(logs[f["victim"]], f["at"], f["end"])
        per_fault.append(entry)
    row.update(faults=len(per_fault), per_kind=_per_kind(per_fault), per_fault=per_fault)
    return row


def main_pipeline(args: argparse.Namespace) -> int:
    out = Path(args.out or OUT_PIPE)
    kinds = [k for k in args.kinds.split(",") if k in ("kill", "stop", "store")]
    weights = [float(w) for k, w in zip(args.kinds.split(","), args.weights.split(",")) if k in kinds]
    lo, hi = (float(x) for x in args.stop_seconds.split(","))
    schedule = make_schedule(args.faults, args.interval, args.seed, kinds, weights, (lo, hi))
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    folder = contextlib.nullcontext(tempfile.mkdtemp(dir=args.keep)) if args.keep else tempfile.TemporaryDirectory()
    with folder as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        clean = summarise_pipeline(run_pipeline_job(Path(tmp) / "clean", args, env, None), None, args)
        print(f"clean pipeline: final train loss {clean['final_train_loss']:.4f}, training "
              f"{clean['train_seconds']:.1f} s", flush=True)
        run = run_pipeline_job(Path(tmp) / "chaos", args, env, schedule)
        chaos = summarise_pipeline(run, clean, args)
        print(f"chaos pipeline: {chaos['faults']} faults; final train loss {chaos['final_train_loss']:.4f} "
              f"({chaos['loss_vs_clean']:.3f}x clean), training {chaos['train_seconds']:.1f} s "
              f"({chaos['time_vs_clean']:.2f}x clean); {chaos['full_timeout_waits']} full-timeout waits, "
              f"{chaos['hangs']} hangs, {chaos['workers_lost']} stage processes lost, {chaos['files_missing']} files "
              "missing", flush=True)
        print(table(chaos))
        met = targets(chaos, args.min_faults)
        for k, v in met.items():
            print(f"  {'met   ' if v else 'MISSED'} {k}")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": vars(args), "clean": clean, "chaos": chaos, "targets": met,
                                   "launch_tail": run["launch_tail"], "faults_injected": run["faults"]}, indent=2,
                                  default=str))
        print(f"wrote {out}")
    return 0


def _prepare(env: dict[str, str], vocab: int) -> None:
    code = ("from fgdiloco.pretrain import data; t = data.load_text(None); c = data.cache_dir_for(None); "
            f"data.encode_corpus(t, data.build_tokenizer(t, 'bpe', vocab_size={vocab}, cache_dir=c), cache_dir=c)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def self_check() -> None:
    """The schedule and summary helpers on fixed inputs (``--self-check``; tests/test_chaos.py runs it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        a = make_schedule(50, 2.0, 7, list(KINDS), [3, 2, 1, 1, 2, 1], (5.0, 20.0))
        assert a == make_schedule(50, 2.0, 7, list(KINDS), [3, 2, 1, 1, 2, 1], (5.0, 20.0))
        assert a != make_schedule(50, 2.0, 8, list(KINDS), [3, 2, 1, 1, 2, 1], (5.0, 20.0))
        assert len(a) == 50 and all(x["at"] < y["at"] for x, y in zip(a, a[1:]))
        assert all(1.0 <= y["at"] - x["at"] <= 3.0 for x, y in zip(a, a[1:]))
        assert {f["kind"] for f in a} <= set(KINDS) and all(5.0 <= f["seconds"] <= 20.0 for f in a)
        assert all(sorted(f["fallback"]) == sorted(KINDS) and 0 <= f["pick"] < 1 for f in a)
        rounds = [(0, 10.0), (1, 11.0), (2, 12.0), (6, 20.0), (7, 21.0)]  # away from 12.5 to 19: rounds 3-5 lost
        assert _lost(rounds, 12.5, 19.0) == (3, 7.5)
        hung = [(0, 10.0), (1, 11.0), (2, 19.5), (9, 20.0), (10, 21.0)]  # finishes round 2 after a hang, then jumps
        assert _lost(hung, 11.5, 19.0) == (6, 8.0)
        assert _lost(rounds, 21.5, 21.5) == (None, None)  # never trained again
        rounds_of = {0: [(r, 10.0 + r) for r in range(10)], 1: [(0, 10.0), (1, 12.0), (2, 15.0)]}
        f = {"at": 10.5, "up": [0, 1, 2], "victim": 2}
        # worker 0 trained 4 rounds of 1 s in the 4 s window (lost 0), worker 1 one (lost 3)
        assert _others_lost(f, 14.5, rounds_of, 1.0) == 1.5
        per = [{"kind": "kill", "victim_rounds_lost": 2, "victim_back_s": 8.0, "others_lost_s": 1.0},
               {"kind": "kill", "victim_rounds_lost": 4, "victim_back_s": 10.0, "others_lost_s": 0.0},
               {"kind": "store", "victim_rounds_lost": 0, "others_lost_s": -0.5}]
        k = _per_kind(per)
        assert k["kill"]["count"] == 2 and k["kill"]["victim_rounds_lost_mean"] == 3
        assert k["kill"]["victim_rounds_lost_max"] == 4
        assert k["store"]["others_lost_s_mean"] == -0.5 and "stop" not in k
        log = Path(tmp) / "worker0.log"
        log.write_text("x mix2 exchange mix2/0/3 with rank 4 timed out after 30.1 s; keeping own value\n"
                       "worker 0 round   3  train 1.0  failed 1  rejoins 0  at 1.000\n"
                       "x mix2 exchange mix2/0/4 with rank 4 timed out after 29.9 s; keeping own value\n"
                       "x mix1 exchange mix1/0/5 with rank 1 timed out after 2.0 s; keeping own value\n")
        waits, hangs, _ = _full_waits([log], 30.0)
        assert len(waits) == 2 and len(hangs) == 1 and hangs[0]["peer"] == 4
        row = {"faults": 100, "loss_vs_clean": 1.01, "time_vs_clean": 1.2, "hangs": 0, "workers_lost": 0,
               "files_missing": 0}
        assert targets(row, 100) == {"faults >= 100": True, "loss within 2 % of clean": True,
                                     "time <= 1.15x clean": False, "zero hangs": True, "zero workers lost": True,
                                     "zero files missing": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--self-check", action="store_true", help="check the schedule and summary helpers, then exit")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--spare", type=int, default=2, help="slots beyond --workers, free for joiners")
    p.add_argument("--rounds", type=int, default=600)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--timeout", type=float, default=30.0, help="the workers' exchange timeout (seconds)")
    p.add_argument("--faults", type=int, default=160, help="faults in the schedule (fewer happen if the job ends)")
    p.add_argument("--interval", type=float, default=2.0, help="mean seconds between faults")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--weights", default="3,2,1,1,2,1")
    p.add_argument("--stop-seconds", default="5,20")
    p.add_argument("--bad-rounds", type=int, default=2)
    p.add_argument("--min-up", type=int, default=3, help="never take a worker down when only this many are up")
    p.add_argument("--max-out", type=int, default=6, help="at most this many workers down, stopped or joining")
    p.add_argument("--store-gap", type=float, default=15.0, help="seconds between two store restarts at least")
    p.add_argument("--quiet-rounds", type=int, default=8, help="no fault in the last rounds")
    p.add_argument("--join-rounds", type=int, default=40, help="no join in the last rounds (it takes time to start)")
    p.add_argument("--restart-seconds", type=float, default=20.0,
                   help="no kill when the job has less than this left at its pace so far (a restart's time)")
    p.add_argument("--joiner-grace", type=float, default=120.0,
                   help="seconds a joiner may run on after the main launch ended")
    p.add_argument("--max-restarts", type=int, default=1000)
    p.add_argument("--job-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-faults", type=int, default=100)
    p.add_argument("--pipeline", action="store_true", help="the 2-stage pipeline variant")
    p.add_argument("--keep", default=None, help="keep the runs' folders here")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.self_check:
        self_check()
        print("[chaos] self-check passed")
        return 0
    if args.pipeline:
        return main_pipeline(args)
    out = Path(args.out or OUT)
    kinds = args.kinds.split(",")
    weights = [float(w) for w in args.weights.split(",")][:len(kinds)]
    lo, hi = (float(x) for x in args.stop_seconds.split(","))
    schedule = make_schedule(args.faults, args.interval, args.seed, kinds, weights, (lo, hi))
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    folder = contextlib.nullcontext(tempfile.mkdtemp(dir=args.keep)) if args.keep else tempfile.TemporaryDirectory()
    with folder as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(Path(tmp) / "xdg"))
        _prepare(env, args.vocab_size)
        t = time.time()
        clean_run = run_job(Path(tmp) / "clean", args, env, None)
        clean = summarise(clean_run, None, args.rounds, args.timeout)
        print(f"clean: held-out {clean['held_out_loss']:.4f}, training {clean['train_seconds']:.1f} s "
              f"(median round {clean['median_round_seconds']:.2f} s; {time.time() - t:.0f} s in all)", flush=True)
        t = time.time()
        chaos_run = run_job(Path(tmp) / "chaos", args, env, schedule)
        chaos = summarise(chaos_run, clean, args.rounds, args.timeout)
        print(f"chaos: {chaos['faults']} faults; held-out {chaos['held_out_loss']:.4f} "
              f"({chaos['loss_vs_clean']:.3f}x clean), training {chaos['train_seconds']:.1f} s "
              f"({chaos['time_vs_clean']:.2f}x clean); {chaos['full_timeout_waits']} full-timeout waits, "
              f"{chaos['hangs']} hangs, {chaos['workers_lost']} workers lost, {chaos['files_missing']} files missing "
              f"({time.time() - t:.0f} s in all)", flush=True)
        print(table(chaos))
        met = targets(chaos, args.min_faults)
        for k, v in met.items():
            print(f"  {'met   ' if v else 'MISSED'} {k}")
        result = {"config": vars(args), "schedule_seed": args.seed, "clean": clean, "chaos": chaos, "targets": met,
                  "launch_tail": chaos_run["launch_tail"], "faults_injected": chaos_run["faults"],
                  "note": "2-core machine shared by every worker, agent and the store; see benchmarks/RESULTS.md"}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
