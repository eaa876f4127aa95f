"""Tiny deterministic runs whose per-round trajectories are pinned in ``tests/fixtures/pinned/*.json``.

Each run returns, per worker, one record per outer round: the held-out loss of the worker's model on a fixed batch
and a checksum of its parameters (float64 sum and sum of squares). ``tests/test_pinned.py`` compares them with the
fixtures, so a change that only moves code (a refactor) can be checked to move no number.

Write the fixtures anew (only when a change of behaviour is intended, and say so in the commit)::

    python -m tests.pinned
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

FIXTURES = Path(__file__).parent / "fixtures" / "pinned"
H = 3
ROUNDS = 6


def checksum(tensors: Any) -> list[float]:
    """``[Σx, Σx²]`` in float64 over ``tensors``."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    return [float(flat.sum()), float((flat ** 2).sum())]


def _record(opt: Any, model: torch.nn.Module, rank: int) -> dict[str, Any]:
    from tests.reference import loss_of

    with torch.no_grad():
        held = float(loss_of(model, rank, 10_000))
    return {"round": opt.round, "loss": held, "params": checksum(model.parameters())}


def _train_rounds(opt: Any, model: torch.nn.Module, rank: int, rounds: int = ROUNDS) -> list[dict[str, Any]]:
    from tests.reference import loss_of

    out = []
    step = 0
    for _ in range(rounds):
        for _ in range(H):
            loss_of(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
            step += 1
        out.append(_record(opt, model, rank))
    return out


def _worker(rank: int, world: int, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    from fgdiloco import FGDiLoCo
    from tests.reference import INNER_LR, make_model

    model = make_model(seed=rank)  # different initial weights: broadcast_init makes them rank 0's
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, timeout=30.0,
                   **kwargs)
    try:
        return _train_rounds(opt, model, rank)
    finally:
        opt.close()


def exact(tmp: str) -> list[Any]:
    """Exact DiLoCo (``topology="allreduce"``, lossless) on 4 ranks."""
    from fgdiloco.testing import run_ranks

    return run_ranks(_worker, 4, tmp, {"topology": "allreduce", "codec": "dense"})


def gossip_lowrank(tmp: str) -> list[Any]:
    """Random-matching gossip with the low-rank codec on 4 ranks (bf16 Mix1, momentum mixed)."""
    from fgdiloco.testing import run_ranks

    return run_ranks(_worker, 4, tmp, {"topology": "random", "codec": "lowrank", "seed": 3})


def _pipeline_worker(rank: int, world: int) -> list[dict[str, Any]]:
    from fgdiloco import FGDiLoCo, ReplicaMesh
    from fgdiloco.pipeline import Pipeline
    from tests.reference import INNER_LR, batch, make_model

    mesh = ReplicaMesh(2, 2)
    full = make_model(seed=0)
    stage = [torch.nn.Sequential(full[0], full[1]), torch.nn.Sequential(full[2])][mesh.stage]
    opt = FGDiLoCo(stage, torch.optim.AdamW(stage.parameters(), lr=INNER_LR), sync_every=H, timeout=30.0,
                   mesh=mesh, seed=1, codec="dense")
    pipe = Pipeline(stage, mesh, F.mse_loss, 2, "1f1b")
    out = []
    step = 0
    try:
        for _ in range(ROUNDS):
            for _ in range(H):
                x, y = batch(mesh.replica, step)
                pipe.step(x, y)
                opt.step()
                opt.zero_grad()
                step += 1
            held = pipe.eval_loss(*batch(mesh.replica, 10_000))
            out.append({"round": opt.round, "loss": None if held is None else float(held),
                        "params": checksum(stage.parameters())})
    finally:
        opt.close()
    return out


def pipeline(tmp: str) -> list[Any]:
    """A 2 replicas x 2 stages pipeline (1F1B, 2 microbatches) with gossip per stage."""
    from fgdiloco.testing import run_ranks

    return run_ranks(_pipeline_worker, 4, tmp)


def lightning(tmp: str) -> list[Any]:
    """The Lightning strategy on 2 replicas (tests/lightning_scripts/train.py): parameters after every round."""
    from tests.test_lightning import _launch

    results = _launch(Path(tmp) / "pl", "--sync-every", "3", "--samples", "96", "--batch-size", "8",
                      "--max-epochs", "2", "--codec", "dense", devices=2)
    return [[{"round": i + 1, "loss": None, "params": checksum([p])} for i, p in enumerate(r["round_params"])]
            for r in results]


def _elastic_worker(rank: int, world: int, address: str, slow: int = -1, seconds: float = 0.0
                    ) -> list[dict[str, Any]]:
    os.environ.update({"FGDILOCO_STORE": address, "FGDILOCO_WORKER": str(rank), "FGDILOCO_WORKERS": str(world),
                       "FGDILOCO_JOB": "pinned"})
    from fgdiloco import FGDiLoCo
    from tests.reference import INNER_LR, make_model

    model = make_model(seed=0)
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, timeout=30.0,
                   elastic=True, seed=2, codec="dense")
    if rank == slow:
        time.sleep(seconds)  # the fault: a set-up that ends this long after the start barrier
    try:
        return _train_rounds(opt, model, rank)
    finally:
        opt.close()


