"""Elastic jobs where users launch them: ``fgdiloco launch`` (one ``torchrun`` job per worker, a gossip store no
worker hosts) running ``examples/elastic_gpt.py`` on the bundled corpus. Real processes, real torchrun agents, real
deaths (``os._exit``), hangs (SIGSTOP) and joins."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fgdiloco.config import FGDiLoCoConfig
from fgdiloco.elastic.rejoin import CATCH_UP_ROUNDS
from tests.pinned import clean_loss

pytestmark = pytest.mark.slow  # every test here runs fgdiloco launch and its torchrun agents

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "elastic_gpt.py")
# a tiny GPT; H = 10 keeps a round (~2 s here) as long as the liveness (2 s) a death costs its partner
ARGS = ["--rounds", "14", "--sync-every", "10", "--n-layer", "1", "--n-embd", "32", "--vocab-size", "512",
        "--batch-size", "8", "--block-size", "32", "--timeout", "20"]


def tokenizer_env(cache: Path) -> dict[str, str]:
    """The workers' environment with the tokenizer cache in ``cache``, built there (as a first run would)."""
    e = dict(os.environ, XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code = ("from fgdiloco.pretrain import data; t = data.load_text(None); "
            "data.encode_corpus(t, data.build_tokenizer(t, 'bpe', vocab_size=512, cache_dir=data.cache_dir_for(None)), "
            "cache_dir=data.cache_dir_for(None))")
    subprocess.run([sys.executable, "-c", code], env=e, check=True, timeout=300)
    return e


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The workers' environment: one shared tokenizer cache, built once for the module."""
    return tokenizer_env(tmp_path_factory.mktemp("xdg"))


def _results(folder: Path) -> dict[int, dict]:
    return {int(f.stem[6:]): json.loads(f.read_text()) for f in folder.glob("worker*.json")}


def _launch(env, out: Path, *extra: str, workers: int = 4, store: str | None = None, slots: int | None = None,
            first: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fgdiloco", "launch", "--workers", str(workers), "--max-restarts", "2",
           "--log-dir", str(out / "logs")]
    if store:
        cmd += ["--store", store, "--slots", str(slots), "--first-worker", str(first)]
    cmd += [SCRIPT, *ARGS, "--results", str(out / "res"), *extra]
    return subprocess.Popen(cmd, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    return out


def _wait_for(predicate, what: str, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)


def _log(out: Path, k: int) -> str:
    p = out / "logs" / f"worker{k}.log"
    return p.read_text(errors="replace") if p.exists() else ""


def _lives(out: Path) -> str:
    """Every worker's lives file and the last lines of its log: what an unexpected restart count needs to be read."""
    parts = []
    for lives in sorted((out / "logs").glob("worker*.lives")):
        log = _log(out, int(lives.stem.removeprefix("worker"))).splitlines()
        parts.append(f"--- {lives.name}\n{lives.read_text()}--- its log's last 40 lines\n" + "\n".join(log[-40:]))
    return "\n".join(parts)


ROUNDS = 36
# ~25 s of training after the death (0.8 s a round); a restart takes 5-13 s here, more under load. (26 rounds of H = 20
# were too few once reused pair groups made the rounds shorter: the survivors finished before worker 3 was back)
LONGER = ["--rounds", str(ROUNDS), "--sync-every", "30"]


def test_a_worker_that_dies_restarts_rejoins_and_the_job_ends_as_if_uninterrupted(env, tmp_path):
    """4 workers; worker 3 calls os._exit at round 3: torchrun restarts it (its own job), it resumes from its own
    checkpoint and rejoins at the live round; the other three finish every round, never failing an exchange
    among themselves; held-out loss within 2 % of the same job uninterrupted (pinned: tests/pinned.py)."""
    said = _finish(_launch(env, tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"), "--crash-worker", "3",
                           "--crash-round", "3", *LONGER))
    # fgdiloco launch says what it started, where the output goes, and how the workers ended
    assert "launch: workers 0..3 of 4 slots on the gossip store" in said and "worker<k>.log" in said, said
    assert "launch: 4 of 4 workers finished, 1 restart(s) (worker 3: 1)" in said, said + _lives(tmp_path)
    crash = tmp_path
    hit = _results(crash / "res")
    assert sorted(hit) == [0, 1, 2, 3]
    for k in (0, 1, 2):
        assert hit[k]["life"] == 0 and hit[k]["final_round"] == ROUNDS
        assert hit[k]["rounds_trained"] == list(range(ROUNDS)), hit[k]  # every round, none skipped
        assert hit[k]["rejoins"] == 0
        among = [e for e in hit[k]["errors"] if "rank 3" not in e]
        assert among == [], among  # exchanges between survivors never failed
    assert hit[3]["life"] == 1 and hit[3]["rejoins"] == 1 and hit[3]["final_round"] == ROUNDS
    # it rejoins the live round: with its checkpoint, or with a live peer's state when that is ADOPT_ROUNDS old
    assert "resumed from" in _log(crash, 3)
    assert "joining the job at outer round" in _log(crash, 3) or "with a live peer's parameters" in _log(crash, 3)
    assert hit[3]["rounds_trained"], _log(crash, 3)  # it came back before the end ...
    first = hit[3]["rounds_trained"][0]
    assert 3 < first < ROUNDS and hit[3]["rounds_trained"] == list(range(first, ROUNDS))  # ... and trained the rest
    mean = sum(w["held_out_loss"] for w in hit.values()) / len(hit)
    base = clean_loss("clean_elastic_launch")
    assert abs(mean - base) <= 0.02 * base, (mean, base)
    assert mean < 5.6  # and it learned: well below the initial loss (ln 512 = 6.24)


# the fifth worker starts up with the others and joins when told (--join-when); then worker 1 hangs until its peers
# are CATCH_UP_ROUNDS + 2 ahead: ~30 rounds of the tiny GPT (0.1-0.3 s each; 0.05-0.1 s while a partner is skipped)
HANG_ROUNDS = ["--rounds", "120"]


def _last_round(out: Path, k: int) -> int:
    """The newest round worker ``k`` reported in its log (-1: none yet)."""
    return max((int(m) for m in re.findall(rf"worker {k} round +(\d+)", _log(out, k))), default=-1)


def test_hang_join_and_leave_never_stall_the_others(env, tmp_path):
    """5 slots, 4 workers started, on a store served by ``fgdiloco store``: a fifth worker joins mid-run (it adopts
    a live peer's state); worker 1 is then SIGSTOPped (hung) until twice the liveness window has passed and its
    peers are CATCH_UP_ROUNDS + 2 rounds ahead, and continued (it catches up with a live peer's state); worker 2
    leaves at round 8 (close(): a departure notice). Nobody waits for a timeout: the hang costs its partners the
    liveness check, the departure nothing, and everyone ends at the last round. Each step waits for the event it
    needs (the job's pace differs between machines), none for a fixed time."""
    store = subprocess.Popen([sys.executable, "-m", "fgdiloco", "store", "--port", "0"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = store.stdout.readline()
        port = int(line.split(" on ")[1].split(":")[1].split()[0].rstrip(":"))
        address = f"localhost:{port}"
        e = dict(env, FGDILOCO_MIN_WORKERS="4")
        t0 = time.monotonic()
        main = _launch(e, tmp_path, "--leave-worker", "2", "--leave-round", "8", *HANG_ROUNDS, store=address,
                       slots=5)
        res = tmp_path / "res"
        go = tmp_path / "joiner.go"  # the joiner starts up now and joins when the job is running
        joiner = _launch(e, tmp_path, *HANG_ROUNDS, "--join-when", str(go), workers=1, store=address, slots=5,
                         first=4)
        # worker 1 may itself join at round 1 when it starts last: wait for its first trained rounds, whichever
        _wait_for(lambda: _last_round(tmp_path, 1) >= 1, "worker 1's second round")
        go.touch()
        _wait_for(lambda: _last_round(tmp_path, 4) >= 0, "the joiner's first round")
        _wait_for(lambda: _last_round(tmp_path, 1) >= 3, "worker 1's round 3")
        pid = int((res / "worker1.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        stopped, hung_at = time.monotonic(), _last_round(tmp_path, 1)
        ahead = hung_at + CATCH_UP_ROUNDS + 2
        _wait_for(lambda: time.monotonic() - stopped > 2 * FGDiLoCoConfig().liveness
                  and min(_last_round(tmp_path, 0), _last_round(tmp_path, 3)) >= ahead, "worker 1's peers to go on")
        os.kill(pid, signal.SIGCONT)
        _finish(main)
        _finish(joiner)
        elapsed = time.monotonic() - t0
    finally:
        store.terminate()
        store.wait(timeout=30)
    got = _results(tmp_path / "res")
    assert sorted(got) == [0, 1, 2, 3, 4]
    for k in (0, 1, 3, 4):
        assert got[k]["final_round"] == int(HANG_ROUNDS[1]), got[k]
    assert got[2]["final_round"] == 8  # it left there
    assert got[1]["rejoins"] >= 1  # it came back behind and joined the live round, with a live peer's state
    assert "joined the job at outer round" in _log(tmp_path, 1) and "with a live peer's parameters" in _log(tmp_path, 1)
    assert got[4]["rejoins"] == 1 and "with a live peer's parameters" in _log(tmp_path, 4)
    everything = [e for w in got.values() for e in w["errors"]]
    assert not [e for e in everything if "within 20" in e or "after 20" in e], everything  # no full timeouts
    assert all(w["life"] == 0 for w in got.values()), got  # nobody crashed (not even at exit) and was restarted
    about_2 = [e for k, w in got.items() if k != 2 for e in w["errors"] if "rank 2" in e and
               int(e.split()[1].rstrip(":")) >= 9]
    assert about_2 and all("departure notice" in e for e in about_2), about_2  # gone at once, no wait
    # the joiner started from its peers' state: at the end it is as good as they are
    peers = [got[k]["held_out_loss"] for k in (0, 1, 3)]
    assert got[4]["held_out_loss"] <= 1.03 * max(peers), (got[4]["held_out_loss"], peers)
    assert elapsed < 200


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the children of ``pid``."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [(int(line.split(None, 1)[0]), line.split(None, 1)[1]) for line in out.splitlines() if line.strip()]


def test_a_killed_store_is_restarted_a_spare_slot_never_stalls_and_every_life_is_counted(env, tmp_path):
    """``fgdiloco launch`` with a spare slot (5 slots, 4 workers): the store's process is SIGKILLed mid-run and
    restarted by the launcher (the workers reconnect, re-publish and train on); worker 2 dies in its first life
    before it builds anything (counted as a restart); nobody waits out a timeout (no round-1 stall for the spare
    slot, no exchange timing out across the store's restart)."""
    e = dict(env, FGDILOCO_MIN_WORKERS="4")
    cmd = [sys.executable, "-m", "fgdiloco", "launch", "--workers", "4", "--slots", "5", "--max-restarts", "2",
           "--log-dir", str(tmp_path / "logs"), SCRIPT, *ARGS, "--rounds", "80", "--sync-every", "20", "--results",
           str(tmp_path / "res"), "--fail-at-start-worker", "2"]
    proc = subprocess.Popen(cmd, env=e, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: _last_round(tmp_path, 0) >= 8, "worker 0's round 8")
    stores = [p for p, args in _children(proc.pid) if "fgdiloco.elastic.serve" in args and "--standby" not in args]
    assert len(stores) == 1, _children(proc.pid)  # and its standby, which takes over
    os.kill(stores[0], signal.SIGKILL)
    said = _finish(proc, timeout=300)
    assert "the gossip store on localhost:" in said and "died (exit -9) and was restarted" in said, said
    assert "4 of 4 workers finished, 1 restart(s) (worker 2: 1)" in said, said + _lives(tmp_path)
    got = _results(tmp_path / "res")
    assert sorted(got) == [0, 1, 2, 3] and all(w["final_round"] == 80 for w in got.values()), got
    everything = [e for w in got.values() for e in w["errors"]]
    assert not [e for e in everything if "within 20" in e or "after 20" in e], everything  # no full timeouts
    assert any("gossip store" in e for e in everything), everything  # the outage was met: skipped exchanges
    assert "answers again after" in _log(tmp_path, 0)
    losses = [w["held_out_loss"] for w in got.values()]
    assert max(losses) <= 1.03 * min(losses), losses


def test_refused_workers_and_a_store_gone_for_good_end_with_one_line_each_and_resume_continues(env, tmp_path):
    """On a store served by ``fgdiloco store``: a second process for a slot that is held, and a worker with another
    model, are refused (their launch exits 1 naming why); then the store dies for good: the workers stop after
    ``--store-timeout`` with their checkpoints and their launch exits 1 naming the store; a new store and
    ``--resume`` (the same command again) finish the job."""

    def serve(port: int = 0) -> tuple[subprocess.Popen, int]:
        p = subprocess.Popen([sys.executable, "-m", "fgdiloco", "store", "--port", str(port)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        line = p.stdout.readline()
        return p, int(line.split(" on ")[1].split(":")[1].split()[0])

    store, port = serve()
    address = f"localhost:{port}"
    common = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--store-timeout", "6", "--rounds", "3000"]
    e = dict(env, FGDILOCO_MIN_WORKERS="2")  # slot 2 is for the refused worker: do not wait for it
    main = _launch(e, tmp_path, *common, workers=2, store=address, slots=3)
    _wait_for(lambda: _last_round(tmp_path, 1) >= 2, "worker 1's round 2")
    # both refused launches at once (they are independent: another slot each)
    refused = [subprocess.Popen([sys.executable, "-m", "fgdiloco", "launch", "--store", address, "--slots", "3",
                                 "--first-worker", str(k), "--workers", "1", "--max-restarts", "2", SCRIPT, *ARGS,
                                 *extra, *common], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
               for k, extra in ((1, []), (2, ["--n-embd", "48"]))]
    try:
        (twin_out, twin_err), (other_out, other_err) = [p.communicate(timeout=120) for p in refused]
    finally:
        for p in refused:
            if p.poll() is None:
                p.kill()
    assert refused[0].returncode == 1, twin_out + twin_err
    assert "worker 1 was refused: slot 1 of job 'default' is held by a live worker" in twin_err, twin_err
    assert refused[1].returncode == 1, other_out + other_err
    assert "worker 2 was refused: this worker's model has another" in other_err, other_err
    os.killpg(store.pid, signal.SIGKILL)  # the store and its supervisor: gone for good
    store.wait()
    t0 = time.monotonic()
    out, _ = main.communicate(timeout=120)
    assert main.returncode == 1, out
    assert f"workers [0, 1] stopped: the gossip store at {address} was out of reach for too long" in out, out
    assert time.monotonic() - t0 < 60  # store_timeout 6 s, plus a round and the exit
    stopped = [_last_round(tmp_path, k) for k in (0, 1)]
    log0 = _log(tmp_path, 0)
    assert "has been out of reach for" in log0
    assert log0.count("[c10d]") < 30, log0[-3000:]  # a few lines of c10d's own, not a flood
    store, _ = serve(port)
    try:
        again = _launch(e, tmp_path, *common[:-2], "--rounds", str(max(stopped) + 4), workers=2, store=address,
                        slots=3)
        again_out = _finish(again, timeout=200)
    finally:
        os.killpg(store.pid, signal.SIGTERM)
        store.wait(timeout=30)
    assert "2 of 2 workers finished" in again_out, again_out
    got = _results(tmp_path / "res")
    assert got[0]["final_round"] == got[1]["final_round"] == max(stopped) + 4
    assert "resumed from" in _log(tmp_path, 0)


def _stage_pids(lives: Path) -> list[int]:
    """The pids of the newest life's stage processes of a pipeline replica (from its lives file)."""
    starts = [json.loads(x) for x in lives.read_text().splitlines() if '"start"' in x] if lives.exists() else []
    newest = max((r["restart"] for r in starts), default=-1)
    return [r["pid"] for r in starts if r["restart"] == newest]


def _stage_rounds(out: Path, k: int, stage: int) -> list[tuple[int, float]]:
    """(round, unix time) of each ``--log-rounds`` line of replica ``k``'s stage ``stage``."""
    return [(int(r), float(t)) for r, t in
            re.findall(rf"worker {k} stage {stage} round +(\d+) .*? at (\d+\.\d+)", _log(out, k))]


def test_an_elastic_pipeline_replica_that_loses_a_stage_restarts_whole_and_a_hung_stage_costs_no_timeout(env,
                                                                                                      tmp_path):
    """fgdiloco launch --stages 2: each replica is one torchrun job of its 2 stages. Stage 1 of replica 1 dies at
    round 5: torchrun restarts both of its stages (a fresh process group: init_replica_group), they resume from their
    checkpoints. Later stage 0 of replica 0 is SIGSTOPped (hung, longer than the 2 s liveness) until replica 1's
    two stages have trained rounds after the liveness, and continued: nobody is restarted or waits out a deadline,
    and replica 1 trains on during the hang, after the liveness: its stage 0 skips the hung stage, and its stage 1
    skips replica 0's stage 1, which still beats while it waits for its hung stage 0 (a peer whose replica has a
    silent stage is gone: docs/faults.md). Both replicas finish every round."""
    script = str(ROOT / "examples" / "elastic_pipeline.py")
    # replica 0 trains alone while replica 1 restarts (torchrun and two torch imports: 8 s on a loaded CI machine, at
    # 0.13 s a round alone; 100 rounds ended before the restart was in) and while its own stage hangs
    rounds = 250
    cmd = [sys.executable, "-m", "fgdiloco", "launch", "--workers", "2", "--stages", "2", "--max-restarts", "2",
           "--log-dir", str(tmp_path / "logs"), script, "--rounds", str(rounds), "--checkpoint-dir",
           str(tmp_path / "ckpt"), "--crash-worker", "1", "--crash-stage", "1", "--crash-round", "5", "--results",
           str(tmp_path / "res"), "--log-rounds"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lives = tmp_path / "logs" / "worker1.lives"
        _wait_for(lambda: lives.exists() and '"restart": 1' in lives.read_text(), "replica 1's restart")
        # 8 rounds into its new life: its exchanges have the history (5+) that gives them a deadline of their own, so
        # a hang that lands inside an exchange costs that deadline (about a second), not exchange_timeout (60 s)
        _wait_for(lambda: len(_stage_rounds(tmp_path, 1, 0)) >= 14, "replica 1's 8th round after its restart")
        pid = _stage_pids(tmp_path / "logs" / "worker0.lives")[0]
        stopped = time.time()
        os.kill(pid, signal.SIGSTOP)
        liveness = FGDiLoCoConfig().liveness
        _wait_for(lambda: time.time() - stopped > 2 * liveness and all(
            sum(t > stopped + liveness for _, t in _stage_rounds(tmp_path, 1, stage)) >= 3 for stage in range(2)),
            "replica 1 to train on during the hang")
        os.kill(pid, signal.SIGCONT)
        resumed = time.time()
    finally:
        said = _finish(proc)
    assert "2 of 2 workers finished, 1 restart(s) (worker 1: 1)" in said, said + _lives(tmp_path)
    res = {(w, s): json.loads((tmp_path / "res" / f"worker{w}.stage{s}.json").read_text())
           for w in range(2) for s in range(2)}
    assert {k: (r["life"], r["round"]) for k, r in res.items()} == {
        (0, 0): (0, rounds), (0, 1): (0, rounds), (1, 0): (1, rounds), (1, 1): (1, rounds)}
    assert res[(0, 0)]["rejoins"] == res[(0, 1)]["rejoins"]  # the hung replica's stages stay together
    for stage in range(2):  # replica 1 went on during the hang, once the liveness had passed
        during = [t - stopped for _, t in _stage_rounds(tmp_path, 1, stage)
                  if stopped + FGDiLoCoConfig.liveness < t < resumed]
        assert during, (stage, [round(t - stopped, 1) for _, t in _stage_rounds(tmp_path, 1, stage)][-30:])
    logs = _log(tmp_path, 0) + _log(tmp_path, 1)
    # no exchange or stage transfer waited out its deadline (fgdiloco's own messages; c10d's socket warnings from
    # a given-up exchange's set-up thread in the background are not training time)
    assert not re.findall(r"fgdiloco.*(?:within|after) 60(?:\.0)? s", logs), logs
    for w in range(2):  # the last stage has the loss: both replicas learned
        losses = res[(w, 1)]["losses"]
        assert losses[-1] < 0.7 * res[(0, 1)]["losses"][0], losses
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "worker0.stage0.pt", "worker0.stage1.pt", "worker1.stage0.pt", "worker1.stage1.pt"]
