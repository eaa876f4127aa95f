"""Lightning: ``Trainer(strategy="fgdiloco")``, per-replica checkpoints, ``GossipMonitor``.

Multi-process runs start ``tests/lightning_scripts/train.py`` as a subprocess on a fresh port (Lightning's popen
launcher re-executes the command line, which must not be pytest's); each rank saves what it saw to ``rank{r}.pt``.
"""

from __future__ import annotations

import csv
import datetime
import inspect
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from fgdiloco import FGDiLoCo, FGDiLoCoConfig, RoundStats
from fgdiloco.testing import run_ranks
from lightning_callbacks import FGDiLoCoStrategy, GossipMonitor
from lightning_callbacks.monitor import ConsensusGrowthTracker, ConsensusGrowthWarning
from lightning_callbacks.strategy import replica_checkpoint_path
from tests.lightning_scripts.train import flat_params, make_dataset, make_inner_optimizer, make_model

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "lightning_scripts" / "train.py"


def _free_port() -> int:
    """A port for Lightning's rank-0 store, from below the kernel's ephemeral range: a port the kernel hands out
    (``bind(0)``, every outgoing connection, e.g. the Gloo pairs of tests running beside this one) could be taken
    again between this check and the store's bind (seen once: EADDRINUSE, and rank 1 then waited out the test's
    timeout). Only another explicit bind can take a port from below the range."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    rng = random.Random()  # seeded from the OS: pytest-xdist workers must not draw the same ports
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below the ephemeral range ({low})")


def _launch(out: Path, *args: str, devices: int, timeout: float = 150.0) -> list[dict]:
    """Run the script on ``devices`` CPU processes; return every rank's record."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "PL_GLOBAL_SEED")}
    env.update(MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--devices", str(devices), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's children are in the same new session
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s:\n{log[-6000:]}")
    (out.parent / f"{out.name}.log").write_text(log)
    if proc.returncode != 0:
        lines = [line for line in log.splitlines() if not line.lstrip().startswith("frame #")]
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(lines[:60] + ["..."] + lines[-60:]))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