def elastic(tmp: str) -> list[Any]:
    """An elastic job of 4 workers on a gossip store, no faults (every exchange happens, so it is deterministic)."""
    from fgdiloco.testing import run_workers_on_store

    return run_workers_on_store(_elastic_worker, 4, tmp)


def _pretrain_rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"round": r["round"], "loss": r["eval_loss"], "params": [r["eval_loss_mean"], r["train_loss"] or 0.0]}
            for r in rows]


def _pretrain_config(tmp: str, **kw: Any) -> Any:
    from fgdiloco.pretrain.worker import TrainConfig

    fixture = Path(__file__).parent / "fixtures" / "moby_dick_ch1-29.txt"
    base = dict(workers=4, steps=24, sync_every=4, n_layer=2, n_head=2, n_embd=32, batch_size=4, block_size=32,
                vocab_size=384, lr=1e-2, warmup_steps=4, eval_batches=2, data=str(fixture),
                cache_dir=str(Path(tmp) / "cache"), out=str(Path(tmp) / "out"), quiet=True, timeout=30.0)
    base.update(kw)
    return TrainConfig(**base)


def _pretrain_worker(rank: int, world: int, cfg: Any) -> None:
    from fgdiloco.pretrain.worker import train_worker

    train_worker(cfg)


def pretrain_group(tmp: str) -> list[Any]:
    """The example job's group worker on 4 Gloo ranks (ring gossip, low-rank codec) and on a 2 x 2 pipeline:
    rank 0's rows (held-out loss, the replicas' mean, train loss) after every round."""
    from fgdiloco.testing import run_ranks

    out = []
    for kw in ({"topology": "ring", "codec": "lowrank"}, {"stages": 2, "microbatches": 2, "codec": "dense"}):
        cfg = _pretrain_config(tmp, **kw, out=str(Path(tmp) / f"out{len(out)}"))
        run_ranks(_pretrain_worker, 4, tmp, cfg, timeout=300)
        out.append(_pretrain_rows(Path(cfg.out)))
    return out


