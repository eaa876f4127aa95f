"""``fgdiloco pretrain`` on elastic workers: each worker its own torchrun job; a worker SIGKILLed from outside is
restarted, continues from its checkpoint and rejoins while the others train on; ``--resume`` continues a stopped
run; the launcher merges the workers' reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fgdiloco.cli import main
from fgdiloco.elastic.rejoin import ADOPT_ROUNDS
from fgdiloco.pretrain.config import TrainConfig
from fgdiloco.pretrain.launcher import eval_points
from fgdiloco.pretrain.merge import Merger
from fgdiloco.pretrain.results import ROW_FIELDS, SUMMARY_FIELDS, read_rows, rejoin_marks
from tests.pinned import clean_curve, clean_loss

FIXTURE = Path(__file__).parent / "fixtures" / "moby_dick_ch1-29.txt"
TINY = ("--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--batch-size", "4", "--block-size", "32",
        "--vocab-size", "300", "--eval-batches", "1", "--data", str(FIXTURE))


def _events(out: Path, worker: int, kind: str) -> list[dict]:
    return [e for e in read_rows(out / "workers" / f"worker{worker}.jsonl") if e.get("event") == kind]


def _start(argv: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.Popen([sys.executable, "-m", "fgdiloco", "pretrain", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)


def _wait_for(cond, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Block until ``cond()`` holds (the event the test acts on), the run ends, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen (exit status {proc.poll()})")


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_restarted_and_rejoins_while_the_others_train_on(tmp_path):
    out = tmp_path / "run"
    # long enough that the survivors are still training when worker 3 is back (its restart, importing torch,
    # takes 5-20 s on a loaded 2-core machine; 3 workers run about 10 rounds a second since pair groups are reused:
    # with 120 rounds they once finished before worker 3 was back)
    steps, h, every = 600, 2, 2
    proc = _start(["--workers", "4", *TINY, "--steps", str(steps), "--sync-every", str(h), "--eval-every",
                   str(every), "--checkpoint-every", "2", "--timeout", "20", "--max-restarts", "2",
                   "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--quiet"], tmp_path)
    try:
        _wait_for(lambda: any(r["round"] >= 10 for r in read_rows(out / "metrics.jsonl")), proc, 240, "round 10")
        victim = _events(out, 3, "start")[0]
        assert victim["life"] == 0
        os.kill(victim["pid"], signal.SIGKILL)  # what the kernel's OOM killer does, from outside the job
        stdout, stderr = _finish(proc, 240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout + stderr
    assert "1 worker restart(s), " in stdout and "Traceback" not in stderr

    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["rejoins"] >= 1 and summary["workers_lost"] == []
    assert summary["rounds"] == summary["rounds_planned"] == steps // h and summary["steps"] == steps
    assert summary["interrupted"] is False and summary["stopped_early"] is False
    # worker 3's new life joins the job (the first round its peers start after its restart). On a loaded machine
    # any worker's first life may join too: one that starts a moment after its peers finished round 0 enters at
    # round 1, and one whose rounds leave it 3 rounds behind catches up. Every rejoin is forward, and the only
    # second life is worker 3's
    assert {e["worker"] for e in summary["rejoin_events"] if e["life"] > 0} == {3}
    assert all(e["round"] > e["from_round"] for e in summary["rejoin_events"])
    event = next(e for e in summary["rejoin_events"] if e["life"] == 1)
    # it continued from its newest checkpoint (every 2 rounds; it had reported round 10 or a little later)
    last_report = max(e["round"] for e in _events(out, 3, "row") if e["life"] == 0)
    assert event["life"] == 1 and event["from_round"] % 2 == 0 and 8 <= event["from_round"] <= last_report
    assert event["round"] > event["from_round"]
    assert event["step"] == event["round"] * h

    rows = read_rows(out / "metrics.jsonl")
    cfg = TrainConfig(steps=steps, sync_every=h, eval_every=every)
    assert [r["round"] for r in rows] == eval_points(cfg)  # every evaluation point, once, in order
    for r in rows:
        assert set(r) <= set(ROW_FIELDS), set(r) - set(ROW_FIELDS)
    # while worker 3 was down, the rows are the three survivors' means; it reports again after its rejoin
    down = [r["workers_reporting"] for r in rows if last_report < r["round"] <= event["round"]]
    assert down == [3] * len(down)
    back = summary["rejoin_events"][-1]["round"]  # after its last rejoin it reports every point again
    assert all(r["workers_reporting"] == 4 for r in rows if r["round"] > back + 2 * every)
    assert rows[-1]["workers_reporting"] == 4 and rows[-1]["restarts_so_far"] == 1
    assert rows[-1]["rejoins_so_far"] == summary["rejoins"]
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.5  # it trained
    # the survivors never stopped: one life each, a report at every evaluation point
    for k in range(3):
        assert [e["life"] for e in _events(out, k, "start")] == [0]
        assert [e["round"] for e in _events(out, k, "row")] == eval_points(cfg)
    lives = _events(out, 3, "start")
    assert [e["life"] for e in lives] == [0, 1] and lives[1]["resumed_round"] == event["from_round"]
    assert any(e["life"] == 1 and e["round"] > event["round"] for e in _events(out, 3, "row"))  # it trains again
    # loss.png marks the rejoin at the step of the round worker 3 joined
    ((tokens_m, seconds, worker),) = rejoin_marks(rows, [event])
    assert worker == 3 and tokens_m == pytest.approx(event["step"] * 4 * 4 * 32 / 1e6)
    assert 0 < seconds <= rows[-1]["train_seconds"]
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "checkpoints" / "worker3.pt").is_file()
    # the rejoin cost no one a deadline: no exchange waited out its --timeout, the rows kept coming. (A c10d line
    # "waitForInput ... timed out after 20000ms" may appear: a pair group that worker 3 died while building leaves
    # its Gloo rendezvous thread to end at the timeout, in the background; nobody waits for it.)
    for k in range(4):
        log = (out / "logs" / f"worker{k}.log").read_text(errors="replace")
        assert [ln for ln in log.splitlines() if "timed out after" in ln and "[c10d]" not in ln] == [], k
    gaps = [b["wall_seconds"] - a["wall_seconds"] for a, b in zip(rows, rows[1:])]
    assert max(gaps) < 15, gaps


@pytest.mark.slow
def test_resume_continues_a_stopped_run_from_every_workers_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--quiet", "--cache-dir", str(tmp_path / "cache")]
    assert main(["pretrain", "--resume", "--out", str(out), *common]) == 2  # nothing there yet
    assert "--resume found no run to continue" in capsys.readouterr().err

    # --max-seconds stops the first run early (every worker at the same evaluation point), with checkpoints
    first = _start(["--workers", "2", *TINY, "--steps", "24", "--sync-every", "3", "--checkpoint-every", "1",
                    "--max-seconds", "0.2", "--out", str(out), *common], tmp_path)
    stdout, stderr = _finish(first, 240)
    assert first.returncode == 0, stdout + stderr
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stopped_early"] is True and 1 <= stopped["rounds"] < 8
    saved = {k: [e["round"] for e in _events(out, k, "row")] for k in range(2)}
    assert saved[0][-1] == saved[1][-1], saved  # both stop at the round where the first passed --max-seconds
    # the workers stop at their own next evaluation point: make worker 1's checkpoint the older one for sure
    ckpts = [torch.load(out / "checkpoints" / f"worker{k}.pt", weights_only=False) for k in range(2)]
    older = min(c["round"] for c in ckpts) - 1
    ckpts[1]["round"] = ckpts[1]["fgdiloco"]["round"] = older
    torch.save(ckpts[1], out / "checkpoints" / "worker1.pt")
    before = {r["round"]: r for r in read_rows(out / "metrics.jsonl")}
    assert main(["pretrain", "--resume", "--out", str(out), "--steps", "30", *common]) == 2
    assert "--resume continues the saved configuration, but --steps 30 differs from the saved 24" in (
        capsys.readouterr().err)
    # a worker without a checkpoint: refused in one line, and nothing of the stopped run is touched
    hidden = out / "checkpoints" / "worker1.pt.away"
    (out / "checkpoints" / "worker1.pt").rename(hidden)
    reports = {k: (out / "workers" / f"worker{k}.jsonl").read_bytes() for k in range(2)}
    assert main(["pretrain", "--resume", "--out", str(out), *common]) == 2
    assert "--resume needs a checkpoint of every worker" in capsys.readouterr().err
    assert (out / "summary.json").is_file() and {r["round"]: r for r in read_rows(out / "metrics.jsonl")} == before
    assert {k: (out / "workers" / f"worker{k}.jsonl").read_bytes() for k in range(2)} == reports
    hidden.rename(out / "checkpoints" / "worker1.pt")

    again = _start(["--resume", "--out", str(out), *common], tmp_path)
    stdout, stderr = _finish(again, 240)
    assert again.returncode == 0, stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_id"] == stopped["run_id"] and summary["resumed"] is True
    assert summary["steps"] == summary["steps_planned"] == 24 and summary["rounds"] == 8
    assert summary["stopped_early"] is False and summary["restarts"] == 0
    rows = read_rows(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(9))
    for k in range(2):
        starts = _events(out, k, "start")
        assert len(starts) == 2 and starts[1]["resumed_round"] == ckpts[k]["round"]  # from its checkpoint
        # the report file was cut back to the checkpoint and continued from the newest checkpoint's round (where
        # every resumed worker starts, so none waits for another): every round once, in order
        reported = [e["round"] for e in _events(out, k, "row")]
        newest = max(e["resumed_round"] for j in range(2) for e in _events(out, j, "start")[1:])
        assert reported == [r for r in saved[k] if r <= starts[1]["resumed_round"]] + list(range(newest + 1, 9))
        assert "timed out after" not in (out / "logs" / f"worker{k}.log").read_text(errors="replace")
    # worker 1 started where worker 0's newer checkpoint is (no one waited for anyone: no timeout above)
    (moved,) = _events(out, 1, "rejoin")
    assert (moved["from_round"], moved["round"]) == (older, ckpts[0]["round"]) and not _events(out, 0, "rejoin")
    low = min(e["resumed_round"] for k in range(2) for e in _events(out, k, "start")[1:])
    for r in range(low + 1):  # the rows up to the checkpoints are the first run's
        assert rows[r]["eval_loss"] == before[r]["eval_loss"]
    assert rows[-1]["eval_loss"] < rows[low]["eval_loss"]
    capsys.readouterr()
    # the run is finished: --resume says so and starts nothing
    assert main(["pretrain", "--resume", "--out", str(out), *common]) == 0
    assert "already finished its 8 rounds" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text()) == summary


def _write(path: Path, *events: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def _row(worker: int, rnd: int, loss: float, **kw) -> dict:
    base = {"event": "row", "worker": worker, "life": 0, "round": rnd, "step": rnd * 10, "eval_loss": loss,
            "train_loss": loss + 0.1 if rnd else None, "utilisation": 0.5 if rnd else None,
            "bytes_sent": 100.0 * worker if rnd else None, "consensus_distance": 0.1 if rnd else None,
            "failed_exchanges": 1 if rnd else None, "skipped_exchanges": 2 if rnd else None,
            "wall_seconds": 2.0 * rnd + worker,
            "train_seconds": 1.5 * rnd + worker, "peak_rss_bytes": 1000 + worker}
    base.update(kw)
    return base


def test_the_merger_waits_for_every_worker_or_its_end_and_averages_over_the_reporters(tmp_path):
    info = {"tokens_per_step": 7, "unigram_loss": 5.0}
    m = Merger(tmp_path, 3, [0, 1, 2, 3], sync_every=10, steps=30)
    _write(tmp_path / "worker1.jsonl", {"event": "start", "worker": 1, "life": 0, "info": info},
           _row(1, 0, 6.0), _row(1, 1, 5.0))
    _write(tmp_path / "worker0.jsonl", _row(0, 0, 6.0))
    m.read()
    assert m.ready() == []  # worker 2 has not reported round 0
    _write(tmp_path / "worker2.jsonl", _row(2, 0, 6.0), _row(2, 1, 4.0))
    with open(tmp_path / "worker0.jsonl", "a") as f:
        f.write('{"event": "row", "wor')  # a line being written: not read yet
    m.read()
    (r0,) = m.ready()
    assert r0["round"] == 0 and r0["workers_reporting"] == 3 and r0["eval_loss"] == 6.0
    assert m.ready() == []  # round 1 waits for worker 0
    # worker 0 died and came back, rejoining at round 2: it will never report round 1
    with open(tmp_path / "worker0.jsonl", "a") as f:
        f.write("\n")
    _write(tmp_path / "worker0.jsonl", {"event": "start", "worker": 0, "life": 1, "info": info},
           {"event": "rejoin", "worker": 0, "life": 1, "round": 2, "from_round": 0, "step": 20, "time": 9.0})
    m.read()
    (r1,) = m.ready()
    assert r1["round"] == 1 and r1["workers_reporting"] == 2 and r1["eval_worker"] == 1
    assert r1["eval_loss"] == 5.0 and r1["eval_loss_mean"] == pytest.approx(4.5)  # lowest reporting slot; mean
    assert r1["tokens"] == 10 * 7 and r1["wall_seconds"] == 2.0 + 2  # the longest-lived clock (worker 2's)
    assert r1["bytes_sent_per_worker_so_far"] == pytest.approx((100.0 + 200.0) / 3)
    assert r1["failed_exchanges_so_far"] == 2 and r1["restarts_so_far"] == 1 and r1["rejoins_so_far"] == 0
    assert r1["skipped_exchanges_so_far"] == 4  # counted apart from the failures
    # round 2: worker 2 ended for good (its torchrun job is gone) without reporting it
    _write(tmp_path / "worker0.jsonl", _row(0, 2, 3.0, life=1))
    _write(tmp_path / "worker1.jsonl", _row(1, 2, 3.5))
    m.read()
    assert m.ready() == []
    (r2,) = m.ready(gone={2})
    assert r2["round"] == 2 and r2["workers_reporting"] == 2 and r2["eval_loss"] == 3.0
    assert r2["rejoins_so_far"] == 1 and m.restarts == 1 and m.peak_rss_bytes == 1002
    assert m.ready(gone={0, 1, 2}) == []  # round 3: nobody reported it
    assert m.info == {**info, "_worker": 0}  # worker 0's, once it has started


def test_the_merged_totals_count_every_round_when_rows_come_every_other_round(tmp_path):
    """--eval-every 2: a row carries what the rounds since the worker's last row add up to; the totals are made of
    those (they counted the rows' own rounds only: half the bytes)."""
    m = Merger(tmp_path, 2, [0, 2, 4], sync_every=10, steps=40)
    for k in (0, 1):
        since = {"bytes_sent_since_point": 300.0, "failed_exchanges_since_point": 3,
                 "skipped_exchanges_since_point": 1, "rounds_since_point": 2}
        _write(tmp_path / f"worker{k}.jsonl", _row(k, 0, 6.0),
               _row(k, 2, 5.0, bytes_sent=200.0, utilisation=0.6, utilisation_since_point=0.5, **since),
               _row(k, 4, 4.0, bytes_sent=200.0, utilisation=0.9, utilisation_since_point=0.9,
                    **{**since, "rounds_since_point": 1}))
    m.read()
    _, r2, r4 = m.ready()
    assert r2["bytes_sent_per_worker_so_far"] == 300.0 and r4["bytes_sent_per_worker_so_far"] == 600.0
    assert r4["failed_exchanges_so_far"] == 12 and r4["skipped_exchanges_so_far"] == 4
    assert r2["utilisation_so_far"] == pytest.approx(0.5)
    assert r4["utilisation_so_far"] == pytest.approx((0.5 * 2 + 0.9) / 3)  # a mean over rounds, not over rows


@pytest.mark.slow
def test_help_says_which_methods_are_elastic_and_the_new_options():
    proc = subprocess.run([sys.executable, "-m", "fgdiloco", "pretrain", "--help"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, COLUMNS="200"))
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0
    assert "--max-restarts MAX_RESTARTS torchrun restarts of each worker" in text and "(default: 3)" in text
    assert "--checkpoint-every R" in text and "(default: 5)" in text and "--resume" in text
    assert "--max-seconds S" in text
    assert text.count("Not elastic: one torchelastic job, one death ends the job") == 1  # the baselines only
    assert "each worker (each pipeline replica with --stages > 1) is its own torchrun job" in text
    assert set(SUMMARY_FIELDS) >= {"restarts", "rejoins", "rejoin_events", "workers_lost"}
    assert TrainConfig().elastic and not TrainConfig(baseline="ddp").elastic
    assert TrainConfig(workers=4, stages=2).elastic and not TrainConfig(topology="allreduce").elastic


def test_an_interrupted_elastic_run_is_summarised_with_its_restarts_and_rejoins(tmp_path):
    from fgdiloco.pretrain.launcher import finish_interrupted

    (tmp_path / "workers").mkdir()
    info = {"run_id": "r1", "method": "fgdiloco", "elastic": True, "workers": 2, "rounds_planned": 5,
            "steps_planned": 50, "params": 1, "vocab_size": 300, "train_tokens": 1, "val_tokens": 1,
            "unigram_loss": 5.0, "data": "x", "title": "t", "config": {}, "tokens_per_step": 7}
    (tmp_path / "run.json").write_text(json.dumps(info))
    rejoin = {"event": "rejoin", "worker": 1, "life": 1, "round": 2, "from_round": 0, "step": 20, "time": 3.0}
    _write(tmp_path / "workers" / "worker1.jsonl", {"event": "start", "worker": 1, "life": 1, "info": info},
           rejoin, _row(1, 3, 4.0, life=1))
    _write(tmp_path / "workers" / "worker0.jsonl", _row(0, 3, 4.5))
    m = Merger(tmp_path / "workers", 2, [0, 3], sync_every=10, steps=50)
    m.read()
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in m.ready(gone={0, 1}):
            f.write(json.dumps(r) + "\n")
    s = finish_interrupted(tmp_path)
    assert s["interrupted"] is True and s["rounds"] == 3 and s["restarts"] == 1 and s["rejoins"] == 1
    assert s["rejoin_events"] == [{k: v for k, v in rejoin.items() if k != "event"}]
    assert s["peak_rss_bytes"] == 1001 and (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


PIPE = ("--workers", "4", "--stages", "2", "--n-layer", "2", *TINY[2:])  # 2 replicas x 2 stages, a block each


def _stage_restore(rank: int, world: int) -> list[int]:
    import types

    import torch.distributed as dist

    from fgdiloco.pretrain.sync import ElasticFGDiLoCo, ElasticPipelineStage

    ElasticFGDiLoCo.restore = lambda self, *args: 20  # (this forked rank only) its own checkpoint's round
    stage = object.__new__(ElasticPipelineStage)
    stage.mesh = types.SimpleNamespace(pipeline_group=dist.group.WORLD)
    # the stages' checkpoints were a round apart: their batch generators are in different states
    batches = types.SimpleNamespace(generator=torch.Generator().manual_seed(7 + rank))
    assert stage.restore(batches, None) == 20
    return torch.randint(0, 10**6, (5,), generator=batches.generator).tolist()


def test_a_restarted_replicas_stages_draw_the_same_batches_whatever_their_checkpoints(tmp_path):
    """On restoring, every stage of a replica takes the first stage's batch generator: stages whose checkpoints were a
    round apart drew different batches for good, inputs that did not match the last stage's targets (a replica of
    the pipeline chaos run stayed at the loss of chance for 230 rounds)."""
    from fgdiloco.testing import run_ranks

    draws = run_ranks(_stage_restore, 2, tmp_path)
    assert draws[0] == draws[1] == torch.randint(0, 10**6, (5,), generator=torch.Generator().manual_seed(7)).tolist()


def _lives(out: Path, worker: int) -> list[dict]:
    return read_rows(out / "logs" / f"worker{worker}.lives")


def killed_stage_argv(cache: Path, steps: int = 400, h: int = 2) -> list[str]:
    """The killed-stage test's job (its uninterrupted run is pinned: tests/pinned.py), without ``--out``."""
    return [*PIPE, "--steps", str(steps), "--sync-every", str(h), "--eval-every", "2", "--checkpoint-every", "2",
            "--timeout", "20", "--max-restarts", "2", "--cache-dir", str(cache), "--quiet"]


@pytest.mark.slow
def test_a_killed_stage_restarts_its_replica_which_rejoins_while_the_other_replica_trains_on(tmp_path):
    out = tmp_path / "run"
    # 200 rounds: the replica's restart takes 6-9 s on a quiet 2-core machine and more under load, while replica 0
    # alone runs 7-14 rounds a second; with 120 rounds the restart sometimes ended after replica 0's last round
    steps, h = 400, 2
    proc = _start([*killed_stage_argv(tmp_path / "cache", steps, h), "--out", str(out)], tmp_path)
    try:
        _wait_for(lambda: any(r["round"] >= 10 for r in read_rows(out / "metrics.jsonl")), proc, 240, "round 10")
        (first, _) = sorted(_lives(out, 1), key=lambda e: e["time"])[:2]
        os.kill(first["pid"], signal.SIGKILL)  # one stage process of replica 1, from outside its job
        stdout, stderr = _finish(proc, 300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout + stderr
    assert "1 worker restart(s), " in stdout and "Traceback" not in stderr, (stdout[-3000:], stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["rejoins"] >= 1 and summary["workers_lost"] == [], summary
    assert summary["rounds"] == summary["rounds_planned"] == steps // h and summary["interrupted"] is False
    assert summary["activation_bytes_sent"] > 0 and 0 < summary["pipeline_bubble"] < 1
    # the replica restarted as a whole: both of its stage processes had a second life; replica 0 had one
    assert sorted(e["restart"] for e in _lives(out, 1)) == [0, 0, 1, 1]
    assert sorted(e["restart"] for e in _lives(out, 0)) == [0, 0]
    # (a first life may join too: started a moment after its peers finished round 0, or fallen behind on a loaded
    # machine; every rejoin is forward)
    assert all(e["round"] > e["from_round"] for e in summary["rejoin_events"])
    # the restarted replica joined once; a second event may follow at once (its stages took states from donors a
    # round or more apart, and the one behind moved up to the other's round) or later (a catch-up): all forward
    moves = [e for e in summary["rejoin_events"] if e["life"] > 0]
    assert {(e["worker"], e["life"]) for e in moves} == {(1, 1)}, moves
    assert all(b["from_round"] >= a["round"] for a, b in zip(moves, moves[1:])), moves
    event = moves[0]
    assert event["round"] > event["from_round"] >= 8
    if event["round"] - event["from_round"] >= ADOPT_ROUNDS:  # its checkpoints were old: each stage asked once
        log1 = (out / "logs" / "worker1.log").read_text(errors="replace")
        adopted = log1.count("with a live peer's parameters and outer momentum")
        assert adopted + log1.count("no peer sent its state") == 2, log1[-3000:]
        if adopted < 2:  # no peer answered: only because replica 0 had finished its last round (a loaded machine,
            # a restart longer than replica 0's remaining rounds), never because a live one did not answer
            joined = next(e for e in _events(out, 1, "rejoin") if e["life"] == 1)
            last_row = max(e["time"] for e in _events(out, 0, "row"))
            assert last_row <= joined["time"], (event, last_row, joined["time"], log1[-3000:])
    cfg = TrainConfig(steps=steps, sync_every=h, eval_every=2)
    assert [e["round"] for e in _events(out, 0, "row")] == eval_points(cfg)  # replica 0 never stopped
    for s in range(2):
        assert (out / "checkpoints" / f"worker1.stage{s}.pt").is_file()
    for k in range(2):  # the survivors skipped the dead replica's exchanges: none waited out --timeout
        log = (out / "logs" / f"worker{k}.log").read_text(errors="replace")
        assert [ln for ln in log.splitlines() if "timed out after" in ln and "[c10d]" not in ln] == [], k

    # the same job uninterrupted (pinned: tests/pinned.py): the death costs at most 2 % of held-out loss beyond the
    # tokens it cost. Replica 1 trained nothing from its checkpoint's round to its rejoin, so the job saw as many
    # tokens as the clean run by round rounds - down / 2 (2 replicas); how long the restart takes depends on the
    # machine's load (6-9 s quiet; replica 0 alone runs 7-14 rounds a second), so the loss is compared there
    down = event["round"] - event["from_round"]
    curve = clean_curve("clean_pipeline_pretrain")
    at = max(r for r in curve if r <= summary["rounds"] - down / 2)
    assert summary["final_eval_loss"] < 1.02 * curve[at], (summary["final_eval_loss"], at, curve[at], down)
    assert curve[summary["rounds"]] == clean_loss("clean_pipeline_pretrain")


@pytest.mark.slow
def test_resume_continues_a_stopped_pipeline_run_from_every_stages_checkpoint(tmp_path):
    out = tmp_path / "run"
    common = ["--quiet", "--cache-dir", str(tmp_path / "cache")]
    first = _start([*PIPE, "--steps", "24", "--sync-every", "3", "--checkpoint-every", "1", "--max-seconds", "0.2",
                    "--out", str(out), *common], tmp_path)
    stdout, stderr = _finish(first, 240)
    assert first.returncode == 0, stdout + stderr
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stopped_early"] is True and stopped["rounds"] < 8
    again = _start(["--resume", "--out", str(out), *common], tmp_path)
    stdout, stderr = _finish(again, 240)
    assert again.returncode == 0, stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_id"] == stopped["run_id"] and summary["resumed"] is True
    assert summary["rounds"] == 8 and summary["stopped_early"] is False
    for k in range(2):
        starts = _events(out, k, "start")  # the last stage reports: one start per run, the second resumed
        assert len(starts) == 2 and starts[1]["resumed_round"] is not None
    rows = read_rows(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(9)) and rows[-1]["eval_loss"] < rows[0]["eval_loss"]