# ---------------------------------------------------------------------------------------------------- in-process
def test_registered_names_need_no_other_argument():
    from pytorch_lightning.strategies import StrategyRegistry

    assert {"fgdiloco", "fgdiloco_spawn"} <= set(StrategyRegistry)
    trainer = pl.Trainer(strategy="fgdiloco", logger=False, enable_checkpointing=False)
    assert type(trainer.strategy) is FGDiLoCoStrategy
    assert trainer.strategy._start_method == "popen"
    trainer = pl.Trainer(strategy="FGDiLoCo_Spawn", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is FGDiLoCoStrategy and trainer.strategy._start_method == "spawn"
    assert trainer.strategy.fgdiloco is None  # built in setup() of fit


def test_strategy_defaults_are_fgdiloco_defaults_and_it_takes_the_same_settings_object():
    assert FGDiLoCoStrategy().config == FGDiLoCoConfig()
    config = FGDiLoCoConfig(sync_every=7, codec="lowrank", timeout=9.0)
    assert FGDiLoCoStrategy(config).config == config
    assert FGDiLoCoStrategy(config, mix2_rounds=2).config == config.replace(mix2_rounds=2)
    assert FGDiLoCoStrategy(sync_every=7, codec="lowrank", timeout=9.0).config == config
    assert "broadcast_init" in inspect.signature(FGDiLoCoStrategy).parameters


@pytest.mark.slow
def test_import_lightning_callbacks_registers_lazily_and_fgdiloco_survives_without_lightning():
    code = (
        "import sys\n"
        "import fgdiloco, lightning_callbacks\n"
        "assert 'pytorch_lightning' not in sys.modules, 'import fgdiloco must not import Lightning'\n"
        "import pytorch_lightning as pl\n"
        "from pytorch_lightning.strategies import StrategyRegistry\n"
        "assert {'fgdiloco', 'fgdiloco_spawn'} <= set(StrategyRegistry)\n"
        "assert type(pl.Trainer(strategy='fgdiloco', logger=False).strategy).__name__ == 'FGDiLoCoStrategy'\n"
        "import subprocess\n"
        "blocked = ('import sys; sys.modules[\"pytorch_lightning\"] = None; sys.modules[\"lightning\"] = None\\n'\n"
        "           'import fgdiloco, lightning_callbacks; print(\"ok\", fgdiloco.FGDiLoCo.__name__)')\n"
        "r = subprocess.run([sys.executable, '-c', blocked], capture_output=True, text=True)\n"
        "assert r.returncode == 0 and 'ok FGDiLoCo' in r.stdout, r.stderr\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(sync_every=0), ValueError, "sync_every"),
        (dict(sync_every=2.5), TypeError, "sync_every"),
        (dict(topology="bogus"), ValueError, "topology"),
        (dict(outer_lr=-0.1), ValueError, "outer_lr"),
        (dict(outer_momentum=1.0), ValueError, "outer_momentum"),
        (dict(mix2_rounds=-1), ValueError, "mix2_rounds"),
        (dict(codec="nope"), ValueError, "codec"),
        (dict(timeout=0), ValueError, "timeout"),
        (dict(timeout=datetime.timedelta(seconds=5)), TypeError, "process_group_timeout"),
        (dict(seed="0"), TypeError, "seed"),
        (dict(start_method="thread"), ValueError, "start_method"),
        (dict(find_unused_parameters=True), TypeError, "find_unused_parameters"),
        (dict(process_group_timeout=30), TypeError, r"process_group_timeout must be a datetime\.timedelta"),
        (dict(process_group_timeout="30"), TypeError, "process_group_timeout"),
        (dict(process_group_timeout=datetime.timedelta(0)), ValueError, "process_group_timeout .*positive"),
        (dict(process_group_backend="glo"), ValueError, r"process_group_backend must be None .*'gloo'.*'nccl'"),
        (dict(process_group_backend="cpu:gloo,cuda:bogus"), ValueError, "process_group_backend"),
        (dict(process_group_backend=1), TypeError, "process_group_backend"),
    ],
)
def test_wrong_strategy_arguments_fail_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        pl.Trainer(strategy=FGDiLoCoStrategy(**kwargs), accelerator="cpu", devices=2, logger=False)


@pytest.mark.parametrize("backend", [None, "gloo", "nccl", "NCCL", "mpi", "cpu:gloo,cuda:nccl"])
@pytest.mark.parametrize("timeout", [None, datetime.timedelta(seconds=30)])
def test_valid_process_group_arguments_are_accepted_and_passed_on(backend, timeout):
    strategy = FGDiLoCoStrategy(process_group_backend=backend, process_group_timeout=timeout)
    assert strategy._process_group_backend == backend and strategy._timeout == timeout


def _stats(round_: int, distance: float | None) -> RoundStats:
    return RoundStats(round=round_, inner_steps=4, round_seconds=1.0, inner_seconds=0.9, mix2_seconds=0.05,
                      mix1_wait_seconds=0.0, mix1_seconds=0.3, outer_seconds=0.05, utilisation=0.9,
                      mix1_bytes_sent=100, mix1_bytes_received=100, mix2_bytes_sent=50, mix2_bytes_received=50,
                      consensus_distance=None if distance is None else distance / 10, failed_exchanges=0,
                      consensus_relative=distance)


def test_consensus_growth_warns_once_after_patience():
    monitor = GossipMonitor(growth_patience=3)
    distances = [1.0, 0.9, 1.1, 1.2, None, 1.3, 1.4, 1.5, 1.6]  # 3 rises 0.9 -> 1.3 (None is ignored)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fired = [monitor.observe(_stats(i, d), rank=2) for i, d in enumerate(distances)]
    assert fired == [False, False, False, False, False, True, False, False, False]
    growth = [w for w in caught if issubclass(w.category, ConsensusGrowthWarning)]
    assert len(growth) == 1 and "rank 2" in str(growth[0].message) and "3 consecutive" in str(growth[0].message)


