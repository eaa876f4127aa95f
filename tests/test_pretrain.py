"""The pretraining job: data pipeline, model, the per-rank worker on real Gloo ranks, the CLI and the launcher."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fgdiloco.cli import main
from fgdiloco.config import FGDiLoCoConfig
from fgdiloco.pretrain import data as pdata
from fgdiloco.pretrain.config import DEPARTURES, TrainConfig
from fgdiloco.pretrain.data import (
    BPETokenizer,
    build_tokenizer,
    cache_dir_for,
    encode_corpus,
    load_text,
    sample_batch,
    split_tokens,
    unigram_loss,
)
from fgdiloco.pretrain.launcher import (
    PreflightError,
    choose_output,
    clear_outputs,
    estimate_worker_bytes,
    finish_interrupted,
)
from fgdiloco.pretrain.model import GPT, GPTConfig
from fgdiloco.pretrain.recipe import lr_at
from fgdiloco.pretrain.results import ROW_FIELDS, SUMMARY_FIELDS, format_round, read_rows, summarise
from fgdiloco.pretrain.worker import train_worker
from fgdiloco.testing import run_ranks

FIXTURE = Path(__file__).parent / "fixtures" / "moby_dick_ch1-29.txt"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def text() -> str:
    return FIXTURE.read_text(encoding="utf-8")


def tiny_config(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(workers=2, steps=30, sync_every=10, n_layer=1, n_head=2, n_embd=32, batch_size=8, block_size=32,
                vocab_size=384, lr=1e-2, warmup_steps=5, eval_batches=2, data=str(FIXTURE),
                cache_dir=str(tmp_path / "cache"), out=str(tmp_path / "out"), quiet=True, timeout=30.0)
    base.update(kw)
    return TrainConfig(**base)


# ------------------------------------------------------------------------------------------------ data
def test_bpe_round_trips_and_caches(tmp_path, text, monkeypatch):
    sample = text[:5000] + "\nnaïve café — ünïcode ✓ 東京\ttabs  and   spaces\n"
    tok = build_tokenizer(text, "bpe", vocab_size=512, cache_dir=tmp_path)
    assert tok.vocab_size == 512
    ids = tok.encode(sample)
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == sample
    assert len(ids) < len(sample.encode("utf-8")) / 2  # merges were learnt
    cached = list(tmp_path.glob("bpe-512-*.tokenizer.json"))
    assert len(cached) == 1 and not list(tmp_path.glob("*.tmp"))

    def no_training(*a, **k):
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(BPETokenizer, "train", classmethod(no_training))
    again = build_tokenizer(text, "bpe", vocab_size=512, cache_dir=tmp_path)
    assert again.encode(sample) == ids
    with pytest.raises(AssertionError):  # another vocab size or text is another cache entry
        build_tokenizer(text, "bpe", vocab_size=300, cache_dir=tmp_path)

    tokens = encode_corpus(text, tok, cache_dir=tmp_path)
    assert tokens.dtype == torch.long and tokens.numel() > 1000
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 1
    assert torch.equal(encode_corpus(text, again, cache_dir=tmp_path), tokens)
    assert tok.decode(tokens[:200].tolist()) == text[: len(tok.decode(tokens[:200].tolist()))]


def test_byte_tokenizer_and_bad_arguments(text):
    tok = build_tokenizer(text, "bytes")
    s = "héllo ✓"
    assert tok.vocab_size == 256 and tok.encode(s) == list(s.encode("utf-8")) and tok.decode(tok.encode(s)) == s
    assert torch.equal(encode_corpus(s, tok), torch.tensor(list(s.encode("utf-8"))))
    with pytest.raises(ValueError, match="kind"):
        build_tokenizer(text, "words")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(text, "bpe", vocab_size=100)


def test_load_text(tmp_path):
    bundled = load_text(None)
    assert len(bundled) > 1_000_000 and "Ishmael" in bundled
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "b.txt").write_text("second", encoding="utf-8")
    (folder / "a.txt").write_text("first\n", encoding="utf-8")
    (folder / "notes.md").write_text("ignored", encoding="utf-8")
    assert load_text(folder) == "first\nsecond\n"  # files joined, each ending in a newline
    assert load_text(str(folder / "b.txt")) == "second"
    with pytest.raises(FileNotFoundError, match="not found"):
        load_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no .txt files"):
        load_text(empty)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_text(tmp_path / "bin.txt")
    # the cache goes beside writable data, or where asked
    assert cache_dir_for(folder) == folder / ".fgdiloco-cache"
    assert cache_dir_for(folder, tmp_path / "elsewhere") == tmp_path / "elsewhere"


def test_unigram_loss_is_a_sensible_baseline(text):
    tok = build_tokenizer(text, "bytes")
    train, val = split_tokens(encode_corpus(text, tok), 0.1)
    u = unigram_loss(train, val, 256)
    assert 0 < u < math.log(256)
    assert 2.5 < u < 3.8  # English letters: about 4.1-4.5 bits per byte
    # a uniform distribution gives exactly log(V)
    assert unigram_loss(torch.arange(10), torch.arange(10), 10) == pytest.approx(math.log(10))


def test_split_and_sample():
    tokens = torch.arange(1000)
    train, val = split_tokens(tokens, 0.1)
    assert torch.equal(train, tokens[:900]) and torch.equal(val, tokens[900:])
    g = torch.Generator().manual_seed(0)
    x, y = sample_batch(train, 4, 16, g)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, 0], x[:, 0] + 1)
    assert int(y.max()) < 900
    x2, _ = sample_batch(train, 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="too few"):
        sample_batch(torch.arange(10), 2, 10)
    with pytest.raises(ValueError, match="val_fraction"):
        split_tokens(tokens, 1.5)


# ------------------------------------------------------------------------------------------------ model
def test_gpt_shapes_tying_and_init():
    cfg = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16)
    m = GPT(cfg)
    assert m.lm_head.weight is m.transformer.wte.weight
    idx = torch.randint(0, 50, (3, 8))
    logits, loss = m(idx)
    assert logits.shape == (3, 8, 50) and loss is None
    _, loss = m(idx, idx)
    assert abs(loss.item() - math.log(50)) < 0.3  # small init: close to uniform
    # causal: the first position's logits ignore later tokens
    idx2 = idx.clone()
    idx2[:, 1:] = (idx2[:, 1:] + 1) % 50
    assert torch.allclose(m(idx)[0][:, 0], m(idx2)[0][:, 0], atol=1e-5)
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=50, n_embd=30, n_head=4)


def test_tiny_gpt_overfits_one_batch():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    first = None
    for _ in range(150):
        _, loss = m(x, y)
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert first > 3.5 and loss.item() < 0.3


# ------------------------------------------------------------------------------------------------ the worker
def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0) and lr_at(cfg, 100) == pytest.approx(0.1)
    assert all(lr_at(cfg, s) >= lr_at(cfg, s + 1) for s in range(10, 100))


def _run_worker(rank: int, world: int, cfg: TrainConfig) -> dict:
    s = train_worker(cfg)
    return {k: s[k] for k in ("rank", "final_eval_loss", "initial_eval_loss", "workers")}


def test_train_worker_on_two_ranks(tmp_path):
    cfg = tiny_config(tmp_path)
    results = run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    assert [r["rank"] for r in results] == [0, 1] and results[0]["workers"] == 2
    out = Path(cfg.out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 10, 20, 30] and [r["round"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["tokens"] == 30 * 8 * 32 * 2
    for r in rows[1:]:
        assert 0 < r["utilisation"] <= 1 and r["bytes_sent"] > 0 and r["failed_exchanges"] == 0
        assert r["train_loss"] is not None and r["consensus_distance"] is not None
    summary = json.loads((out / "summary.json").read_text())
    for key in ("initial_eval_loss", "final_eval_loss", "unigram_loss", "tokens", "wall_seconds", "utilisation",
                "bytes_sent_per_worker", "config", "fields"):
        assert key in summary
    assert summary["config"]["workers"] == 2 and summary["method"] == "fgdiloco"
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert summary["bytes_sent_per_worker"] == pytest.approx(sum(r["bytes_sent_mean"] for r in rows[1:]))
    assert summary["bytes_sent_all_workers"] == pytest.approx(2 * summary["bytes_sent_per_worker"])
    assert summary["interrupted"] is False and summary["rounds"] == summary["rounds_planned"] == 3
    assert 100 * 2**20 < summary["peak_rss_bytes"] < 4 * 2**30
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "cache").glob("*.tokenizer.json"))  # only rank 0 built and cached it


def test_train_worker_ddp_baseline(tmp_path):
    cfg = tiny_config(tmp_path, baseline="ddp", steps=20)
    results = run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    # DDP keeps the replicas identical
    assert results[0]["final_eval_loss"] == pytest.approx(results[1]["final_eval_loss"], abs=1e-6)
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["method"] == "ddp" and summary["bytes_sent_per_worker"] > 0
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    # the summary's utilisation is the rows' (the same measure in every output): mean over rounds and workers
    assert 0 < summary["utilisation"] <= 1
    assert summary["utilisation"] == pytest.approx(sum(r["utilisation_mean"] for r in rows[1:]) / (len(rows) - 1))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_train_worker_local_sgd_baseline(tmp_path):
    cfg = tiny_config(tmp_path, baseline="localsgd", steps=20)
    results = run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    # the parameters are averaged after every round: the replicas end identical
    assert results[0]["final_eval_loss"] == pytest.approx(results[1]["final_eval_loss"], abs=1e-6)
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    rows = read_rows(Path(cfg.out) / "metrics.jsonl")
    assert summary["method"] == "localsgd" and [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["bytes_sent"] > 0 and 0 < r["utilisation"] <= 1 for r in rows[1:])
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_train_worker_lowrank_partial_last_round_and_sparse_evals(tmp_path):
    cfg = tiny_config(tmp_path, codec="lowrank", codec_rank=2, steps=25, sync_every=10, eval_every=2)
    run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["round"]) for r in rows] == [(0, 0), (20, 2), (25, 3)]  # the last round is short
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["config"]["codec"] == "lowrank" and summary["failed_exchanges"] == 0
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_train_worker_with_fragments_counts_a_round_every_h_over_f_steps(tmp_path):
    """With fragments every fragment's sync is an outer round: the rows' steps and tokens are round x H / F (the
    WAN benchmark's first grid run labelled them round x H, doubling the tokens of its fragment runs)."""
    cfg = tiny_config(tmp_path, fragments=2, steps=20, sync_every=10, eval_deferred=True)
    assert (cfg.round_steps, cfg.rounds) == (5, 4)
    run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    rows = read_rows(Path(cfg.out) / "metrics.jsonl")
    assert [(r["step"], r["round"]) for r in rows] == [(0, 0), (5, 1), (10, 2), (15, 3), (20, 4)]
    assert rows[-1]["tokens"] == 20 * 8 * 32 * 2
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["rounds"] == summary["rounds_planned"] == 4 and summary["steps"] == 20
    # the job's clock is the slower rank's; the summary's clocks stop when training does (the deferred
    # evaluation after it is in neither; it used to be subtracted from train_seconds)
    assert all(r["train_seconds_slowest"] >= r["train_seconds"] for r in rows)
    assert rows[-1]["train_seconds"] <= summary["train_seconds"] <= summary["wall_seconds"]
    assert math.isclose(summary["eval_seconds"], summary["wall_seconds"] - summary["train_seconds"])


def test_train_worker_single_process_without_torch_distributed(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    cfg = tiny_config(tmp_path, workers=1, steps=10, sync_every=5, tokenizer="bytes")
    threads = torch.get_num_threads()
    try:
        summary = train_worker(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["workers"] == 1 and summary["vocab_size"] == 256 and summary["bytes_sent_per_worker"] == 0
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert not torch.distributed.is_initialized()


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="sync_every"):
        TrainConfig(sync_every=0).validate()
    with pytest.raises(ValueError, match="topology"):
        TrainConfig(topology="star").validate()
    with pytest.raises(ValueError, match="codec"):
        TrainConfig(codec="gzip").validate()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TrainConfig(data=str(tmp_path / "nope.txt")).validate()
    assert TrainConfig().validate().rounds == TrainConfig().steps // TrainConfig().sync_every


# ------------------------------------------------------------------------------------------------ results
def test_summary_fields_are_described_and_rows_count_rounds_from_one(tmp_path):
    cfg = tiny_config(tmp_path, steps=20, sync_every=10)
    run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    out = Path(cfg.out)
    rows = read_rows(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]  # rounds done: 1-based, 0 = before training
    for r in rows:
        assert set(r) <= set(ROW_FIELDS), set(r) - set(ROW_FIELDS)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["fields"]) <= set(summary) and summary["fields"] == SUMMARY_FIELDS
    info = json.loads((out / "run.json").read_text())
    assert info["run_id"] == summary["run_id"] and info["rounds_planned"] == 2
    # the summary of the rows alone (what an interrupted run gets) agrees with the worker's on every total
    again = summarise(info, rows)
    for key in ("rounds", "steps", "tokens", "final_eval_loss", "bytes_sent_per_worker", "utilisation",
                "failed_exchanges", "initial_eval_loss"):
        assert again[key] == pytest.approx(summary[key]), key
    line = format_round(rows[1], 2, 20)
    assert line.startswith("round 1/2  step 10/20  eval ") and "tok/s" in line and "ETA" in line
    assert "/worker" in line and "util " in line and "peer dist " in line


def test_a_reused_folder_never_mixes_two_runs(tmp_path):
    cfg = tiny_config(tmp_path, steps=10, sync_every=10)
    out = Path(cfg.out)
    out.mkdir(parents=True)
    (out / "summary.json").write_text('{"run_id": "an earlier run"}')
    (out / "loss.png").write_bytes(b"old")
    (out / "metrics.jsonl").write_text('{"round": 99}\n' * 5)
    run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    rows = read_rows(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1]
    assert json.loads((out / "summary.json").read_text())["run_id"] != "an earlier run"
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_read_rows_skips_a_line_cut_short(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"round": 0}\n{"round": 1}\n{"round": 2, "ev')
    assert read_rows(p) == [{"round": 0}, {"round": 1}]
    assert read_rows(tmp_path / "missing.jsonl") == []


@pytest.mark.slow
def test_finish_interrupted_summarises_the_rounds_done_and_keeps_a_complete_summary(tmp_path):
    cfg = tiny_config(tmp_path, steps=30, sync_every=10)
    run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    out = Path(cfg.out)
    complete = json.loads((out / "summary.json").read_text())
    assert finish_interrupted(out) == complete  # finished before the signal: kept as it is
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:17])  # killed mid-line
    (out / "summary.json").unlink()
    (out / "loss.png").unlink()
    s = finish_interrupted(out)
    assert s["interrupted"] is True and s["rounds"] == 1 and s["rounds_planned"] == 3 and s["steps"] == 10
    assert s["tokens"] == 10 * 8 * 32 * 2 and s["final_eval_loss"] == json.loads(lines[1])["eval_loss"]
    assert json.loads((out / "summary.json").read_text()) == s
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert finish_interrupted(tmp_path / "never-started") is None


