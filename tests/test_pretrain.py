"""The pretraining job: data pipeline, model, the per-rank worker on real Gloo ranks, the CLI and the launcher."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fgdiloco.cli import main
from fgdiloco.pretrain import data as pdata
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
from fgdiloco.pretrain.model import GPT, GPTConfig
from fgdiloco.pretrain.worker import TrainConfig, _lr_at, train_worker
from tests.distributed import run_ranks

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
    assert _lr_at(cfg, 0) == pytest.approx(0.1) and _lr_at(cfg, 9) == pytest.approx(1.0)
    assert _lr_at(cfg, 10) == pytest.approx(1.0) and _lr_at(cfg, 100) == pytest.approx(0.1)
    assert all(_lr_at(cfg, s) >= _lr_at(cfg, s + 1) for s in range(10, 100))


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
                "bytes_sent", "config"):
        assert key in summary
    assert summary["config"]["workers"] == 2 and summary["method"] == "fgdiloco"
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert summary["bytes_sent"] == pytest.approx(sum(r["bytes_sent_mean"] for r in rows[1:]))
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "cache").glob("*.tokenizer.json"))  # only rank 0 built and cached it


def test_train_worker_ddp_baseline(tmp_path):
    cfg = tiny_config(tmp_path, baseline="ddp", steps=20)
    results = run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    # DDP keeps the replicas identical
    assert results[0]["final_eval_loss"] == pytest.approx(results[1]["final_eval_loss"], abs=1e-6)
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["method"] == "ddp" and summary["utilisation"] is None and summary["bytes_sent"] > 0
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_train_worker_lowrank_partial_last_round_and_sparse_evals(tmp_path):
    cfg = tiny_config(tmp_path, codec="lowrank", rank=2, steps=25, sync_every=10, eval_every=2)
    run_ranks(_run_worker, 2, tmp_path, cfg, timeout=90)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["round"]) for r in rows] == [(0, 0), (20, 2), (25, 3)]  # the last round is short
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["config"]["codec"] == "lowrank" and summary["failed_exchanges"] == 0
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


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
    assert summary["workers"] == 1 and summary["vocab_size"] == 256 and summary["bytes_sent"] == 0
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


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_help_and_argument_errors(capsys):
    proc = subprocess.run([sys.executable, "-m", "fgdiloco", "pretrain", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0
    for flag in ("--workers", "--steps", "--sync-every", "--topology", "--mix1-rounds", "--mix2-rounds", "--codec",
                 "--rank", "--data", "--out", "--baseline", "--seed"):
        assert flag in proc.stdout
    for argv, message in ((["pretrain", "--steps", "0"], "--steps"),
                          (["pretrain", "--codec", "gzip"], "invalid choice"),
                          (["pretrain", "--workers", "two"], "--workers"),
                          (["pretrain", "--data", "/nonexistent/text.txt"], "does not exist"),
                          (["pretrain", "--n-embd", "30", "--n-head", "4"], "divisible"),
                          (["pretrain", "--bogus"], "unrecognized")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert main([]) == 2  # no subcommand: help


def test_launch_through_the_cli(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fgdiloco", "pretrain", "--workers", "2", "--steps", "6", "--sync-every", "3",
           "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--batch-size", "4", "--block-size", "32",
           "--vocab-size", "300", "--eval-batches", "1", "--data", str(FIXTURE), "--cache-dir",
           str(tmp_path / "cache"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round   2/2" in proc.stdout and "done" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["rounds"] == 2 and summary["tokens"] == 6 * 4 * 32 * 2
    assert (out / "metrics.jsonl").exists() and (out / "loss.png").exists()


def test_bundled_corpus_is_packaged():
    files = sorted(p.name for p in pdata.bundled_corpus_dir().glob("*.txt"))
    assert files == ["moby_dick.txt", "shakespeare_comedies.txt"]


def test_cli_rejects_unreadable_data_and_a_file_as_out_before_starting_workers(tmp_path, capsys):
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"\x00\x01\xff\xfe")
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, expected in ((["pretrain", "--data", str(binary)], "is not UTF-8 text"),
                           (["pretrain", "--out", str(afile)], "is a file; give a folder")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert expected in capsys.readouterr().err
