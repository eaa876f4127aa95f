"""``fgdiloco pretrain --stages S``: workers = replicas x stages, each replica a pipeline of GPT.split(S) stages.

Real Gloo ranks (fork + FileStore) for the worker, one real ``fgdiloco pretrain`` launch (torchelastic) for the
command. Tiny model (2 blocks, width 32), a few dozen steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fgdiloco.cli import main
from fgdiloco.pretrain.config import TrainConfig
from fgdiloco.pretrain.recipe import batch_seed
from fgdiloco.pretrain.results import ROW_FIELDS, SUMMARY_FIELDS, read_rows, summarise
from fgdiloco.pretrain.worker import train_worker
from fgdiloco.testing import run_ranks

FIXTURE = Path(__file__).parent / "fixtures" / "moby_dick_ch1-29.txt"
ROOT = Path(__file__).resolve().parents[1]
B, T, D = 8, 32, 32  # batch, block, width of the tiny model


def tiny(tmp_path: Path, name: str, **kw) -> TrainConfig:
    base = dict(workers=4, stages=2, microbatches=4, steps=60, sync_every=20, n_layer=2, n_head=2, n_embd=D,
                batch_size=B, block_size=T, tokenizer="bytes", lr=1e-2, warmup_steps=5, eval_batches=2,
                data=str(FIXTURE), cache_dir=str(tmp_path / "cache"), out=str(tmp_path / name), quiet=True,
                timeout=60.0)
    base.update(kw)
    return TrainConfig(**base)


def _worker(rank: int, world: int, cfg: TrainConfig) -> dict:
    s = train_worker(cfg)
    return {k: s[k] for k in ("rank", "final_eval_loss", "initial_eval_loss", "workers", "replicas", "stages")}


def _rows(cfg: TrainConfig) -> list[dict]:
    return read_rows(Path(cfg.out) / "metrics.jsonl")


def _summary(cfg: TrainConfig) -> dict:
    return json.loads((Path(cfg.out) / "summary.json").read_text())


# ------------------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize("kw, message", [
    (dict(workers=4, stages=3, n_layer=4), "stages must divide workers"),
    (dict(workers=4, stages=4, n_layer=2), "stages must be <= n_layer=2"),
    (dict(workers=4, stages=2, batch_size=6, microbatches=4), "microbatches must divide batch_size=6"),
    (dict(workers=4, stages=2, batch_size=8, microbatches=1), "microbatches must be >= stages=2"),
    (dict(workers=4, stages=2, baseline="ddp"), "cannot be combined with stages=2"),
    (dict(stages=0), "stages must be an int >= 1"),
    (dict(stages=2, microbatches=0), "microbatches must be an int >= 1"),
])
def test_bad_stages_and_microbatches_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw).validate()


def test_one_stage_ignores_microbatches_as_before():
    # --microbatches only matters with --stages > 1: every one-stage configuration valid before still is
    TrainConfig(stages=1, batch_size=6, microbatches=4).validate()
    assert TrainConfig().stages == 1 and TrainConfig().replicas == TrainConfig().workers


@pytest.mark.parametrize("argv, option", [
    (["--workers", "4", "--stages", "3"], "--stages must divide workers"),
    (["--workers", "8", "--stages", "8", "--n-layer", "4"], "--stages must be <= --n-layer 4"),
    (["--workers", "4", "--stages", "2", "--batch-size", "6"], "--microbatches must divide --batch-size 6"),
    (["--stages", "0"], "--stages must be an int >= 1, got 0"),
])
def test_the_command_refuses_bad_stages_in_one_line(argv, option, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["pretrain", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and option in err, err
    assert err.count("\n") == 1 and err.startswith("fgdiloco pretrain: error: --")
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()  # nothing started, nothing made


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.slow
def test_two_replicas_of_two_stages_train_and_report_the_pipeline(tmp_path):
    cfg = tiny(tmp_path, "2x2")
    results = run_ranks(_worker, 4, tmp_path, cfg, timeout=240)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["workers"] == 4 and r["replicas"] == 2 and r["stages"] == 2 for r in results)
    rows, s = _rows(cfg), _summary(cfg)
    assert [r["step"] for r in rows] == [0, 20, 40, 60] and rows[-1]["tokens"] == 60 * B * T * 2  # 2 replicas
    for r in rows:
        assert set(r) <= set(ROW_FIELDS), set(r) - set(ROW_FIELDS)
    assert set(s["fields"]) <= set(s) and s["fields"] == SUMMARY_FIELDS
    # the rows' loss is replica 0's, read from its last stage (rank 1): the summary of rank 0 says the same
    assert results[0]["final_eval_loss"] == pytest.approx(rows[-1]["eval_loss"])
    assert all(r["train_loss"] is not None and r["train_loss"] > 0 for r in rows[1:])
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5 and s["final_eval_loss"] < s["unigram_loss"]
    assert s["replicas"] == 2 and s["stages"] == 2 and s["workers"] == 4
    # every training step, stage 0 sends the batch's activations [B, T, D] fp32 forward and stage 1 their
    # gradients back: B * T * D * 4 bytes per worker per step, evaluation not counted
    assert s["activation_bytes_sent"] == 60 * B * T * D * 4
    assert 0 < s["pipeline_bubble"] < 1
    assert s["bytes_sent_per_worker"] > 0 and s["failed_exchanges"] == 0  # gossip ran between the replicas
    again = summarise(json.loads((Path(cfg.out) / "run.json").read_text()), rows)  # what an interrupted run gets
    for key in ("replicas", "stages", "activation_bytes_sent", "pipeline_bubble", "final_eval_loss"):
        assert again[key] == pytest.approx(s[key]), key


@pytest.mark.slow
def test_allreduce_keeps_the_replicas_identical_and_starts_where_the_unsplit_model_does(tmp_path):
    split = tiny(tmp_path, "split", topology="allreduce", steps=40)
    run_ranks(_worker, 4, tmp_path, split, timeout=240)
    whole = tiny(tmp_path, "whole", topology="allreduce", steps=40, workers=2, stages=1)
    run_ranks(_worker, 2, tmp_path, whole, timeout=240)
    rows, ref = _rows(split), _rows(whole)
    # DiLoCo: after every outer round both replicas hold the same parameters; with 2 replicas the mean of their
    # held-out losses equals replica 0's only if replica 1's is the same
    for r in rows:
        assert r["eval_loss_mean"] == pytest.approx(r["eval_loss"], rel=1e-6, abs=1e-6), r["round"]
    # the same seeded model and held-out set: the pipeline's loss before training is the unsplit model's
    assert rows[0]["eval_loss"] == pytest.approx(ref[0]["eval_loss"], abs=1e-5)
    # replica r draws the batches of worker r of the one-stage run
    assert [batch_seed(split, r) for r in range(2)] == [batch_seed(whole, r) for r in range(2)]
    # ... but the trajectories part: GPT.split unties the embedding and the head (they train as two matrices),
    # so only the start is the same; both learn
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.5 and ref[-1]["eval_loss"] < ref[0]["eval_loss"] - 0.5


@pytest.mark.slow
def test_the_command_runs_two_replicas_of_two_stages(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = tmp_path / "out"
    argv = ["pretrain", "--workers", "4", "--stages", "2", "--microbatches", "4", "--n-layer", "2", "--n-head", "2",
            "--n-embd", str(D), "--batch-size", str(B), "--block-size", str(T), "--tokenizer", "bytes",
            "--eval-batches", "2", "--steps", "60", "--sync-every", "20", "--lr", "1e-2", "--warmup-steps", "5",
            "--data", str(FIXTURE), "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "fgdiloco", *argv], capture_output=True, text=True, timeout=400,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 replicas x 2 stages" in proc.stdout and "activations sent" in proc.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["final_eval_loss"] < s["initial_eval_loss"] and s["final_eval_loss"] < s["unigram_loss"]
    assert s["replicas"] == 2 and s["stages"] == 2 and s["activation_bytes_sent"] == 60 * B * T * D * 4


# ------------------------------------------------------------------------------------------------ subspace
def test_subspace_rank_is_checked():
    with pytest.raises(ValueError, match=r"subspace_rank must be None or an integer in \[1, n_embd=32\]"):
        TrainConfig(n_embd=32, n_head=2, subspace_rank=33).validate()
    TrainConfig(n_embd=32, n_head=2, subspace_rank=32).validate()


@pytest.mark.slow
def test_subspace_stages_send_k_numbers_per_token_and_train(tmp_path):
    k = 16
    cfg = tiny(tmp_path, "subspace", subspace_rank=k)
    run_ranks(_worker, 4, tmp_path, cfg, timeout=240)
    s = _summary(cfg)
    assert s["config"]["subspace_rank"] == k and s["stages"] == 2
    # the boundary carries the stream's k subspace coefficients (fp32) each way: half of the plain model's bytes
    assert s["activation_bytes_sent"] == 60 * B * T * k * 4
    # built for its 2 stages: block 0 writes through U, block 1 (the last stage's) freely; each stage re-embeds the
    # token ids with its own embedding (the job's default), which never crosses the boundary
    from fgdiloco.pretrain.model import GPT, GPTConfig

    assert s["config"]["stage_embeddings"] is True
    gcfg = GPTConfig(vocab_size=256, block_size=T, n_layer=2, n_head=2, n_embd=D)
    want = GPT(gcfg, subspace_rank=k, subspace_stages=2, stage_embeddings=True).num_parameters(non_embedding=False)
    assert s["params"] == want != GPT(gcfg, subspace_rank=k).num_parameters(non_embedding=False)
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5 and s["final_eval_loss"] < s["unigram_loss"]