# ------------------------------------------------------------------------------------------------ defaults
@pytest.mark.slow
def test_defaults_are_the_librarys_or_their_difference_is_shown_in_help():
    from fgdiloco import FGDiLoCoConfig
    from fgdiloco.factor import LowRank

    d, lib = TrainConfig(), FGDiLoCoConfig()
    # every FGDiLoCoConfig setting is a TrainConfig field of the same name, with the library's default or a reason
    differ = sorted(name for name in FGDiLoCoConfig.names() if getattr(d, name) != getattr(lib, name))
    assert differ == sorted(DEPARTURES) == ["outer_momentum", "sync_every"]
    assert all(DEPARTURES[n].default == getattr(d, n) for n in DEPARTURES)
    assert d.fgdiloco_config() == lib.replace(sync_every=20, outer_momentum=0.3)
    assert d.error_feedback == inspect.signature(LowRank).parameters["error_feedback"].default
    proc = subprocess.run([sys.executable, "-m", "fgdiloco", "pretrain", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env=dict(os.environ, COLUMNS="200"))
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert f"--codec-rank CODEC_RANK, --rank CODEC_RANK rank of a low-rank Mix2 codec given by name (default: the " \
           f"codec's own); the lowrank codec's own is {LowRank().rank}; --rank is its older name" in text
    assert f"differs from FGDiLoCo's default {lib.outer_momentum}" in text and "(default: 0.3)" in text
    assert f"differs from FGDiLoCo's default {lib.sync_every}" in text and "(default: 20)" in text
    assert f"this run uses the {lib.codec!r} codec" in text  # what the run uses, printed from the config
    assert "--no-error-feedback" in text and "Only the exact path (--topology allreduce) keeps a residual" in text
    for flag in ("--workers", "--steps", "--sync-every", "--topology", "--mix1-rounds", "--mix2-rounds", "--codec",
                 "--data", "--out", "--overwrite", "--quiet", "--baseline", "--seed", "--timeout", "--resume"):
        assert flag in proc.stdout
    for name in FGDiLoCoConfig.names():  # a new setting is a flag with no change to the command
        assert "--" + name.replace("_", "-") + " " in proc.stdout, name
    assert "(default: 4)" in text and "(default: 240)" in text and "(default: random)" in text


def test_every_setting_is_a_flag_and_a_field_and_comes_back_from_the_command_line():
    import argparse

    from fgdiloco import FGDiLoCoConfig
    from fgdiloco.pretrain.config import add_train_arguments

    p = argparse.ArgumentParser(allow_abbrev=False)
    add_train_arguments(p)
    dests = {a.dest for a in p._actions}
    assert set(FGDiLoCoConfig.names()) <= dests and set(FGDiLoCoConfig.names()) <= set(TrainConfig.names())
    args = p.parse_args(["--join-timeout", "7", "--exchange-timeout", "8", "--liveness", "2", "--collective-timeout",
                         "9", "--stage-timeout", "10", "--rank", "3", "--codec", "lowrank", "--no-error-feedback",
                         "--mix-momentum", "false"])
    cfg = TrainConfig.from_arguments(args)
    assert (cfg.join_timeout, cfg.exchange_timeout, cfg.liveness, cfg.collective_timeout, cfg.stage_timeout) == (
        7, 8, 2, 9, 10)
    fg = cfg.fgdiloco_config()
    assert fg.mix_momentum is False and fg.codec.rank == 3 and fg.codec.error_feedback is False
    # --timeout sets the four deadlines not given; liveness is its own
    cfg = TrainConfig.from_arguments(p.parse_args(["--timeout", "30", "--join-timeout", "5"]))
    assert (cfg.join_timeout, cfg.exchange_timeout, cfg.collective_timeout, cfg.stage_timeout, cfg.liveness) == (
        5, 30, 30, 30, FGDiLoCoConfig.liveness)


def test_a_saved_configuration_comes_back_also_from_an_older_run():
    cfg = TrainConfig(workers=3, codec="lowrank", codec_rank=2, timeout=30.0)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg
    # an older run's flat config.json: "rank" for the codec's rank, one "timeout" for every deadline
    old = {"workers": 2, "steps": 24, "sync_every": 4, "codec": "lowrank", "rank": 2, "error_feedback": True,
           "timeout": 30.0, "topology": "ring", "outer_momentum": 0.3}
    cfg = TrainConfig.from_dict(old)
    assert cfg.codec_rank == 2 and cfg.join_timeout == cfg.stage_timeout == 30.0
    assert cfg.liveness == FGDiLoCoConfig.liveness
    with pytest.raises(TypeError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"no_such_field": 1})
    assert TrainConfig.from_dict({"no_such_field": 1, "steps": 3}, strict=False).steps == 3


