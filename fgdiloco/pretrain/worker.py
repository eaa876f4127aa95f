"""The main job: pretrain a small GPT on real text with Factored Gossip DiLoCo (or a DDP baseline).

:func:`train_worker` is what one worker (one process, one rank) runs; :func:`launch` starts ``cfg.workers`` local
workers with torchelastic (the engine behind ``torchrun``) and returns rank 0's summary. ``fgdiloco pretrain``
(:mod:`fgdiloco.cli`) is a thin layer over :func:`launch`.

Outputs in ``cfg.out`` (written by rank 0; :mod:`fgdiloco.pretrain.results` describes every field):
``run.json`` (before the first step), ``metrics.jsonl`` (one row per evaluation: step 0, then every
``eval_every`` rounds and at the end), ``summary.json`` and ``loss.png``. A folder is reused as it is: rank 0
removes an earlier run's ``summary.json`` and ``loss.png`` first, so the folder never mixes two runs.

Evaluation (held-out loss on a fixed set of validation windows, the same on every rank) runs between rounds and
is kept out of the diagnostics: it runs inside ``FGDiLoCo.paused()``, so its time is not in any round's
round or inner seconds, and it is subtracted from ``train_seconds``.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import math
import os
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
from .recipe import clip_gradients, held_out_loss, inner_optimizer, net_bytes, next_batch, peak_rss_bytes
from .results import format_round, plot, summarise, write_json

__all__ = ["CODECS", "TOPOLOGIES", "TrainConfig", "launch", "train_worker"]

CODECS = ("dense", "bf16", "int8", "lowrank")
TOPOLOGIES = ("random", "exponential", "ring", "allreduce")
BASELINES = (None, "ddp", "localsgd")


def library_default(cls_path: str, argument: str) -> Any:
    """The default of ``argument`` in the constructor of ``fgdiloco.<cls_path>`` (e.g. ``"factor.LowRank"``), read
    with :func:`inspect.signature`, so the command's defaults follow the library's."""
    import importlib

    module, _, name = f"fgdiloco.{cls_path}".rpartition(".")
    return inspect.signature(getattr(importlib.import_module(module), name)).parameters[argument].default


#: Where :class:`TrainConfig` departs from the library's defaults, and why (``fgdiloco pretrain --help`` shows it).
DEPARTURES: dict[str, str] = {
    "outer_momentum": "that is DiLoCo's setting for hundreds of rounds; in the 12 rounds of the default job it "
                      "overshoots (held-out loss 5.67 with 0.9, 5.02 with 0.3, measured)",
}


@dataclass
class TrainConfig:
    """Everything a pretraining run needs. The defaults finish in about 4 minutes on 2 CPU cores.

    Run shape: ``workers`` replicas each take ``steps`` inner AdamW steps; every ``sync_every`` of them end an
    outer round (gossip). Tokens seen in total = ``workers * steps * batch_size * block_size``.

    The defaults of the arguments that ``FGDiLoCo`` and ``LowRank`` also take are read from their signatures
    (:func:`library_default`), so they follow the library; :data:`DEPARTURES` lists each exception and its
    reason (``fgdiloco pretrain --help`` shows them).
    """

    # workers and the outer loop (workers = replicas x stages; stages > 1: each replica is a pipeline of that many
    # workers, running microbatches per batch with the 1F1B schedule)
    workers: int = 4
    stages: int = 1
    microbatches: int = 4
    steps: int = 240
    sync_every: int = 20
    topology: str = library_default("outer.FGDiLoCo", "topology")
    mix1_rounds: int = library_default("outer.FGDiLoCo", "mix1_rounds")
    mix2_rounds: int = library_default("outer.FGDiLoCo", "mix2_rounds")
    codec: str = "dense"
    rank: int = library_default("factor.LowRank", "rank")
    error_feedback: bool = library_default("factor.LowRank", "error_feedback")
    outer_lr: float = library_default("outer.FGDiLoCo", "outer_lr")
    outer_momentum: float = 0.3  # see DEPARTURES
    baseline: str | None = None
    timeout: float = library_default("outer.FGDiLoCo", "timeout")
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
    # subspace option (GPT(subspace_rank=k), Ramasinghe et al.): every write into the residual stream goes through
    # a fixed d x k basis; with stages > 1 the stage boundaries send k numbers per token (the subspace codec)
    subspace_rank: int | None = None
    # data
    data: str | None = None
    tokenizer: str = "bpe"
    vocab_size: int = 2048
    val_fraction: float = 0.05
    cache_dir: str | None = None
    # output and evaluation (run_id: written into run.json and summary.json; None: rank 0 makes one)
    out: str = "runs/pretrain"
    run_id: str | None = None
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
    # elastic workers (FG-DiLoCo with one stage and a gossip topology: each worker its own torchrun job,
    # fgdiloco.pretrain.elastic_worker): torchrun restarts of each worker before it is given up, and outer rounds
    # between a worker's checkpoints (<out>/checkpoints/worker<k>.pt, from which a restarted worker continues)
    max_restarts: int = 3
    checkpoint_every: int = 5

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

        for name, minimum in (("workers", 1), ("stages", 1), ("microbatches", 1), ("steps", 1), ("sync_every", 1),
                              ("mix1_rounds", 0), ("mix2_rounds", 0), ("rank", 1), ("warmup_steps", 0),
                              ("batch_size", 1), ("block_size", 2), ("n_layer", 1), ("n_head", 1), ("n_embd", 1),
                              ("eval_every", 1), ("eval_batches", 1), ("seed", 0), ("max_restarts", 0),
                              ("checkpoint_every", 1)):
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
        if self.subspace_rank is not None:
            k = self.subspace_rank
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n_embd:
                raise ValueError(f"subspace_rank must be None or an integer in [1, n_embd={self.n_embd}], got {k!r}")
        if self.workers % self.stages:
            raise ValueError(f"stages must divide workers (workers = replicas x stages), got stages={self.stages} "
                             f"for workers={self.workers}")
        if self.stages > self.n_layer:
            raise ValueError(f"stages must be <= n_layer={self.n_layer} (every stage holds at least one block), "
                             f"got {self.stages}")
        if self.stages > 1:
            if self.baseline is not None:
                raise ValueError(f"baseline {self.baseline!r} trains one whole model per worker; it cannot be "
                                 f"combined with stages={self.stages} (pipeline stages need FG-DiLoCo)")
            if self.batch_size % self.microbatches:
                raise ValueError(f"microbatches must divide batch_size={self.batch_size} (every microbatch holds "
                                 f"the same number of sequences), got {self.microbatches}")
            if self.microbatches < self.stages:
                raise ValueError(f"microbatches must be >= stages={self.stages} for the 1F1B schedule, got "
                                 f"{self.microbatches}")
        if self.data is not None and not Path(self.data).expanduser().exists():
            raise FileNotFoundError(f"--data {self.data!r} does not exist (give a UTF-8 text file or a folder of "
                                    ".txt files)")
        return self

    @property
    def replicas(self) -> int:
        """Model replicas R = ``workers / stages`` (each one pipeline of ``stages`` workers)."""
        return self.workers // self.stages

    @property
    def elastic(self) -> bool:
        """Whether ``fgdiloco pretrain`` runs this configuration on elastic workers (each worker its own
        ``torchrun`` job with restarts, :mod:`fgdiloco.elastic`): FG-DiLoCo with one stage and a gossip topology.
        Baselines, ``stages > 1`` and the exact ``"allreduce"`` topology need one process group: one torchelastic
        job, where one death ends the job."""
        return self.baseline is None and self.stages == 1 and self.topology != "allreduce"

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


def load_tokens(cfg: TrainConfig) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """The token ids of ``cfg.data`` (1-D long), the vocabulary size and ``{"chars", "cache_dir",
    "data_seconds"}``: the tokenizer and ids come from the cache :func:`~fgdiloco.pretrain.launcher.preflight`
    filled (built here when missing)."""
    t0 = time.perf_counter()
    text = load_text(cfg.data)
    cache = cache_dir_for(cfg.data, cfg.cache_dir)
    tok = build_tokenizer(text, cfg.tokenizer, cfg.vocab_size, cache_dir=cache)
    tokens = encode_corpus(text, tok, cache_dir=cache)
    return tokens, tok.vocab_size, {"chars": len(text), "cache_dir": str(cache),
                                    "data_seconds": time.perf_counter() - t0}


def _load_data(cfg: TrainConfig, rank: int, world: int) -> dict[str, Any]:
    """Rank 0 reads the text, builds (or loads from cache) the tokenizer and token ids, and broadcasts the ids;
    every rank gets the same train / validation split. Only rank 0 touches the cache, so ranks never race."""
    info: dict[str, Any] = {}
    header = torch.zeros(3, dtype=torch.int64)
    tokens = None
    error: BaseException | None = None
    if rank == 0:
        try:
            tokens, vocab0, found = load_tokens(cfg)
            info.update(found)
            header = torch.tensor([tokens.numel(), vocab0, 1], dtype=torch.int64)
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
    """Rank 0's writer of ``run.json`` and ``metrics.jsonl`` (and its progress printer when not ``quiet``)."""

    def __init__(self, cfg: TrainConfig, rank: int, info: dict[str, Any]):
        self.cfg = cfg
        self.rank = rank
        self.info = info
        self.rows: list[dict[str, Any]] = []
        self._file = None
        if rank == 0:
            out = Path(cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            for stale in ("summary.json", "loss.png"):  # an earlier run's: never left beside this run's rows
                with contextlib.suppress(FileNotFoundError):
                    (out / stale).unlink()
            write_json(out / "run.json", info)
            self._file = open(out / "metrics.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if not self.cfg.quiet:
            print("[fgdiloco] " + format_round(row, self.cfg.rounds, self.cfg.steps), flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _all_sum(values: list[float], world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


def _evaluate_pipeline(pipe: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Held-out loss through the replica's pipeline (collective over its stages): the mean over ``batches`` on the
    last stage, 0.0 on the others (they hold no loss)."""
    was_training = pipe.module.training
    pipe.module.eval()
    losses = [pipe.eval_loss(x, y) for x, y in batches]
    pipe.module.train(was_training)
    if losses[0] is None:
        return 0.0
    return sum(float(v) for v in losses) / len(batches)


def batch_seed(cfg: TrainConfig, replica: int) -> int:
    """Seed of the training batches of ``replica``: every stage of a replica draws the same batches (stage 0 uses
    the inputs, the last stage the targets), and replica r draws what worker r of a one-stage run draws."""
    return cfg.seed * 100_003 + replica + 1


def _clip_pipeline_grads(params: list[torch.Tensor], max_norm: float, group: Any) -> None:
    """Clip by the gradient norm of the whole replica (all its stages), as ``clip_grad_norm_`` does for the unsplit
    model: one all-reduce of the squared stage norms over the pipeline group."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    sq = (norm.double() ** 2).reshape(1)
    dist.all_reduce(sq, group=group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt().to(norm.dtype)[0])


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


def run_info(cfg: TrainConfig, *, method: str, workers: int, replicas: int, tokens_per_step: int, params: int,
             vocab_size: int, train: torch.Tensor, val: torch.Tensor, unigram: float, cache_dir: Any,
             setup_seconds: float, title: str, **extra: Any) -> dict[str, Any]:
    """What ``run.json`` says about a run (and ``summary.json`` repeats): method, shape, plan, data, set-up time
    (seconds), the title of ``loss.png``, torch's version and the whole configuration; ``extra`` is added."""
    return {
        "run_id": cfg.run_id or uuid.uuid4().hex[:12],
        "method": method,
        **extra,
        "workers": workers,
        "replicas": replicas,
        "stages": cfg.stages,
        "rounds_planned": cfg.rounds,
        "steps_planned": cfg.steps,
        "tokens_per_step": tokens_per_step,
        "params": params,
        "vocab_size": vocab_size,
        "train_tokens": int(train.numel()),
        "val_tokens": int(val.numel()),
        "unigram_loss": unigram,
        "data": cfg.data if cfg.data is not None else "bundled corpus (fgdiloco/pretrain/corpus)",
        "cache_dir": cache_dir,
        "setup_seconds": setup_seconds,
        "title": title,
        "torch": torch.__version__,
        "config": asdict(cfg),
    }


def _train(cfg: TrainConfig) -> dict[str, Any]:
    t_setup = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    data = _load_data(cfg, rank, world)
    train, val, vocab = data["train"], data["val"], data["vocab_size"]
    unigram = unigram_loss(train, val, vocab)

    mesh = pipe = None
    if cfg.stages > 1:
        if world % cfg.stages:
            raise ValueError(f"stages={cfg.stages} must divide the world size {world} (workers = replicas x stages)")
        from ..mesh import ReplicaMesh

        mesh = ReplicaMesh(world // cfg.stages, cfg.stages, timeout=cfg.timeout)
    replicas = world // cfg.stages
    replica = mesh.replica if mesh is not None else rank
    # the ranks holding a loss (the last stage of each replica), and the one whose loss the rows report
    has_loss = mesh is None or mesh.is_last_stage
    reporter = has_loss and replica == 0

    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                          n_embd=cfg.n_embd, dropout=cfg.dropout), subspace_rank=cfg.subspace_rank,
                subspace_stages=cfg.stages if cfg.stages > 1 else None)  # only what crosses a boundary: in U
    n_params = model.num_parameters(non_embedding=False)
    if mesh is not None:  # every rank builds the same seeded model and keeps its own stage
        from ..pipeline import Pipeline
        from .model import activation_codec_for, lm_loss

        model = model.split(cfg.stages)[mesh.stage]
    inner = inner_optimizer(model, cfg)
    eval_gen = torch.Generator().manual_seed(cfg.seed + 7919)
    eval_set = [sample_batch(val, cfg.batch_size, cfg.block_size, eval_gen) for _ in range(cfg.eval_batches)]
    batch_gen = torch.Generator().manual_seed(batch_seed(cfg, replica))

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
                       mix2_rounds=cfg.mix2_rounds, codec=make_codec(cfg), timeout=cfg.timeout, seed=cfg.seed,
                       mesh=mesh)
        step_opt = opt
        if mesh is not None:
            # a subspace model's boundaries send its k coefficients per token (None: the stream as it is)
            pipe = Pipeline(model, mesh, lm_loss, n_microbatches=cfg.microbatches, schedule="1f1b",
                            activation_codec=activation_codec_for(model))
    tokens_per_step = cfg.batch_size * cfg.block_size * replicas
    # ring all-reduce: each worker sends 2 (M-1)/M of the gradient bytes (an estimate; Gloo picks its algorithm)
    ring = 2 * (world - 1) / world if world > 1 else 0.0

    title = ({"ddp": "DDP baseline", "localsgd": "local SGD baseline (PeriodicModelAverager)"}.get(
                 cfg.baseline or "", "Factored Gossip DiLoCo")
             + (f": {replicas} replicas x {cfg.stages} stages" if mesh is not None else f": {world} workers")
             + f", {cfg.steps} steps"
             + ("" if ddp else f", H={cfg.sync_every}" if localsgd else
                f", H={cfg.sync_every}, {cfg.topology}, codec {cfg.codec}")
             + f", {n_params / 1e6:.2f}M params")
    setup_seconds = time.perf_counter() - t_setup
    info = run_info(cfg, method=cfg.baseline or "fgdiloco", workers=world, replicas=replicas,
                    tokens_per_step=tokens_per_step, params=n_params, vocab_size=vocab, train=train, val=val,
                    unigram=unigram, cache_dir=data.get("cache_dir"), setup_seconds=setup_seconds, title=title)
    rec = _Recorder(cfg, rank, info)

    eval_seconds = 0.0
    util_sum = util_n = 0.0
    bytes_total = 0.0
    failed_total = skipped_total = 0
    blocked_round = 0.0  # baselines: seconds blocked in communication in this round
    stop = False
    net0 = net_bytes() if cfg.net_counters else (0.0, 0.0)
    t_start = time.perf_counter()
    t_round = t_start  # baselines: start of the current round (evaluation excluded)
    bubble_sum = 0.0  # pipeline: sum of the steps' bubble fractions
    deferred: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []

    def evaluate() -> float:
        return held_out_loss(model, eval_set) if pipe is None else _evaluate_pipeline(pipe, eval_set)

    def record(step: int, rnd: int, train_loss: float | None, stats: Any, bytes_round: float | None) -> None:
        with opt.paused() if opt is not None else contextlib.nullcontext():  # evaluation is not training time
            _record(step, rnd, train_loss, stats, bytes_round)

    def _record(step: int, rnd: int, train_loss: float | None, stats: Any, bytes_round: float | None) -> None:
        nonlocal eval_seconds, stop, t_round
        t0 = time.perf_counter()
        wall = t0 - t_start
        net = net_bytes() if cfg.net_counters else (0.0, 0.0)
        over = cfg.max_seconds is not None and wall - eval_seconds >= cfg.max_seconds
        loss = float("nan") if cfg.eval_deferred else evaluate()
        util = stats["utilisation"] if stats else None
        cons = stats["consensus_distance"] if stats else None
        local = [loss, train_loss if train_loss is not None else 0.0, util if util is not None else 0.0,
                 bytes_round or 0.0, cons if cons is not None else 0.0, 1.0 if cons is not None else 0.0,
                 net[0] - net0[0], net[1] - net0[1], 1.0 if over else 0.0, bytes_total,
                 util_sum / util_n if util_n else 0.0, float(failed_total), float(skipped_total)]
        if mesh is not None:  # only the last stages hold losses; replica 0's comes from its last stage
            local[0] = loss if has_loss else 0.0
            local[1] = train_loss if has_loss and train_loss is not None else 0.0
            local += [loss if reporter else 0.0, train_loss if reporter and train_loss is not None else 0.0,
                      float(pipe.activation_bytes_sent_total), bubble_sum / pipe.steps if pipe.steps else 0.0]
        s = _all_sum(local, world)  # after the round: costs no round time (subtracted below)
        stop = s[8] > 0  # any rank past max_seconds: all stop after this round
        if mesh is not None:
            loss, train_loss = s[13], (s[14] if train_loss is not None else None)
        row = {
            "step": step,
            "round": rnd,
            "tokens": step * tokens_per_step,
            "wall_seconds": wall,
            "train_seconds": wall - eval_seconds,
            "eval_loss": loss,
            "eval_loss_mean": s[0] / replicas,
            "train_loss": train_loss,
            "train_loss_mean": s[1] / replicas if train_loss is not None else None,
            "utilisation": util,
            "utilisation_mean": s[2] / world if util is not None else None,
            "bytes_sent": bytes_round,
            "bytes_sent_mean": s[3] / world if bytes_round is not None else None,
            "bytes_sent_per_worker_so_far": s[9] / world,
            "utilisation_so_far": s[10] / world if util_n else None,
            "failed_exchanges_so_far": int(s[11]),
            "skipped_exchanges_so_far": int(s[12]),
            "mix2_seconds": stats["mix2_seconds"] if stats else None,
            "mix1_wait_seconds": stats["mix1_wait_seconds"] if stats else None,
            "mix1_seconds": stats["mix1_seconds"] if stats else None,
            "round_seconds": stats["round_seconds"] if stats else None,
            "consensus_distance": cons,
            "consensus_distance_mean": s[4] / s[5] if s[5] else None,
            "failed_exchanges": stats["failed_exchanges"] if stats else None,
            "skipped_exchanges": stats["skipped_exchanges"] if stats else None,
        }
        if mesh is not None:
            row.update(activation_bytes_sent_per_worker_so_far=s[15] / world,
                       pipeline_bubble_so_far=s[16] / world if step > 0 else None)
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
            x, y = next_batch(inner, cfg, step, train, batch_gen)
            if pipe is not None:  # forward + backward of the replica's batch through its stages
                loss = pipe.step(x, y)
                bubble_sum += pipe.last_step.bubble
                if cfg.grad_clip > 0:
                    _clip_pipeline_grads(list(model.parameters()), cfg.grad_clip, mesh.pipeline_group)
            else:
                _, loss = train_model(x, y)
                loss.backward()
            if ddp and world > 1:  # backward() returned when the last bucket's all-reduce did
                blocked_round += time.perf_counter() - bucket_ready[0]
            if pipe is None:
                clip_gradients(model.parameters(), cfg)
            step_opt.step()
            if averager is not None:  # before zero_grad: PeriodicModelAverager averages parameters with a .grad
                t_avg = time.perf_counter()
                if averager.step >= averager.warmup_steps and (
                        averager.step - averager.warmup_steps) % averager.period == 0:
                    grad_bytes[0] += 4 * sum(p.numel() for p in model.parameters())
                averager.average_parameters(model.parameters())
                blocked_round += time.perf_counter() - t_avg
            step_opt.zero_grad(set_to_none=True)
            round_losses.append(loss.item() if loss is not None else 0.0)  # 0.0: a stage without the loss
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
                         "failed_exchanges": 0, "skipped_exchanges": 0}
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
                skipped_total += stats["skipped_exchanges"]
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
                if mesh is None:
                    row["eval_loss"] = held_out_loss(model, eval_set)
                    row["eval_loss_mean"] = _all_sum([row["eval_loss"]], world)[0] / world
                else:
                    v = _evaluate_pipeline(pipe, eval_set)
                    mean, mine = _all_sum([v if has_loss else 0.0, v if reporter else 0.0], world)
                    row["eval_loss"], row["eval_loss_mean"] = mine, mean / replicas
                rec.write(row)
            model.load_state_dict(live)
            eval_seconds += time.perf_counter() - t0
    finally:
        if opt is not None:
            opt.close()
        rec.close()

    peak = torch.tensor([peak_rss_bytes()], dtype=torch.int64)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    summary = summarise(info, rec.rows, extra={
        "rank": rank,
        "wall_seconds": total_seconds,
        "train_seconds": total_seconds - eval_seconds,
        "eval_seconds": eval_seconds,
        "tokens_per_second": steps_done * tokens_per_step / max(total_seconds - eval_seconds, 1e-9),
        "peak_rss_bytes": int(peak),
    })
    if rank == 0:
        out = Path(cfg.out)
        write_json(out / "summary.json", summary)
        plot(out, rec.rows, unigram, title)
        summary.update(metrics_path=str(out / "metrics.jsonl"), plot_path=str(out / "loss.png"),
                       summary_path=str(out / "summary.json"))
    return summary


# ---------------------------------------------------------------------------------------------------- launcher
def launch(cfg: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """:func:`fgdiloco.pretrain.launcher.launch` (kept here for existing imports)."""
    from .launcher import launch as _launch

    return _launch(cfg, **kwargs)