def pretrain_elastic(tmp: str) -> list[Any]:
    """``fgdiloco pretrain`` (elastic workers, each its own torchrun job) on a tiny model: the merged rows."""
    import subprocess

    cfg = _pretrain_config(tmp)
    args = ["--workers", "4", "--steps", "24", "--sync-every", "4", "--n-layer", "2", "--n-head", "2", "--n-embd",
            "32", "--batch-size", "4", "--block-size", "32", "--vocab-size", "384", "--lr", "0.01",
            "--warmup-steps", "4", "--eval-batches", "2", "--data", cfg.data, "--cache-dir", cfg.cache_dir,
            "--out", cfg.out, "--timeout", "30", "--codec", "dense", "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "fgdiloco", "pretrain", *args], check=True, env=env, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [_pretrain_rows(Path(cfg.out))]


# ------------------------------------------------------------------------ uninterrupted runs the fault tests meet
# A fault test compares its job's final held-out loss with the same job run without the fault. Those clean runs
# have no fault to wait for and exchange every round, so (one thread per rank) they give the same number on every
# run: it is pinned here instead of run again by every test (30-40 s each on the 2-core machine). The fault tests
# allow 2 % against it, far more than the 1e-7 CPUs differ by; a change of behaviour rewrites it with the others.

def clean_elastic_launch(tmp: str) -> float:
    """``fgdiloco launch`` of ``examples/elastic_gpt.py`` on 4 workers, no fault (the job of
    ``tests/test_elastic_launch.py``'s restart test): the workers' mean held-out loss."""
    from tests import test_elastic_launch as t

    out = Path(tmp)
    t._finish(t._launch(t.tokenizer_env(out / "xdg"), out, "--checkpoint-dir", str(out / "ckpt"), *t.LONGER))
    results = t._results(out / "res")
    return sum(w["held_out_loss"] for w in results.values()) / len(results)


def clean_pipeline_pretrain(tmp: str) -> dict:
    """``fgdiloco pretrain`` on 2 elastic replicas of 2 stages, no fault (the job of
    ``tests/test_pretrain_elastic.py``'s killed-stage test): its final held-out loss and its held-out loss at every
    evaluation point (``eval_curve``: ``[round, loss]``)."""
    from fgdiloco.pretrain.results import read_rows
    from tests import test_pretrain_elastic as t

    out = Path(tmp)
    proc = t._start([*t.killed_stage_argv(out / "cache"), "--out", str(out / "run")], out)
    stdout, stderr = t._finish(proc, 300)
    if proc.returncode != 0:
        raise RuntimeError(stdout + stderr)
    curve = [[r["round"], r["eval_loss"]] for r in read_rows(out / "run" / "metrics.jsonl")]
    return {"held_out_loss": float(json.loads((out / "run" / "summary.json").read_text())["final_eval_loss"]),
            "eval_curve": curve}


CLEAN = {"clean_elastic_launch": clean_elastic_launch, "clean_pipeline_pretrain": clean_pipeline_pretrain}


def clean_loss(name: str) -> float:
    """The pinned final held-out loss of the uninterrupted run ``name`` (a key of :data:`CLEAN`)."""
    return float(json.loads((FIXTURES / f"{name}.json").read_text())["held_out_loss"])


def clean_curve(name: str) -> dict[int, float]:
    """The pinned held-out loss at each evaluation round of the uninterrupted run ``name`` (runs that keep it)."""
    return {int(r): float(loss) for r, loss in json.loads((FIXTURES / f"{name}.json").read_text())["eval_curve"]}


RUNS = {"exact": exact, "gossip_lowrank": gossip_lowrank, "pipeline": pipeline, "lightning": lightning,
        "elastic": elastic,
        "pretrain_group": pretrain_group, "pretrain_elastic": pretrain_elastic}


def main(names: list[str]) -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in names or [*RUNS, *CLEAN]:
        with tempfile.TemporaryDirectory() as tmp:
            if name in CLEAN:
                got = CLEAN[name](tmp)
                record = {"run": name, "doc": CLEAN[name].__doc__,
                          **(got if isinstance(got, dict) else {"held_out_loss": got})}
            else:
                record = {"run": name, "doc": RUNS[name].__doc__, "workers": RUNS[name](tmp)}
        (FIXTURES / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {FIXTURES / (name + '.json')}")


if __name__ == "__main__":
    main(sys.argv[1:])