def test_consensus_growth_tracker_resets_on_a_drop():
    tracker = ConsensusGrowthTracker(patience=2)
    assert [tracker.update(d) for d in [1.0, 2.0, 1.5, 1.6, 1.4, 1.5, 1.7]] == [False] * 6 + [True]
    assert tracker.update(float("nan")) is False  # fired already: once only
    with pytest.raises(ValueError, match="patience"):
        ConsensusGrowthTracker(patience=0)


def test_monitor_metric_names():
    monitor = GossipMonitor()
    names = set(monitor.metrics(_stats(0, 0.5), failed_total=3))
    for key in ("utilisation", "bytes_sent", "bytes_received", "mix1_bytes_sent", "mix2_bytes_received",
                "mix1_wait_seconds", "mix2_seconds", "consensus_distance", "failed_exchanges",
                "skipped_exchanges", "failed_exchanges_total", "round"):
        assert f"gossip/{key}" in names
    assert "gossip/consensus_distance" not in monitor.metrics(_stats(1, None))
    with pytest.raises(ValueError, match="prog_bar"):
        GossipMonitor(prog_bar={"no_such_field": "x"})


def test_docs_list_every_key_the_monitor_logs():
    """docs/lightning.md's GossipMonitor section names every key the monitor can log (one round with every
    optional field set) and no other."""
    stats = _stats(3, 0.5)
    for field in ("pseudo_gradient_distance", "pseudo_gradient_relative", "momentum_distance", "deadline_seconds",
                  "mix1_deadline_seconds"):
        setattr(stats, field, 0.25)
    logged = {k.removeprefix("gossip/") for k in GossipMonitor().metrics(stats, failed_total=3)}
    doc = (REPO / "docs" / "lightning.md").read_text().split("## `GossipMonitor`", 1)[1]
    listed = doc.split("under `prefix`:", 1)[1].split("[design.md]", 1)[0]
    assert set(re.findall(r"`([a-z0-9_]+)`", listed)) == logged


# ---------------------------------------------------------------------------------------------------- multi-process
def _plain_wrapper(rank: int, world: int, samples: int, batch_size: int, epochs: int, sync_every: int, seed: int):
    """The same training as train.py, written as a plain loop around FGDiLoCo. Data order: Lightning injects
    ``DistributedSampler(shuffle=True, seed=0)`` into a distributed training loader and sets its epoch."""
    model = make_model(seed)
    opt = FGDiLoCo(model, make_inner_optimizer(model.parameters()), sync_every=sync_every, topology="allreduce",
                   outer_lr=0.7, seed=seed, timeout=30.0)
    data = make_dataset(samples)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    rounds = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=batch_size, sampler=sampler):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            before = opt.round
            opt.step()
            if opt.round != before:
                rounds.append(flat_params(model))
    opt.close()
    return rounds, flat_params(model)


