"""The main job: pretrain a small GPT on real text with Factored Gossip DiLoCo (or a DDP baseline).

:func:`train_worker` is what one worker (one process, one rank) runs; :func:`launch` starts ``cfg.workers`` local
workers with torchelastic (the engine behind ``torchrun``) and returns rank 0's summary. ``fgdiloco pretrain``
(:mod:`fgdiloco.cli`) is a thin layer over :func:`launch`.

Outputs in ``cfg.out`` (written by rank 0):

* ``metrics.jsonl``: one JSON object per evaluation (step 0, then every ``eval_every`` rounds and at the end):
  step, round, tokens (seen by all workers), wall / train seconds, held-out loss of rank 0's replica and its mean
  over all replicas, train loss, and the round's diagnostics (utilisation, bytes sent, Mix2 seconds, Mix1 wait,
  consensus distance, failed exchanges) of rank 0 and, where it makes sense, averaged over ranks.
* ``summary.json``: initial / final held-out loss, the unigram baseline, tokens, wall seconds, mean utilisation,
  bytes sent per worker, and the configuration.
* ``loss.png``: held-out loss against tokens and against training seconds, the unigram baseline dashed.

Evaluation (held-out loss on a fixed set of validation windows, the same on every rank) runs between rounds and
is kept out of the diagnostics: it runs inside ``FGDiLoCo.paused()``, so its time is not in any round's
round or inner seconds, and it is subtracted from ``train_seconds``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .data import (
    build_tokenizer,
    cache_dir_for,
    encode_corpus,
    load_text,
    sample_batch,
    split_tokens,
    unigram_loss,
)
from .model import GPT, GPTConfig

__all__ = ["CODECS", "TOPOLOGIES", "TrainConfig", "launch", "train_worker"]

CODECS = ("dense", "bf16", "int8", "lowrank")
TOPOLOGIES = ("random", "exponential", "ring", "allreduce")
BASELINES = (None, "ddp", "localsgd")


@dataclass
class TrainConfig:
    """Everything a pretraining run needs. The defaults finish in about 3 minutes on 2 CPU cores.

    Run shape: ``workers`` replicas each take ``steps`` inner AdamW steps; every ``sync_every`` of them end an
    outer round (gossip). Tokens seen in total = ``workers * steps * batch_size * block_size``.
    """

    # workers and the outer loop
    workers: int = 4
    steps: int = 240
    sync_every: int = 20
    topology: str = "random"
    mix1_rounds: int = 1
    mix2_rounds: int = 1
    codec: str = "dense"
    rank: int = 8
    error_feedback: bool = True
    outer_lr: float = 0.7
    outer_momentum: float = 0.3
    baseline: str | None = None
    timeout: float = 60.0
    # inner optimiser (AdamW, linear warm-up then cosine decay to min_lr_ratio * lr, gradient clipping; 0: off)
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 16
    block_size: int = 128
    # model
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    # data
    data: str | None = None
    tokenizer: str = "bpe"
    vocab_size: int = 2048
    val_fraction: float = 0.05
    cache_dir: str | None = None
    # output and evaluation
    out: str = "runs/pretrain"
    seed: int = 0
    eval_every: int = 1
    eval_batches: int = 4
    quiet: bool = False
    # benchmarks (benchmarks/wan.py): stop after the round in which training time passes max_seconds (all ranks
    # stop together); record the byte counters of the interface named by $GLOO_SOCKET_IFNAME in metrics.jsonl;
    # eval_deferred: keep a copy of the weights at each evaluation point and evaluate them after training, so no
    # evaluation runs between rounds (where background gossip would progress during time that is not counted)
    max_seconds: float | None = None
    net_counters: bool = False
    eval_deferred: bool = False

    def validate(self) -> TrainConfig:
        """Check every field; returns ``self``.

        Raises:
            ValueError: a field out of range or unknown (the message names it and what is allowed).
            FileNotFoundError: ``data`` does not exist.
        """

        def count(name: str, minimum: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")

        def number(name: str, low: float, high: float | None = None, low_ok: bool = False) -> None:
            v = getattr(self, name)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (v >= low if low_ok else v > low) and (high is None or v < high))
            if not ok:
                rng = f"{'[' if low_ok else '('}{low}, {high if high is not None else 'inf'})"
                raise ValueError(f"{name} must be a number in {rng}, got {v!r}")

        for name, minimum in (("workers", 1), ("steps", 1), ("sync_every", 1), ("mix1_rounds", 0),
                              ("mix2_rounds", 0), ("rank", 1), ("warmup_steps", 0), ("batch_size", 1),
                              ("block_size", 2), ("n_layer", 1), ("n_head", 1), ("n_embd", 1), ("eval_every", 1),
                              ("eval_batches", 1), ("seed", 0)):
            count(name, minimum)
        number("outer_lr", 0.0)
        number("outer_momentum", 0.0, 1.0, low_ok=True)
        number("timeout", 0.0)
        number("lr", 0.0)
        number("min_lr_ratio", 0.0, 1.0 + 1e-12, low_ok=True)
        number("weight_decay", 0.0, low_ok=True)
        number("grad_clip", 0.0, low_ok=True)
        number("dropout", 0.0, 1.0, low_ok=True)
        number("val_fraction", 0.0, 1.0)
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}; got {self.topology!r}")
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {', '.join(CODECS)}; got {self.codec!r}")
        make_codec(self)  # raises a clear error for a codec this build does not have
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be None, 'ddp' or 'localsgd', got {self.baseline!r}")
        if self.max_seconds is not None:
            number("max_seconds", 0.0)
        if self.tokenizer not in ("bpe", "bytes"):
            raise ValueError(f"tokenizer must be 'bpe' or 'bytes', got {self.tokenizer!r}")
        if self.tokenizer == "bpe":
            count("vocab_size", 257)
            if self.vocab_size > 65535:
                raise ValueError(f"vocab_size must be <= 65535, got {self.vocab_size}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.data is not None and not Path(self.data).expanduser().exists():
            raise FileNotFoundError(f"--data {self.data!r} does not exist (give a UTF-8 text file or a folder of "
                                    ".txt files)")
        return self

    @property
    def rounds(self) -> int:
        """Outer rounds per run (the last one may be shorter than ``sync_every``)."""
        return -(-self.steps // self.sync_every)


def make_codec(cfg: TrainConfig) -> Any:
    """The Mix2 codec named by ``cfg.codec`` (``LowRank(rank=cfg.rank)`` for ``"lowrank"``)."""
    from ..factor import resolve_codec

    if cfg.codec == "lowrank":
        try:
            from ..factor import LowRank  # type: ignore[attr-defined]
        except ImportError:
            raise ValueError("codec 'lowrank' is not available in this version of fgdiloco") from None
        return LowRank(rank=cfg.rank, error_feedback=cfg.error_feedback)
    try:
        return resolve_codec(cfg.codec, default="dense", argument="codec")
    except ValueError as e:
        raise ValueError(f"codec {cfg.codec!r} is not available in this version of fgdiloco ({e})") from None


# ---------------------------------------------------------------------------------------------------- helpers
def _init_distributed() -> bool:
    """Join the job's process group from torchrun's environment; True when this call created it."""
    if dist.is_available() and dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return False
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return True


def _lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of inner step ``step`` (0-based): linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _load_data(cfg: TrainConfig, rank: int, world: int) -> dict[str, Any]:
    """Rank 0 reads the text, builds (or loads from cache) the tokenizer and token ids, and broadcasts the ids;
    every rank gets the same train / validation split. Only rank 0 touches the cache, so ranks never race."""
    info: dict[str, Any] = {}
    header = torch.zeros(3, dtype=torch.int64)
    tokens = None
    error: BaseException | None = None
    if rank == 0:
        try:
            t0 = time.perf_counter()
            text = load_text(cfg.data)
            cache = cache_dir_for(cfg.data, cfg.cache_dir)
            tok = build_tokenizer(text, cfg.tokenizer, cfg.vocab_size, cache_dir=cache)
            tokens = encode_corpus(text, tok, cache_dir=cache)
            info.update(chars=len(text), cache_dir=str(cache), data_seconds=time.perf_counter() - t0)
            header = torch.tensor([tokens.numel(), tok.vocab_size, 1], dtype=torch.int64)
        except BaseException as e:  # noqa: BLE001 - told to the other ranks, then re-raised
            error = e
            header = torch.tensor([0, 0, 0], dtype=torch.int64)
    if world > 1:
        dist.broadcast(header, src=0)
    if error is not None:
        raise error
    if int(header[2]) != 1:
        raise RuntimeError("rank 0 failed to load the training data (see its error)")
    n, vocab = int(header[0]), int(header[1])
    if world > 1:
        buf = tokens.to(torch.int32) if rank == 0 else torch.empty(n, dtype=torch.int32)
        dist.broadcast(buf, src=0)
        tokens = buf.long()
    assert tokens is not None
    train, val = split_tokens(tokens, cfg.val_fraction)
    for name, part in (("training", train), ("validation", val)):
        if part.numel() < cfg.block_size + 1:
            raise ValueError(f"the {name} split has {part.numel()} tokens, fewer than block_size + 1 = "
                             f"{cfg.block_size + 1}: use more text, a smaller --block-size or another --val-fraction")
    info.update(train=train, val=val, vocab_size=vocab, tokens_total=n)
    return info


class _Recorder:
    """Rank 0's metrics.jsonl writer and progress printer."""

    def __init__(self, cfg: TrainConfig, rank: int):
        self.cfg = cfg
        self.rank = rank
        self.rows: list[dict[str, Any]] = []
        self._file = None
        if rank == 0:
            out = Path(cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            self._file = open(out / "metrics.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if not self.cfg.quiet:
            print(_progress_line(self.cfg, row), flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _progress_line(cfg: TrainConfig, row: dict[str, Any]) -> str:
    parts = [f"round {row['round']:>3}/{cfg.rounds}", f"step {row['step']:>5}/{cfg.steps}",
             f"tokens {row['tokens'] / 1e6:6.2f}M", f"eval {row['eval_loss']:.3f} (mean {row['eval_loss_mean']:.3f})"]
    if row.get("train_loss") is not None:
        parts.append(f"train {row['train_loss']:.3f}")
    if row.get("utilisation_mean") is not None:
        parts.append(f"util {100 * row['utilisation_mean']:.0f}%")
    if row.get("bytes_sent") is not None:
        parts.append(f"sent {_fmt_bytes(row['bytes_sent'])}")
    if row.get("consensus_distance") is not None:
        parts.append(f"consensus {row['consensus_distance']:.3g}")
    if row.get("failed_exchanges"):
        parts.append(f"failed {row['failed_exchanges']}")
    parts.append(f"{row['wall_seconds']:.0f}s")
    return "[fgdiloco] " + "  ".join(parts)


def _net_bytes() -> tuple[float, float]:
    """(tx, rx) byte counters of the interface named by ``GLOO_SOCKET_IFNAME`` (0, 0 when unset or unreadable)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    try:
        base = Path("/sys/class/net") / name / "statistics"
        return (float((base / "tx_bytes").read_text()), float((base / "rx_bytes").read_text()))
    except (OSError, ValueError):
        return (0.0, 0.0)


def _all_sum(values: list[float], world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def _evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was_training = model.training
    model.eval()
    total = sum(float(model(x, y)[1]) for x, y in batches)
    model.train(was_training)
    return total / len(batches)


def _plot(out: Path, rows: list[dict[str, Any]], unigram: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    tokens = [r["tokens"] / 1e6 for r in rows]
    secs = [r["train_seconds"] for r in rows]
    for ax, xs, label in ((axes[0], tokens, "tokens seen by all workers (millions)"),
                          (axes[1], secs, "wall seconds (training; evaluation excluded)")):
        ax.plot(xs, [r["eval_loss"] for r in rows], "o-", ms=3, label="held-out loss, rank 0")
        ax.plot(xs, [r["eval_loss_mean"] for r in rows], "-", lw=1, alpha=0.7, label="mean over workers")
        ax.axhline(unigram, ls="--", color="grey", label=f"unigram baseline {unigram:.2f}")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats / token)")
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = out / ".loss.png.tmp"
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, out / "loss.png")


# ---------------------------------------------------------------------------------------------------- the worker
def train_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Run one worker of a pretraining job and return the run summary (complete on rank 0).

    Joins the job's process group from torchrun's environment variables (Gloo) unless ``torch.distributed`` is
    already initialised; without either it trains a single worker. Every worker must call it with the same
    ``cfg``. Rank 0 writes ``metrics.jsonl``, ``summary.json`` and ``loss.png`` into ``cfg.out``.
    """
    cfg.validate()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    created = _init_distributed()
    try:
        return _train(cfg)
    finally:
        if created and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _train(cfg: TrainConfig) -> dict[str, Any]:
    t_setup = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    data = _load_data(cfg, rank, world)
    train, val, vocab = data["train"], data["val"], data["vocab_size"]
    unigram = unigram_loss(train, val, vocab)

    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                          n_embd=cfg.n_embd, dropout=cfg.dropout))
    inner = _adamw(model, cfg)
    eval_gen = torch.Generator().manual_seed(cfg.seed + 7919)
    eval_set = [sample_batch(val, cfg.batch_size, cfg.block_size, eval_gen) for _ in range(cfg.eval_batches)]
    batch_gen = torch.Generator().manual_seed(cfg.seed * 100_003 + rank + 1)

    ddp = cfg.baseline == "ddp"
    localsgd = cfg.baseline == "localsgd"
    baseline = ddp or localsgd
    opt = None
    averager = None
    grad_bytes = [0]
    bucket_ready = [0.0]  # DDP: when the last gradient bucket was handed to the all-reduce
    if ddp:
        train_model: torch.nn.Module = model
        if world > 1:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.nn.parallel import DistributedDataParallel

            train_model = DistributedDataParallel(model)

            def counting_allreduce(state, bucket):  # no annotations: DDP checks them (strings under __future__)
                buf = bucket.buffer()
                grad_bytes[0] += buf.numel() * buf.element_size()
                bucket_ready[0] = time.perf_counter()
                return default_hooks.allreduce_hook(None, bucket)

            train_model.register_comm_hook(None, counting_allreduce)
        step_opt: Any = inner
    elif localsgd:
        # local SGD with PyTorch's own periodic parameter averaging; warmup_steps = H - 1 aligns the averaging with
        # the other methods' rounds (after steps H, 2H, ...)
        train_model = model
        step_opt = inner
        if world > 1:
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            with torch.no_grad():
                for t in model.parameters():
                    dist.broadcast(t.data, src=0)
            averager = PeriodicModelAverager(period=cfg.sync_every, warmup_steps=cfg.sync_every - 1)
    else:
        from ..outer import FGDiLoCo

        train_model = model
        opt = FGDiLoCo(model, inner, sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                       outer_momentum=cfg.outer_momentum, topology=cfg.topology, mix1_rounds=cfg.mix1_rounds,
                       mix2_rounds=cfg.mix2_rounds, codec=make_codec(cfg), timeout=cfg.timeout, seed=cfg.seed)
        step_opt = opt
    n_params = model.num_parameters(non_embedding=False)
    tokens_per_step = cfg.batch_size * cfg.block_size * world
    # ring all-reduce: each worker sends 2 (M-1)/M of the gradient bytes (an estimate; Gloo picks its algorithm)
    ring = 2 * (world - 1) / world if world > 1 else 0.0

    rec = _Recorder(cfg, rank)
    setup_seconds = time.perf_counter() - t_setup
    title = ({"ddp": "DDP baseline", "localsgd": "local SGD baseline (PeriodicModelAverager)"}.get(
                 cfg.baseline or "", "Factored Gossip DiLoCo") + f": {world} workers, {cfg.steps} steps"
             + ("" if ddp else f", H={cfg.sync_every}" if localsgd else
                f", H={cfg.sync_every}, {cfg.topology}, codec {cfg.codec}")
             + f", {n_params / 1e6:.2f}M params")

    eval_seconds = 0.0
    util_sum = util_n = 0.0
    bytes_total = 0.0
    failed_total = 0
    blocked_round = 0.0  # baselines: seconds blocked in communication in this round
    stop = False
    net0 = _net_bytes() if cfg.net_counters else (0.0, 0.0)
    t_start = time.perf_counter()
    t_round = t_start  # baselines: start of the current round (evaluation excluded)
    deferred: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []

    def record(step: int, rnd: int, train_loss: float | None, stats: Any, bytes_round: float | None) -> None:
        with opt.paused() if opt is not None else contextlib.nullcontext():  # evaluation is not training time
            _record(step, rnd, train_loss, stats, bytes_round)

    def _record(step: int, rnd: int, train_loss: float | None, stats: Any, bytes_round: float | None) -> None:
        nonlocal eval_seconds, stop, t_round
        t0 = time.perf_counter()
        wall = t0 - t_start
        net = _net_bytes() if cfg.net_counters else (0.0, 0.0)
        over = cfg.max_seconds is not None and wall - eval_seconds >= cfg.max_seconds
        loss = float("nan") if cfg.eval_deferred else _evaluate(model, eval_set)
        util = stats["utilisation"] if stats else None
        cons = stats["consensus_distance"] if stats else None
        local = [loss, train_loss if train_loss is not None else 0.0, util if util is not None else 0.0,
                 bytes_round or 0.0, cons if cons is not None else 0.0, 1.0 if cons is not None else 0.0,
                 net[0] - net0[0], net[1] - net0[1], 1.0 if over else 0.0]
        s = _all_sum(local, world)  # after the round: costs no round time (subtracted below)
        stop = s[8] > 0  # any rank past max_seconds: all stop after this round
        row = {
            "step": step,
            "round": rnd,
            "tokens": step * tokens_per_step,
            "wall_seconds": wall,
            "train_seconds": wall - eval_seconds,
            "eval_loss": loss,
            "eval_loss_mean": s[0] / world,
            "train_loss": train_loss,
            "train_loss_mean": s[1] / world if train_loss is not None else None,
            "utilisation": util,
            "utilisation_mean": s[2] / world if util is not None else None,
            "bytes_sent": bytes_round,
            "bytes_sent_mean": s[3] / world if bytes_round is not None else None,
            "mix2_seconds": stats["mix2_seconds"] if stats else None,
            "mix1_wait_seconds": stats["mix1_wait_seconds"] if stats else None,
            "mix1_seconds": stats["mix1_seconds"] if stats else None,
            "round_seconds": stats["round_seconds"] if stats else None,
            "consensus_distance": cons,
            "consensus_distance_mean": s[4] / s[5] if s[5] else None,
            "failed_exchanges": stats["failed_exchanges"] if stats else None,
        }
        if cfg.net_counters:  # bytes on this worker's interface since training started (headers included)
            row.update(net_tx_bytes=net[0] - net0[0], net_rx_bytes=net[1] - net0[1], net_tx_bytes_mean=s[6] / world,
                       net_rx_bytes_mean=s[7] / world)
        if cfg.eval_deferred:
            deferred.append((row, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        else:
            rec.write(row)
        dt = time.perf_counter() - t0
        eval_seconds += dt
        t_round = time.perf_counter()

    try:
        record(0, 0, None, None, None)
        round_losses: list[float] = []
        done_rounds = 0
        steps_done = 0
        for step in range(cfg.steps):
            for g in inner.param_groups:
                g["lr"] = _lr_at(cfg, step)
            x, y = sample_batch(train, cfg.batch_size, cfg.block_size, batch_gen)
            _, loss = train_model(x, y)
            loss.backward()
            if ddp and world > 1:  # backward() returned when the last bucket's all-reduce did
                blocked_round += time.perf_counter() - bucket_ready[0]
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            step_opt.step()
            if averager is not None:  # before zero_grad: PeriodicModelAverager averages parameters with a .grad
                t_avg = time.perf_counter()
                if averager.step >= averager.warmup_steps and (
                        averager.step - averager.warmup_steps) % averager.period == 0:
                    grad_bytes[0] += 4 * sum(p.numel() for p in model.parameters())
                averager.average_parameters(model.parameters())
                blocked_round += time.perf_counter() - t_avg
            step_opt.zero_grad(set_to_none=True)
            round_losses.append(loss.item())
            steps_done = step + 1
            last = step + 1 == cfg.steps
            if baseline:
                if (step + 1) % cfg.sync_every and not last:
                    continue
                # seconds not blocked in communication / wall seconds, evaluation excluded (as for FGDiLoCo)
                round_seconds = max(time.perf_counter() - t_round, 1e-9)
                util_b = min(max(1.0 - blocked_round / round_seconds, 0.0), 1.0)
                stats = {"utilisation": util_b, "round_seconds": round_seconds, "consensus_distance": None,
                         "mix2_seconds": blocked_round, "mix1_wait_seconds": None, "mix1_seconds": None,
                         "failed_exchanges": 0}
                blocked_round = 0.0
                t_round = time.perf_counter()
                util_sum += util_b
                util_n += 1
                bytes_round = grad_bytes[0] * ring
                grad_bytes[0] = 0
            else:
                if opt.round == done_rounds and last:
                    opt.sync()  # end the last, shorter round
                if opt.round == done_rounds:
                    continue
                stats = opt.last_round.as_dict()
                bytes_round = float(stats["bytes_sent"])
                util_sum += stats["utilisation"]
                util_n += 1
                failed_total += stats["failed_exchanges"]
            done_rounds += 1
            bytes_total += bytes_round
            train_loss = sum(round_losses) / len(round_losses)
            round_losses = []
            if done_rounds % cfg.eval_every == 0 or last:
                record(step + 1, done_rounds, train_loss, stats, bytes_round)
                if stop and not last:
                    break
        total_seconds = time.perf_counter() - t_start
        if deferred:  # evaluate the kept weights now (collective: every rank has the same evaluation points)
            if opt is not None:
                opt.close()
            t0 = time.perf_counter()
            live = {k: v.detach().clone() for k, v in model.state_dict().items()}
            for row, weights in deferred:
                model.load_state_dict(weights)
                row["eval_loss"] = _evaluate(model, eval_set)
                row["eval_loss_mean"] = _all_sum([row["eval_loss"]], world)[0] / world
                rec.write(row)
            model.load_state_dict(live)
            eval_seconds += time.perf_counter() - t0
    finally:
        if opt is not None:
            opt.close()
        rec.close()

    util_all, bytes_all, failed_all = _all_sum([util_sum / util_n if util_n else 0.0, bytes_total,
                                                float(failed_total)], world)
    rows = rec.rows
    summary: dict[str, Any] = {
        "method": cfg.baseline or "fgdiloco",
        "workers": world,
        "rank": rank,
        "initial_eval_loss": rows[0]["eval_loss"],
        "final_eval_loss": rows[-1]["eval_loss"],
        "final_eval_loss_mean": rows[-1]["eval_loss_mean"],
        "best_eval_loss": min(r["eval_loss"] for r in rows),
        "unigram_loss": unigram,
        "tokens": steps_done * tokens_per_step,
        "steps": steps_done,
        "stopped_early": steps_done < cfg.steps,
        "rounds": done_rounds,
        "wall_seconds": total_seconds,
        "train_seconds": total_seconds - eval_seconds,
        "eval_seconds": eval_seconds,
        "setup_seconds": setup_seconds,
        "tokens_per_second": steps_done * tokens_per_step / max(total_seconds - eval_seconds, 1e-9),
        "utilisation": None if ddp else util_all / world,
        # baselines: seconds not blocked in communication / wall seconds, measured per round (evaluation excluded)
        "utilisation_not_blocked": util_all / world if baseline else None,
        "bytes_sent": bytes_all / world,
        "bytes_sent_note": ("per worker, total: estimated ring all-reduce volume 2(M-1)/M x gradient bytes" if ddp
                            else "per worker, total: estimated ring all-reduce volume 2(M-1)/M x parameter bytes"
                            if localsgd else "per worker, total: Mix1 + Mix2 frame bytes"),
        "failed_exchanges": int(failed_all),
        "params": n_params,
        "vocab_size": vocab,
        "train_tokens": int(train.numel()),
        "val_tokens": int(val.numel()),
        "data": cfg.data if cfg.data is not None else "bundled corpus (fgdiloco/pretrain/corpus)",
        "cache_dir": data.get("cache_dir"),
        "torch": torch.__version__,
        "config": asdict(cfg),
    }
    if rank == 0:
        out = Path(cfg.out)
        tmp = out / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out / "summary.json")
        _plot(out, rows, unigram, title)
        summary["metrics_path"] = str(out / "metrics.jsonl")
        summary["plot_path"] = str(out / "loss.png")
        summary["summary_path"] = str(out / "summary.json")
    return summary


# ---------------------------------------------------------------------------------------------------- launcher
def launch(cfg: TrainConfig) -> dict[str, Any]:
    """Start ``cfg.workers`` local worker processes with torchelastic (what ``torchrun --standalone`` does) and
    return rank 0's summary.

    Each worker runs :func:`train_worker` with ``OMP_NUM_THREADS=1`` (on a small machine four workers share the
    cores). Rendezvous is ``c10d`` on ``localhost`` on a port the OS picks, so concurrent jobs never collide.

    Raises:
        ValueError / FileNotFoundError: an invalid configuration (checked before anything starts).
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker failed (its error is inside).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg.validate()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.workers,
        run_id=f"fgdiloco-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": 300},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        results = elastic_launch(config, train_worker)(dataclasses.replace(cfg))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    summary = results[0]
    sys.stdout.flush()
    return summary