def test_the_bundled_corpus_is_cached_in_the_user_cache_folder_not_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir_for(None) == tmp_path / "xdg" / "fgdiloco" == pdata.user_cache_dir()
    assert cache_dir_for(pdata.bundled_corpus_dir() / "moby_dick.txt") == tmp_path / "xdg" / "fgdiloco"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir_for(None) == Path.home() / ".cache" / "fgdiloco"


# ------------------------------------------------------------------------------------------------ the command
def _fgdiloco(*argv: str, cwd: Path, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "fgdiloco", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd, **kw)


TINY = ("--workers", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--batch-size", "4",
        "--block-size", "32", "--vocab-size", "300", "--eval-batches", "1", "--data", str(FIXTURE))


def test_cli_argument_errors_exit_2_in_one_line_naming_the_option(capsys):
    for argv, message in ((["pretrain", "--codec", "gzip"], "argument --codec: invalid choice"),
                          (["pretrain", "--workers", "two"], "argument --workers: expected an int >= 1, got 'two'"),
                          (["pretrain", "--bogus"], "unrecognized arguments: --bogus"),
                          # no prefix matching: --worker is not --workers
                          (["pretrain", "--worker", "4"], "unrecognized arguments: --worker 4; did you mean "
                                                          "--workers?")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("fgdiloco pretrain: error: ") and message in err and err.count("\n") == 1, err
    for argv, message in ((["pretrain", "--data", "/nonexistent/text.txt"], "--data '/nonexistent/text.txt' does"),
                          (["pretrain", "--n-embd", "30", "--n-head", "4"], "divisible"),
                          (["pretrain", "--steps", "0"], "--steps must be an int >= 1, got 0"),
                          (["pretrain", "--workers", "0"], "--workers must be an int >= 1, got 0"),
                          (["pretrain", "--join-timeout", "0"], "--join-timeout must be seconds > 0"),
                          (["pretrain", "--outer-momentum", "1.5"],
                           "--outer-momentum must be a number in [0, 1), got 1.5")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("fgdiloco pretrain: error: ") and message in err and err.count("\n") == 1, err
    assert main([]) == 2  # no subcommand: help


@pytest.mark.slow
def test_pretrain_and_simulate_without_the_extra_say_how_to_install_it_in_one_line():
    code = ("import sys\n"
            "sys.modules['rich'] = None\n"
            "from fgdiloco.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for command in ("pretrain", "simulate"):
        proc = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=120,
                              env=env, cwd=ROOT)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"fgdiloco {command}: error: ") and "pip install 'fgdiloco[pretrain]'" in (
            proc.stderr)


def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes through permission bits: sysfs refuses new entries even to root
        return Path("/sys/fgdiloco-test-out")
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    return ro / "out"


@pytest.mark.slow
def test_bad_input_is_refused_in_one_line_naming_the_option_before_any_worker_starts(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("A hundred bytes of text are far too few tokens for one window of 129 tokens. " * 1)
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "summary.json").write_text("{}")
    cases = [
        (["--data", str(short)], "--data", "tokens"),
        (["--data", str(binary)], "--data", "is not UTF-8 text"),
        (["--out", str(_unwritable(tmp_path))], "--out", "is not writable"),
        (["--out", str(earlier)], "--out", "holds another run's results (summary.json); pass --overwrite"),
        (["--out", str(earlier), "--overwrite", "--data", str(binary)], "--data", "is not UTF-8 text"),
        (["--workers", "100000"], "--workers", "GiB of memory"),
        (["--block-size", "100000"], "--workers", "not even one worker fits: use a smaller model (--n-layer"),
        (["--fragments", "3"], "--fragments", "3 must divide --sync-every 20"),
        (["--n-head", "3"], "--n-embd", "(128) must be divisible by --n-head (3)"),
        (["--codec", "dense", "--codec-rank", "8"], "--codec-rank", "8 applies to a codec that takes a rank "
                                                                    "(lowrank); --codec 'dense' has none"),
        (["--mix1-codec", "lowrank"], "--mix1-codec", "'lowrank' keeps per-worker state"),
    ]
    for i, (extra, option, message) in enumerate(cases):
        out = tmp_path / f"out-{option.strip('-')}"
        argv = ["pretrain", "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--quiet", *extra]
        if i == 0:  # as a user meets it: the process's exit status and its whole stderr
            t0 = time.monotonic()
            proc = _fgdiloco(*argv, cwd=tmp_path, timeout=120)
            assert time.monotonic() - t0 < 60  # a few seconds on a quiet machine (mostly importing torch)
            status, err = proc.returncode, proc.stderr
        else:  # the same check in this process (a new one would import torch again, 3-5 s each)
            status, err = main(argv), capsys.readouterr().err
        assert status == 2, (extra, err)
        assert err.count("\n") == 1 and err.startswith(f"fgdiloco pretrain: error: {option} "), err
        assert message in err, err
        assert not (out / "logs").exists() and not (out / "run.json").exists()  # no worker was started
        assert not (earlier / "logs").exists()
    assert (earlier / "summary.json").read_text() == "{}"


@pytest.mark.parametrize("extra, option, why", [
    (["--baseline", "ddp", "--topology", "ring"], "--topology", "the ddp baseline does not run FG-DiLoCo"),
    (["--baseline", "localsgd", "--timeout", "9"], "--timeout", "the localsgd baseline does not run FG-DiLoCo"),
    (["--baseline", "ddp", "--max-restarts", "1"], "--max-restarts", "only elastic runs"),
    (["--topology", "allreduce", "--checkpoint-every", "2"], "--checkpoint-every", "only elastic runs"),
    (["--no-error-feedback"], "--no-error-feedback", "only the lowrank codec on the exact topology"),
    (["--topology", "allreduce", "--codec", "int8", "--no-error-feedback"], "--no-error-feedback", "lowrank"),
    (["--no-stage-embeddings", "--stages", "2"], "--no-stage-embeddings", "only with --subspace-rank and --stages"),
    (["--no-stage-embeddings", "--subspace-rank", "8"], "--no-stage-embeddings", "--stages > 1"),
    (["--microbatches", "2"], "--microbatches", "pipeline stages"),
    (["--tokenizer", "bytes", "--vocab-size", "4096"], "--vocab-size", "256 symbols"),
    (["--resume", "--overwrite"], "--resume", "--overwrite would replace it"),
])
def test_an_option_that_would_have_no_effect_is_refused(extra, option, why, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["pretrain", "--out", str(out), "--quiet", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fgdiloco pretrain: error: {option} "), err
    assert why in err, err
    assert not out.exists()


def test_options_that_act_are_not_called_unused():
    for kw in ({}, {"baseline": "localsgd", "sync_every": 10, "seed": 3},
               {"topology": "allreduce", "codec": "lowrank", "error_feedback": False},
               {"stages": 2, "subspace_rank": 8, "stage_embeddings": False, "microbatches": 2},
               {"tokenizer": "bytes"}, {"timeout": 9.0, "join_timeout": 3.0}):
        assert TrainConfig(**kw).unused() == [], kw
    # the timeout shorthand's deadlines count as --timeout, a deadline given by name as itself
    assert {n for n, _ in TrainConfig(baseline="ddp", timeout=9.0, join_timeout=3.0).unused()} == {
        "join_timeout", "timeout"}


@pytest.mark.slow
def test_launch_through_the_cli_and_a_second_run_gets_its_own_folder(tmp_path):
    cache = str(tmp_path / "cache")
    first = _fgdiloco("pretrain", *TINY, "--steps", "6", "--sync-every", "3", "--cache-dir", cache, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    out = tmp_path / "runs" / "pretrain"
    assert "[fgdiloco] round 1/2  step 3/6  eval " in first.stdout and "ETA" in first.stdout
    assert "round 2/2" in first.stdout and "done" in first.stdout and "nats/token" in first.stdout
    assert "training a byte-level BPE tokenizer (vocabulary 300)" in first.stdout  # nothing cached yet
    outputs = next(line for line in first.stdout.splitlines() if line.strip().startswith("outputs"))
    for name in ("summary.json", "metrics.jsonl", "loss.png", "run.json", "config.json", "logs/", "workers/",
                 "checkpoints/"):
        assert name in outputs, outputs
    from fgdiloco.pretrain.launcher import usable_cores

    assert ("2 workers share" in first.stderr) == (usable_cores() < 2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["rounds"] == 2 and summary["tokens"] == 6 * 4 * 32 * 2
    assert (out / "metrics.jsonl").exists() and (out / "loss.png").exists() and (out / "logs").is_dir()
    rows = read_rows(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]  # the same numbers as the printed lines
    # the estimate that guards --workers is not below what a worker really used
    cfg = TrainConfig(**{k: v for k, v in summary["config"].items()})
    assert estimate_worker_bytes(cfg, summary["vocab_size"], summary["train_tokens"] + summary["val_tokens"]) > (
        0.9 * summary["peak_rss_bytes"])

    second = _fgdiloco("pretrain", *TINY, "--steps", "3", "--sync-every", "3", "--cache-dir", cache, "--quiet",
                       cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    fresh = tmp_path / "runs" / "pretrain-2"
    assert f"writing this one to {fresh.relative_to(tmp_path)}" in second.stderr
    assert "round 1/1" not in second.stdout and "done" in second.stdout  # --quiet: no progress lines
    assert json.loads((out / "summary.json").read_text()) == summary  # the first run is untouched
    s2 = json.loads((fresh / "summary.json").read_text())
    assert s2["run_id"] != summary["run_id"] and s2["rounds"] == 1
    assert [r["round"] for r in read_rows(fresh / "metrics.jsonl")] == [0, 1]


def _wait_for_round(path: Path, proc: subprocess.Popen, rnd: int, timeout: float) -> None:
    """Block until ``metrics.jsonl`` has a row of round ``rnd`` (the event the test acts on), the run ends, or
    ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(r["round"] >= rnd for r in read_rows(path)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no round {rnd} in {path} (exit status {proc.poll()})")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_after_round_1_stops_the_workers_and_leaves_an_interrupted_summary(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fgdiloco", "pretrain", *TINY, "--steps", "100000", "--sync-every", "3",
           "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    # its own process group with SIGINT at its default, as a terminal's foreground job (a suite started in the
    # background of a non-interactive shell has SIGINT ignored, and an ignored SIGINT is inherited)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True, preexec_fn=_default_sigint)
    try:
        _wait_for_round(out / "metrics.jsonl", proc, 1, timeout=240)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to every process of the group
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    rows = read_rows(out / "metrics.jsonl")
    assert summary["interrupted"] is True and summary["rounds"] >= 1
    assert summary["rounds"] == rows[-1]["round"] and summary["steps"] == rows[-1]["step"] == 3 * summary["rounds"]
    assert summary["tokens"] == rows[-1]["tokens"] and summary["final_eval_loss"] == rows[-1]["eval_loss"]
    assert summary["rounds_planned"] == -(-100000 // 3) and summary["workers"] == 2
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    line = [x for x in stderr.splitlines() if "interrupted after round" in x]
    assert len(line) == 1 and "summary.json (marked interrupted)" in line[0] and "loss.png" in line[0]
    assert "Traceback" not in stderr and "SignalException" not in stderr
    with pytest.raises(ProcessLookupError):  # no worker outlived the command
        for _ in range(100):
            os.killpg(proc.pid, 0)
            time.sleep(0.1)


def _worker_pids(parent: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                pids.append(int(stat.parent.name))
    return pids


@pytest.mark.slow
def test_when_every_worker_is_killed_for_good_the_failure_is_one_line_with_the_likely_cause(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fgdiloco", "pretrain", *TINY, "--steps", "100000", "--sync-every", "3",
           "--max-restarts", "0", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        _wait_for_round(out / "metrics.jsonl", proc, 1, timeout=240)
        pids = [e["pid"] for k in range(2) for e in read_rows(out / "workers" / f"worker{k}.jsonl")
                if e.get("event") == "start"]
        assert len(pids) == 2, pids
        for pid in pids:  # what the kernel's OOM killer does; no restarts left (--max-restarts 0)
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("[fgdiloco] pretrain failed: worker 0: ")
    assert "killed by the system (SIGKILL), probably out of memory (its log: " in lines[0]
    assert Path(lines[0].rsplit("(its log: ", 1)[1].rstrip(")")) == out / "logs" / "worker0.log"


@pytest.mark.slow
def test_the_root_cause_of_a_failed_job_is_the_raising_or_killed_worker(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from fgdiloco.pretrain.launcher import _root_cause

    rank_dir = tmp_path / "logs" / "run_x" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stderr.log").write_text("Traceback ...\nValueError: the training split is too short\n")
    err_file = rank_dir / "error.json"
    err_file.write_text(json.dumps({"message": {"message": "ValueError: the training split is too short",
                                                "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "5"}}}))
    raised = ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(err_file))
    terminated = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file="<N/A>")
    e = _root_cause(ChildFailedError("w", {0: terminated, 1: raised}), tmp_path / "logs")
    assert (e.rank, e.reason, e.log) == (1, "ValueError: the training split is too short", rank_dir / "stderr.log")
    assert str(e) == f"worker 1: ValueError: the training split is too short (traceback in {rank_dir}/stderr.log)"
    killed = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGKILL, error_file="<N/A>")
    e = _root_cause(ChildFailedError("w", {0: killed, 1: raised}), tmp_path / "logs")
    assert e.rank == 0 and e.reason == "killed by the system (SIGKILL), probably out of memory"


def test_choose_output_numbers_the_default_folder_and_refuses_an_explicit_one(tmp_path):
    base = tmp_path / "runs" / "pretrain"
    assert choose_output(base, explicit=False, overwrite=False) == (base, None)
    base.mkdir(parents=True)
    (base / "unrelated.txt").write_text("x")  # not a run's result: the folder is still free
    assert choose_output(base, explicit=True, overwrite=False) == (base, None)
    (base / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "runs" / "pretrain-2").mkdir()
    (tmp_path / "runs" / "pretrain-2" / "loss.png").write_bytes(b"x")
    path, note = choose_output(base, explicit=False, overwrite=False)
    assert path == tmp_path / "runs" / "pretrain-3" and "writing this one to" in note
    with pytest.raises(PreflightError, match="--out .* holds another run's results .*--overwrite"):
        choose_output(base, explicit=True, overwrite=False)
    (base / "logs").mkdir()
    path, note = choose_output(base, explicit=True, overwrite=True)
    assert path == base and "metrics.jsonl" in note and "logs" in note
    assert (base / "metrics.jsonl").exists()  # nothing removed until the checks passed
    assert clear_outputs(base) == ["metrics.jsonl", "logs"]
    assert sorted(p.name for p in base.iterdir()) == ["unrelated.txt"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(PreflightError, match="is a file; give a folder"):
        choose_output(afile, explicit=True, overwrite=False)


def test_preflight_checks_memory_and_warns_about_cores(tmp_path, monkeypatch):
    from fgdiloco.pretrain import launcher

    cfg = tiny_config(tmp_path, workers=3)
    per = estimate_worker_bytes(cfg, 384, len(FIXTURE.read_bytes()))  # the bound preflight uses
    monkeypatch.setattr(launcher, "usable_cores", lambda: 2)
    monkeypatch.setattr(launcher, "available_memory_bytes", lambda: 3 * per + 2**20)
    found = launcher.preflight(cfg)
    assert found["warnings"] and "3 workers share 2 CPU cores" in found["warnings"][0]
    assert not [w for w in found["warnings"] if "outer round of" in w]
    short = dataclasses.replace(cfg, steps=cfg.sync_every - 1)  # fewer steps than one round: said, not refused
    assert f"the run is one outer round of {short.steps} steps" in launcher.preflight(short)["warnings"][-1]
    # a --codec-rank that factors none of the model's matrices (the largest, 384 x 32, while r < 29.5) is said once
    # here, where the user sees it (each worker's wrapper warns into its log)
    assert not [w for w in found["warnings"] if "--codec-rank" in w]
    high = launcher.preflight(dataclasses.replace(cfg, codec_rank=30))["warnings"][-1]
    assert high.startswith("--codec-rank: at codec rank 30 none of the model's matrices") and "at most 29" in high
    assert not [w for w in launcher.preflight(dataclasses.replace(cfg, codec_rank=29))["warnings"] if "rank" in w]
    # so is an Adam-type outer optimizer with SGD's outer learning rate (it diverged without a word)
    adam = launcher.preflight(dataclasses.replace(cfg, outer_optimizer="adam"))["warnings"]
    assert [w for w in adam if w.startswith("--outer-lr: outer_optimizer='adam' with outer_lr=0.7")], adam
    assert not [w for w in found["warnings"] if "--outer-lr" in w]
    assert found["tokens"] > 100_000 and found["vocab_size"] == 384
    assert found["worker_bytes"] == per
    said: list[str] = []
    launcher.preflight(cfg, status=said.append)  # the tokenizer is cached now: it is loaded, not trained
    assert said == [f"loading the cached byte-level BPE tokenizer (vocabulary 384) from {tmp_path / 'cache'}"]
    monkeypatch.setattr(launcher, "available_memory_bytes", lambda: 2 * per + 2**20)

    def no_training(*a, **k):
        raise AssertionError("the memory check comes before the tokenizer is trained")

    monkeypatch.setattr(BPETokenizer, "train", classmethod(no_training))
    fresh = tiny_config(tmp_path, workers=3, cache_dir=str(tmp_path / "fresh-cache"))
    with pytest.raises(PreflightError, match=r"^--workers 3 need about 3 x \d+ MiB .* use --workers 2 or fewer"):
        launcher.preflight(fresh)


def test_bundled_corpus_is_packaged():
    files = sorted(p.name for p in pdata.bundled_corpus_dir().glob("*.txt"))
    assert files == ["moby_dick.txt", "shakespeare_comedies.txt"]


def test_the_memory_estimate_brackets_the_measured_default_worker():
    # measured here (torch 2.13 CPU): a default worker (4 x 128 GPT, batch 16 x 128, 742 k tokens) peaked at
    # 847 MiB resident at a685d51 (summary.json's peak_rss_bytes); the estimate may be above it, not below, and
    # not far above
    est = estimate_worker_bytes(TrainConfig(), 2048, 742_256) / 2**20
    assert 847 < est < 1.25 * 847


def test_a_closed_output_pipe_is_said_once_on_stderr_and_the_display_goes_on_silently():
    """``fgdiloco pretrain | head``: once the reader has gone, the lines go nowhere and the run trains on (rich's
    own handling raised SystemExit(1) from the launcher's row callback, which stopped the workers)."""
    import io

    from rich.console import Console

    from fgdiloco.cli import _Display

    r, w = os.pipe()
    os.close(r)  # the reader has gone
    err = io.StringIO()
    with open(w, "w") as out:
        d = _Display(False, console=Console(file=out), err=Console(file=err))
        d.say("one")  # raises nothing
        d.say("two")
        d.console.print("the summary")
        out.flush()
    assert d.quiet and err.getvalue().count("the standard output was closed; training on") == 1


def test_the_display_shows_a_bar_on_a_terminal_and_plain_lines_elsewhere():
    import io

    from rich.console import Console

    from fgdiloco.cli import _Display

    row0 = {"round": 0, "step": 0, "tokens": 0, "wall_seconds": 0.0, "train_seconds": 0.0, "eval_loss": 7.63}
    row1 = {"round": 1, "step": 20, "tokens": 163840, "wall_seconds": 60.0, "train_seconds": 55.0,
            "eval_loss": 6.046, "train_loss_mean": 6.883, "utilisation_mean": 0.97, "bytes_sent_mean": 5.0e6,
            "consensus_distance_mean": 0.5}
    for terminal in (True, False):
        buf = io.StringIO()
        d = _Display(False, console=Console(file=buf, force_terminal=terminal, width=200),
                     err=Console(file=io.StringIO()))
        assert d.live is terminal
        with d.status("training a tokenizer") or contextlib.nullcontext():
            pass
        d.start_workers(4, 12, 240)
        d.row(row0)
        d.row(row1)
        if terminal:
            assert d.progress.tasks[0].completed == 1 and d.progress.tasks[0].total == 12
        d.close()
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())  # without the terminal's control codes
        assert "[fgdiloco] round  1/12  step  20/240  eval 6.046  train 6.883  2,979 tok/s  util 97%  sent 5.0 MB/" \
               "worker  peer dist 0.5  1m00s elapsed, ETA 11m00s" in text
        assert ("training a tokenizer ..." in text) is not terminal  # a spinner on a terminal, a line elsewhere
    quiet = io.StringIO()
    d = _Display(True, console=Console(file=quiet), err=Console(file=io.StringIO()))
    assert d.status("x") is None
    d.start_workers(4, 12, 240)
    d.row(row1)
    assert quiet.getvalue() == ""


def test_resume_of_a_finished_run_has_nothing_to_continue(tmp_path):
    """``--resume`` of a run whose summary says it trained every planned round (not interrupted, not stopped by
    --max-seconds) starts nothing; anything else is continued."""
    from fgdiloco.cli import _finished
    from fgdiloco.pretrain.config import TrainConfig

    cfg = TrainConfig(run_id="abc", steps=24, sync_every=3)
    assert _finished(tmp_path, cfg) is None  # no summary: a stopped run
    done = {"run_id": "abc", "interrupted": False, "stopped_early": False, "rounds": 8, "final_eval_loss": 4.5}
    for change, finished in (({}, True), ({"interrupted": True}, False), ({"stopped_early": True}, False),
                             ({"rounds": 5}, False), ({"run_id": "other"}, False)):
        (tmp_path / "summary.json").write_text(json.dumps({**done, **change}))
        said = _finished(tmp_path, cfg)
        assert (said is not None) is finished, change
    (tmp_path / "summary.json").write_text(json.dumps(done))
    assert _finished(tmp_path, cfg) == f"the run in {tmp_path} already finished its 8 rounds (held-out loss 4.500); " \
                                       "nothing to continue"


def test_the_closing_lines_say_a_run_stopped_at_max_seconds_can_go_on(tmp_path):
    from fgdiloco.cli import _summary_text

    s = {"initial_eval_loss": 7.6, "final_eval_loss": 6.1, "final_eval_loss_mean": 6.2, "unigram_loss": 5.3,
         "tokens": 10_000, "train_seconds": 1.5, "tokens_per_second": 6_667.0, "setup_seconds": 2.0,
         "utilisation": 0.9, "bytes_sent_per_worker": 1e6, "bytes_sent_all_workers": 2e6, "failed_exchanges": 0,
         "stopped_early": False, "rounds": 10, "rounds_planned": 10, "steps": 30, "steps_planned": 30}
    assert _summary_text(s, tmp_path, 14.0).splitlines()[0] == "[fgdiloco] done in 14s:"
    early = _summary_text({**s, "stopped_early": True, "rounds": 1, "steps": 3}, tmp_path, 14.0).splitlines()[0]
    assert early == ("[fgdiloco] stopped at --max-seconds after round 1/10 (step 3/30) in 14s; the same command "
                     "with --resume continues it:"), early


def test_a_killed_torchrun_agent_is_not_reported_as_a_worker_lost_to_memory(tmp_path):
    """A worker's torchrun job that ended by SIGKILL with no failure report of its worker in the log is its agent
    killed (the worker may have gone on); a worker killed by SIGKILL is torchrun's report of exitcode -9."""
    from fgdiloco.pretrain.launcher import _failure_reason

    log = tmp_path / "worker0.log"
    log.write_text("[fgdiloco] worker 0 round 12\n")
    assert _failure_reason(log, -9).startswith("its torchrun agent was killed (SIGKILL)")
    log.write_text("  exitcode  : -9 (pid: 123)\n")
    assert _failure_reason(log, 1) == "killed by the system (SIGKILL), probably out of memory"


def test_every_elastic_worker_stops_at_the_round_where_the_first_passed_max_seconds(tmp_path):
    """The first worker past --max-seconds writes the round of its next evaluation point; every worker trains up to
    it (one used to stop a round before its partner, leaving it that round alone and the summary's steps above its
    own), one past it stops at once, and a second worker past the limit does not overwrite the round."""
    from fgdiloco.pretrain.reports import _stop_round

    stop = tmp_path / "stop"
    assert _stop_round(stop, 1, None) is None  # nobody past it
    assert _stop_round(stop, 0, 26) == 26  # worker 0 is first, at round 26
    assert _stop_round(stop, 1, 25) == 26  # worker 1 passes it too at round 25: it still trains round 26
    assert _stop_round(stop, 2, None) == 26
    assert json.loads(stop.read_text()) == {"worker": 0, "round": 26}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stop"]  # no temporary file left
    stop.write_text("{")  # unreadable: stop where we are
    assert _stop_round(stop, 1, None) == -1 and _stop_round(stop, 1, 7) == 7


def test_an_interrupt_before_training_says_how_to_start_again(tmp_path, capsys):
    """Interrupted before any worker wrote run.json: nothing was trained, and the folder (config.json, logs) is
    refused by the same command without --overwrite; the line said "kept only the worker logs"."""
    from fgdiloco.cli import EXIT_INTERRUPTED, _Display, _interrupted

    assert _interrupted(tmp_path, _Display(quiet=True), lambda out: None) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "before training started (nothing was trained)" in err and "add --overwrite" in err, err