@pytest.mark.slow
def test_allreduce_replicas_agree_every_round_and_equal_the_plain_wrapper(tmp_path):
    # 80 samples / (2 ranks x 8) = 5 steps per epoch; 3 epochs = 15 steps = 3 rounds of 4 + 3 steps of a 4th round
    args = ("--topology", "allreduce", "--sync-every", "4", "--samples", "80", "--max-epochs", "3")
    ranks = _launch(tmp_path / "out", *args, devices=2)
    reference = run_ranks(_plain_wrapper, 2, tmp_path, 80, 8, 3, 4, 0)
    for rank in ranks:
        assert rank["rounds"] == 3 and rank["global_step"] == 15 and rank["failed_exchanges_total"] == 0
    for k in range(3):  # identical after every round ...
        torch.testing.assert_close(ranks[0]["round_params"][k], ranks[1]["round_params"][k], rtol=0, atol=0)
        for r in range(2):  # ... and equal to the plain wrapper's
            torch.testing.assert_close(ranks[r]["round_params"][k], reference[r][0][k], rtol=1e-5, atol=1e-6)
    # between rounds (3 inner steps into round 4) each replica has moved on its own shard
    assert not torch.allclose(ranks[0]["final_params"], ranks[1]["final_params"])
    for r in range(2):
        torch.testing.assert_close(ranks[r]["final_params"], reference[r][1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_slow_replica_does_not_slow_the_others_between_rounds(tmp_path):
    args = ("--sync-every", "10", "--samples", "480", "--slow-rank", "1", "--slow-ms", "50")  # 30 steps
    ranks = _launch(tmp_path / "out", *args, devices=2)
    inner = [[t for t, synced in rank["step_times"] if not synced] for rank in ranks]
    fast, slow = statistics.median(inner[0]), statistics.median(inner[1])
    assert slow >= 0.05
    assert fast < 0.025, f"fast rank's median step took {fast * 1000:.1f} ms: it waited for the slow rank"
    # the wait happens once per round, in the blocking Mix2 of the fast rank
    waits = [t for t, synced in ranks[0]["step_times"] if synced]
    assert waits and min(waits) > 0.2
    assert ranks[0]["rounds"] == ranks[1]["rounds"] == 3


@pytest.mark.parametrize("mode", ["accumulate", "manual"])
@pytest.mark.slow
def test_rounds_count_optimizer_steps_and_scheduler_steps(tmp_path, mode):
    # 192 samples / (2 ranks x 8) = 12 batches per rank
    extra = ("--accumulate", "2") if mode == "accumulate" else ("--manual",)
    ranks = _launch(tmp_path / "out", "--sync-every", "3", "--samples", "192", "--scheduler", *extra, devices=2)
    steps = 6 if mode == "accumulate" else 12
    for rank in ranks:
        assert rank["global_step"] == steps
        assert rank["rounds"] == steps // 3
        assert rank["lrs"][-1] == pytest.approx(1e-2 * 0.9**steps)  # StepLR stepped every optimizer step


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_epoch_end_checkpoints_are_complete_when_the_ranks_epochs_differ_in_length(tmp_path):
    """Rank 0 trains 12 steps per epoch, rank 1 9 (no DistributedSampler): ModelCheckpoint names each epoch-end
    checkpoint after the rank's own step, so rank 1's part must go beside rank 0's file, and old ones must be
    removed with it; the checkpoint resumes."""
    common = ("--samples", "96", "--uneven", "72", "--batch-size", "8", "--sync-every", "4", "--timeout", "5",
              "--ckpt-name", "{epoch}-{step}", "--ckpt-dir", str(tmp_path / "ckpt"))
    _launch(tmp_path / "run", *common, "--max-epochs", "2", devices=2)
    main = sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert main == ["epoch=1-step=24.ckpt"], main  # save_top_k=1: the epoch-0 checkpoint was replaced
    assert [p.name for p in (tmp_path / "ckpt").glob("*.replicas")] == ["epoch=1-step=24.ckpt.replicas"]
    assert Path(replica_checkpoint_path(tmp_path / "ckpt" / main[0], 1)).is_file()
    again = _launch(tmp_path / "again", *common[:-2], "--max-epochs", "3", "--resume",
                    str(tmp_path / "ckpt" / main[0]), devices=2)
    assert again[0]["global_step"] == 36 and again[1]["global_step"] == 24 + 9


@pytest.mark.parametrize("name", ["{step}", "{step}-{val_loss:.2f}"])
@pytest.mark.slow
def test_top_k_checkpoints_on_a_per_rank_metric_stay_complete_and_resumable(tmp_path, name):
    """ModelCheckpoint(monitor="val_loss", save_top_k=2) on a val_loss logged without sync_dist: the ranks agree on
    *whether* to save (Lightning reduces that decision) but each picks its own worst checkpoint to delete. Rank 0's
    choice must govern: at epoch 2 rank 0 (0.1, 2, 0.5) drops step=12 and rank 1 (2, 1, 0.5) would drop step=6;
    each checkpoint left must have every rank's part, no part may outlive its checkpoint, and rank 0's best
    (step=6) resumes. With "{val_loss:.2f}" in the name the ranks also name each checkpoint differently."""
    ckpt = tmp_path / "ckpt"
    # 96 samples / (2 ranks x 8) = 6 steps per epoch: validations (and checkpoints) at steps 6, 12 and 18
    ranks = _launch(tmp_path / "run", "--samples", "96", "--sync-every", "3", "--max-epochs", "3", "--ckpt-dir",
                    str(ckpt), "--ckpt-name", name, "--top-k", "2", "--val-losses", "0.1,2,0.5/2,1,0.5", devices=2)
    rank0_kept = [Path(p).name for p in ranks[0]["best_k_models"]]
    steps = [n.removesuffix(".ckpt").split("-")[0] for n in rank0_kept]
    assert steps == ["step=18", "step=6"], rank0_kept  # rank 0's top 2 (0.5 and 0.1)
    assert sorted(p.name for p in ckpt.glob("*.ckpt")) == rank0_kept
    assert sorted(p.name for p in ckpt.glob("*.replicas")) == [f"{n}.replicas" for n in rank0_kept]  # no orphans
    for n in rank0_kept:
        assert [p.name for p in (ckpt / f"{n}.replicas").iterdir()] == ["rank1.pt"]
    best = ranks[0]["best_model_path"]
    assert Path(best).name.startswith("step=6") and Path(replica_checkpoint_path(best, 1)).is_file()
    again = _launch(tmp_path / "again", "--samples", "96", "--sync-every", "3", "--max-epochs", "4", "--resume", best,
                    devices=2)
    assert [rank["global_step"] for rank in again] == [24, 24]


@pytest.mark.slow
def test_four_replicas_default_strategy_resume_and_monitor(tmp_path):
    """4 processes with ``strategy="fgdiloco"`` (defaults: H=50, random gossip). 2400 samples / (4 x 8) = 75 steps
    per epoch, so the epoch-end checkpoint falls 25 steps into round 1. The resumed run must give the same
    parameters as an uninterrupted one on every rank after the next round and at the end."""
    common = ("--strategy-string", "--samples", "2400")
    # the uninterrupted run keeps every epoch-end checkpoint (save_top_k=1's replacement of the replica parts is
    # tested above); the resume starts from its epoch-0 one
    full = _launch(tmp_path / "full", *common, "--max-epochs", "2", "--csv", str(tmp_path / "csv"),
                   "--ckpt-dir", str(tmp_path / "ckpt_full"), "--keep-checkpoints", devices=4)
    ckpt = tmp_path / "ckpt_full" / "epoch=0.ckpt"
    assert ckpt.is_file() and all(Path(replica_checkpoint_path(ckpt, r)).is_file() for r in (1, 2, 3))
    resumed = _launch(tmp_path / "resumed", *common, "--max-epochs", "2", "--resume", str(ckpt), devices=4)

    # the uninterrupted run: 150 steps = 3 rounds; gossip replicas differ; the monitor logged every round
    for rank in full:
        assert rank["strategy"] == "FGDiLoCoStrategy" and rank["fgdiloco_kwargs"]["sync_every"] == 50
        assert rank["rounds"] == 3 and rank["global_step"] == 150 and rank["failed_exchanges_total"] == 0
        assert len(rank["history"]) == 3 and {"util", "cdist"} <= set(rank["progress_bar"])
    assert not torch.allclose(full[0]["round_params"][2], full[1]["round_params"][2])
    rows = [row for row in _read_csv(tmp_path / "csv" / "run" / "version_0" / "metrics.csv")
            if row.get("gossip/round")]
    assert [float(row["gossip/round"]) for row in rows] == [0.0, 1.0, 2.0]
    assert [int(row["step"]) for row in rows] == [50, 100, 150]
    for key in ("utilisation", "bytes_sent", "bytes_received", "mix1_wait_seconds", "mix2_seconds",
                "consensus_distance", "failed_exchanges"):
        assert all(row[f"gossip/{key}"] != "" for row in rows), key
    assert all(0 < float(row["gossip/utilisation"]) <= 1 and float(row["gossip/bytes_sent"]) > 0 for row in rows)
    assert all(Path(replica_checkpoint_path(tmp_path / "ckpt_full" / "epoch=1.ckpt", r)).is_file() for r in (1, 2, 3))

    # resume: same trajectory on every rank
    for r in range(4):
        assert resumed[r]["rounds"] == 3 and resumed[r]["global_step"] == 150
        assert len(resumed[r]["round_params"]) == 2  # rounds 1 and 2 ended after the resume
        for k in (0, 1):
            torch.testing.assert_close(resumed[r]["round_params"][k], full[r]["round_params"][k + 1],
                                       rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(resumed[r]["final_params"], full[r]["final_params"], rtol=1e-6, atol=1e-7)


def test_star_import_works_without_the_unified_lightning_package():
    import importlib.util

    namespace: dict = {}
    exec("from lightning_callbacks import *", namespace)  # noqa: S102 - the import form users write
    assert "FGDiLoCoStrategy" in namespace and "GossipMonitor" in namespace
    if importlib.util.find_spec("lightning") is None:
        import lightning_callbacks

        assert "LightningFGDiLoCoStrategy" not in namespace
        with pytest.raises(AttributeError, match="needs the 'lightning' package"):
            _ = lightning_callbacks.LightningFGDiLoCoStrategy


# ---------------------------------------------------------------------------------------------------- a death
DEATH = re.compile(r"rank (\d+) dies at step (\d+) \(by (\w+)\) at ([\d.]+)")


def _run_until_all_exit(cmd: list[str], out: Path, timeout: float, extra_env: dict[str, str] | None = None):
    """Run ``cmd`` until every process holding its output has exited (the launcher and every rank, also ranks
    the launcher no longer waits for); return (exit status, output, seconds from the death to that moment)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "PL_GLOBAL_SEED")}
    env.update(MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), **(extra_env or {}))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)  # EOF: every process that inherited the pipe has exited
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)}: still running after {timeout} s (a process hangs):\n{log[-6000:]}")
    ended = time.time()
    (out.parent / f"{out.name}.log").write_text(log)
    deaths = DEATH.findall(log)
    assert len(deaths) == 1, f"expected one death, got {deaths}:\n{log[-4000:]}"
    return proc.returncode, log, ended - float(deaths[0][3])


def _launch_dying(out: Path, *args: str, devices: int, timeout: float = 120.0):
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--devices", str(devices), *args]
    return _run_until_all_exit(cmd, out, timeout)


# 3 processes x 20000 steps: far longer than the bounds below, so the job cannot simply have finished (with 400
# steps the survivors, which skip the departed rank, finished the epoch before Lightning's 5 s observer looked;
# with 2000, a survivor left alone on the machine's 2 cores, at about 1.5 ms a step, finished the run before its
# 3 s store_timeout had passed: CI)
LONG_RUN = ("--sync-every", "5", "--samples", "480000", "--timeout", "30")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "sigterm"])
def test_a_dead_rank_ends_the_whole_job_under_lightnings_launcher(tmp_path, how):
    """A rank started by Lightning's launcher that dies (os._exit(1), or SIGTERM) ends the whole job: Lightning's
    child-process observer (polling every 5 s) SIGKILLs the other ranks and the launcher; nothing hangs. With
    SIGTERM the rank posts FGDiLoCo's departure and exits at once (-15): the strategy's SIGTERM handler does not
    broadcast on the world group as Lightning's own does (which blocked the rank for good)."""
    code, log, after = _launch_dying(tmp_path / "out", *LONG_RUN, "--die-rank", "2", "--die-step", "12",
                                     "--die-by", how, devices=3)
    assert code == -signal.SIGKILL, log[-4000:]
    status = 1 if how == "exit" else -signal.SIGTERM
    assert f"terminated with code {status}. Forcefully terminating all other processes" in log
    assert after < 5 + 7, f"the job took {after:.1f} s to end after the death"
    assert not list((tmp_path / "out").glob("rank*.pt"))  # no rank got to the end


@pytest.mark.slow
def test_when_rank_0_dies_under_lightnings_launcher_the_others_stop_after_store_timeout(tmp_path):
    """Rank 0 is the launcher and hosts the job's store. When it dies the job exits with its status (1) at once;
    ranks 1 and 2 train on without gossip (the store is gone) for ``store_timeout``, then stop at their next round
    start with StoreUnreachable: they do not outlive their job (here a run of 2000 steps they would otherwise
    finish long after)."""
    code, log, after = _launch_dying(tmp_path / "out", *LONG_RUN, "--store-timeout", "3", "--die-rank", "0",
                                     "--die-step", "12", devices=3)
    assert code == 1
    for r in (1, 2):
        assert f"fgdiloco rank {r}: the gossip store does not answer" in log
        ended = tmp_path / "out" / f"rank{r}.error"  # its own file: tracebacks on the shared pipe interleave
        assert ended.is_file(), log[-4000:]
        assert re.fullmatch(rf"StoreUnreachable: the job's store .* has been out of reach for \d+ s "
                            rf"\(store_timeout 3 s\): stopping rank {r}", ended.read_text()), ended.read_text()
    assert not list((tmp_path / "out").glob("rank*.pt"))  # no rank got to the end of the run
    # the death is seen within the heartbeat's back-off (<= 5 s), then 3 s, then a round (5 steps)
    assert after < 20, f"the survivors stopped {after:.1f} s after the death"


@pytest.mark.slow
def test_torchrun_restarts_the_job_which_resumes_from_its_checkpoints(tmp_path):
    """Under ``torchrun --max-restarts 1`` a death stops every rank (the agent's SIGTERM ends the survivors at
    once, not its SIGKILL 30 s later) and restarts all of them; each resumes from its own part of the last
    checkpoint and retraces the first attempt's rounds exactly. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch's
    shared agent store the restarted ranks read the previous attempt's addresses and init_process_group fails."""
    # 20 steps per epoch and rank, a round every 5: the epoch-0 checkpoint is at step 20, rank 1 dies at step 38.
    # Rank 0's round-30 parameters are on disk by then (it wrote them before sending its round-35 payload, which
    # rank 1 received); its round-35 write may be cut by the agent's SIGTERM, and the file is replaced whole
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(SCRIPT), "--out", str(tmp_path / "out"), "--devices", "2", "--sync-every", "5",
           "--samples", "320", "--max-epochs", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--resume-latest",
           "--save-rounds", "--die-rank", "1", "--die-step", "38"]
    code, log, _ = _run_until_all_exit(cmd, tmp_path / "out", 150.0, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert code == 0, log[-4000:]
    assert "forcefully exiting via 9" not in log  # the survivor ended on the agent's SIGTERM
    for r in range(2):
        rank = torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)  # written by the second attempt
        assert rank["restart_count"] == 1 and rank["resumed_from"] == str(tmp_path / "ckpt" / "epoch=0.ckpt")
        assert rank["global_step"] == 40 and rank["rounds"] == 8 and rank["failed_exchanges_total"] == 0
        first = dict(torch.load(tmp_path / "out" / f"rank{r}.attempt0.rounds.pt", weights_only=False))
        second = dict(torch.load(tmp_path / "out" / f"rank{r}.attempt1.rounds.pt", weights_only=False))
        assert sorted(second) == [25, 30, 35, 40] and {5, 10, 15, 20, 25, 30} <= set(first), (sorted(first), r)
        for step in {25, 30, 35} & set(first):  # the rounds both attempts made: the same parameters
            torch.testing.assert_close(second[step], first[step], rtol=1e-6, atol=1e-7)
