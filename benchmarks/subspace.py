"""Subspace compression of stage-boundary activations: bytes on the wire and the loss the constraint costs.

Run from the repository root::

    python -m benchmarks.subspace                  # the real 2 replicas x 2 stages on 4 Gloo ranks (below)
    python -m benchmarks.subspace --steps 40       # smoke run
    python -m benchmarks.subspace --simulated      # single process, two simulated stages, 2 seeds (the first
                                                   # version of this benchmark; 29 minutes here)

**Default: 2 replicas × 2 stages** (``--out benchmarks/results/subspace_pipeline.json``). The example GPT on the
bundled text (``benchmarks.pipeline``'s set-up: 4 layers, d = 128, BPE vocabulary 1024, context 64) on 4 real Gloo
ranks (fork + TCPStore): each rank builds its stage with :func:`fgdiloco.pretrain.model.build_stage`, runs it in a
:class:`fgdiloco.pipeline.Pipeline` (1F1B, 4 microbatches) with
:func:`~fgdiloco.pretrain.model.activation_codec_for` as the activation codec, and FG-DiLoCo (``mesh=...``, random
topology, default codecs, H = 20) gossips each stage with the other replica's. Unconstrained (``GPT(config)``, the
stream x travels) and k ∈ {d/4, d/8, d/16} (``subspace_rank=k``, c travels; the last stage's untied head dense,
``GPT.split``'s default; and k = d/8 once more with the head constrained like the tied one, ``--subspace-head``) see
the same batches in the same order, the same steps, so the same tokens. The bytes are those the pipeline measured on
the wire (``PipelineStats``: forward activations sent by stage 0, gradients sent back by stage 1, per step and
replica), against the uncompressed boundary in fp32 and bf16; the token ids never travel (every stage reads the
batch). Held-out loss: through the pipeline, fixed held-out batches, mean over the replicas, at the end. Wall time
per step: median over steps (the first, with the schedule's shape inference, left out) of pipeline step + optimiser
step, the slower stage; the machine is shared, so only the bytes and losses are clean.

**``--simulated``** (``--out benchmarks/results/subspace.json``): the example GPT (``fgdiloco pretrain``'s
architecture: 4 pre-norm blocks, d = 128, 4 heads, the bundled corpus with its 2048-token BPE) is trained once
unconstrained and once per subspace rank k (``GPT(config, subspace_rank=k)``, Ramasinghe et al., "Subspace
Networks", arXiv 2506.01260) with the same seed, the same batches in the same order, the same number of steps (so
the same tokens) and ``fgdiloco pretrain``'s inner optimiser (AdamW, warm-up then cosine, clipping). Single process,
as two simulated pipeline stages: blocks ``[0, L/2)``, then the boundary, then blocks ``[L/2, L)`` and the head. The
unconstrained model sends ``x`` (d numbers per token) across the boundary, the subspace model sends ``c = Uᵀ(x −
E_fix[tokens])`` (k numbers per token) through :meth:`~fgdiloco.pipeline.subspace.SubspaceCodec.boundary_out` /
``boundary_in``; backward, ``∂L/∂x`` (d per token) or ``∂L/∂c`` (k per token) comes back. The bytes reported are
those of the tensors that actually cross, per optimiser step and boundary, fp32, against the uncompressed boundary
in fp32 and in bf16; token ids do not travel (every stage reads the batch; with int32 ids sent along, add 4 bytes
per token forward: the ``ratio_fp32_with_ids`` column).

Reported per variant: held-out loss at equal tokens (mean over fixed validation batches, at the end and along the
way; per seed and the mean over seeds), its ratio to the unconstrained run (of the means, and per seed: at this
token budget the seed-to-seed spread is of the order of the effect, so look at both), bytes per step, the ratios,
trainable parameters, wall time per step (on a shared machine: indicative only), the process's CPU time, and the
largest out-of-subspace component of the residual stream at any block boundary at the end (float rounding only).
Results go to ``benchmarks/results/subspace.json``; the README quotes both tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from fgdiloco.pipeline.subspace import SubspaceCodec
from fgdiloco.pretrain.data import (
    build_tokenizer,
    cache_dir_for,
    encode_corpus,
    load_text,
    sample_batch,
    split_tokens,
    unigram_loss,
)
from fgdiloco.pretrain.model import GPT, GPTConfig
from fgdiloco.pretrain.recipe import clip_gradients, inner_optimizer, next_batch
from fgdiloco.pretrain.worker import TrainConfig

RESULTS = Path(__file__).resolve().parent / "results"


def two_stage_step(model: GPT, idx: torch.Tensor, targets: torch.Tensor, codec: SubspaceCodec | None,
                   cut: int) -> tuple[float, int, int]:
    """One forward + backward of ``model`` split after block ``cut`` into two simulated stages; returns
    ``(loss, bytes forward, bytes backward)`` of what crossed the boundary. Gradients accumulate in ``model``."""
    t = model.transformer
    pos = torch.arange(idx.shape[1])
    x = t.drop(t.wte(idx) + t.wpe(pos))
    for block in t.h[:cut]:
        x = block(x)
    sent = x if codec is None else codec.boundary_out(x, idx)  # stage 0's output
    received = sent.detach().requires_grad_()  # the wire
    x = received if codec is None else codec.boundary_in(received, idx)
    for block in t.h[cut:]:
        x = block(x)
    logits = model.lm_head(t.ln_f(x))
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()  # stage 1
    sent.backward(received.grad)  # stage 0, from the gradient that came back
    grad = received.grad
    return float(loss.detach()), sent.numel() * sent.element_size(), grad.numel() * grad.element_size()


@torch.no_grad()
def held_out_loss(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    loss = sum(float(model(x, y)[1]) for x, y in batches) / len(batches)
    model.train()
    return loss


def run_variant(k: int | None, cfg: TrainConfig, data: dict, eval_every: int) -> dict:
    gcfg = GPTConfig(data["vocab_size"], cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout)
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg, subspace_rank=k, subspace_seed=cfg.seed)
    codec = None if k is None else model.subspace_codec(check=False)  # checked at the end, see below
    opt = inner_optimizer(model, cfg)
    g = torch.Generator().manual_seed(cfg.seed)  # the same batches, in the same order, for every variant
    curve, fwd, bwd, seconds = [], [], [], []
    for step in range(cfg.steps):
        x, y = next_batch(opt, cfg, step, data["train"], g)
        t0 = time.perf_counter()
        loss, f, b = two_stage_step(model, x, y, codec, cfg.n_layer // 2)
        clip_gradients(model.parameters(), cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        fwd.append(f)
        bwd.append(b)
        if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
            curve.append({"step": step + 1, "tokens": (step + 1) * cfg.batch_size * cfg.block_size,
                          "train_loss": loss, "held_out_loss": held_out_loss(model, data["val_batches"])})
            print(f"  k={k}: step {step + 1}/{cfg.steps} train {loss:.4f} held-out {curve[-1]['held_out_loss']:.4f}"
                  f" ({statistics_ms(seconds):.0f} ms/step)", flush=True)
    worst = None
    if k is not None:  # the reparametrisation keeps the stream in the subspace: measure it on validation data
        found = model.check_subspace(data["val_batches"][0][0])
        worst = max(r.max_relative for _, r in found)
    d = cfg.n_embd
    tokens_step = cfg.batch_size * cfg.block_size
    dense_fp32 = 2 * tokens_step * d * 4
    sent = fwd[-1] + bwd[-1]
    return {
        "k": k, "label": "unconstrained" if k is None else f"k=d/{d // k}" if d % k == 0 else f"k={k}",
        "steps": cfg.steps, "tokens": cfg.steps * tokens_step, "held_out_loss": curve[-1]["held_out_loss"],
        "curve": curve, "trainable_parameters": sum(p.numel() for p in model.parameters()),
        "bytes_forward_per_step": fwd[-1], "bytes_backward_per_step": bwd[-1], "bytes_per_step": sent,
        "ratio_fp32": dense_fp32 / sent, "ratio_bf16": dense_fp32 / 2 / sent,
        "ratio_fp32_with_ids": dense_fp32 / (sent + (4 * tokens_step if k is not None else 0)),
        "ms_per_step": statistics_ms(seconds), "max_out_of_subspace": worst,
    }


def statistics_ms(seconds: list[float]) -> float:
    tail = sorted(seconds[len(seconds) // 5:] or seconds)  # skip warm-up, median of the rest
    return 1000 * tail[len(tail) // 2]


def load_data(cfg: TrainConfig, eval_batches: int) -> dict:
    text = load_text(cfg.data)
    cache = cache_dir_for(cfg.data, cfg.cache_dir)
    tok = build_tokenizer(text, cfg.tokenizer, cfg.vocab_size, cache_dir=cache)
    train, val = split_tokens(encode_corpus(text, tok, cache_dir=cache), cfg.val_fraction)
    g = torch.Generator().manual_seed(10_000 + cfg.seed)
    val_batches = [sample_batch(val, cfg.batch_size, cfg.block_size, g) for _ in range(eval_batches)]
    return {"train": train, "val": val, "vocab_size": tok.vocab_size, "val_batches": val_batches,
            "unigram": unigram_loss(train, val, tok.vocab_size)}


# ---------------------------------------------------------------------------------------------- 2 x 2 pipeline
def _pipeline_worker(rank: int, world: int, k: int | None, head: str, cfg: dict) -> dict:
    from benchmarks.pipeline import _data
    from fgdiloco import FGDiLoCo, ReplicaMesh
    from fgdiloco.pipeline import Pipeline
    from fgdiloco.pretrain import activation_codec_for, build_stage, lm_loss

    train, val, vocab = _data(cfg["vocab"])
    gcfg = GPTConfig(vocab_size=vocab, block_size=cfg["block"], n_layer=cfg["layers"], n_head=4, n_embd=cfg["width"])
    mesh = ReplicaMesh(2, 2, timeout=120.0)
    stage = build_stage(gcfg, 2, mesh.stage, subspace_rank=k, subspace_seed=cfg["seed"], seed=cfg["seed"],
                        subspace_head=head)
    codec = activation_codec_for(stage)  # None for the plain model; checks the subspace at every boundary
    pipe = Pipeline(stage, mesh, lm_loss, cfg["microbatches"], "1f1b", activation_codec=codec)
    opt = FGDiLoCo(stage, torch.optim.AdamW(stage.parameters(), lr=cfg["lr"]), sync_every=cfg["sync_every"],
                   topology="random", outer_momentum=0.3, mesh=mesh, timeout=120.0, seed=cfg["seed"])
    held_out = [sample_batch(val, 16, cfg["block"], torch.Generator().manual_seed(10_000 + i))
                for i in range(cfg["eval_batches"])]
    gen = torch.Generator().manual_seed(1000 * cfg["seed"] + mesh.replica)  # the same batches for every variant
    seconds, fwd, bwd, received = [], [], [], []
    t_start = time.perf_counter()
    for _ in range(cfg["steps"]):
        x, y = sample_batch(train, cfg["batch"], cfg["block"], gen)  # every stage reads the batch itself
        t0 = time.perf_counter()
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - t0)
        fwd.append(pipe.last_step.forward_bytes_sent)
        bwd.append(pipe.last_step.backward_bytes_sent)
        received.append(pipe.last_step.bytes_received)
    wall = time.perf_counter() - t_start
    losses = [pipe.eval_loss(x, y) for x, y in held_out]
    opt.close()
    return {
        "replica": mesh.replica, "stage": mesh.stage, "wall_seconds": wall,
        "held_out_loss": None if losses[0] is None else sum(float(v) for v in losses) / len(losses),
        "ms_per_step": 1000 * statistics.median(seconds[1:] or seconds),
        "forward_bytes": sorted(set(fwd)), "backward_bytes": sorted(set(bwd)), "received_bytes": sorted(set(received)),
        "activation_bytes_total": pipe.activation_bytes_sent_total,
        "trainable_parameters": sum(p.numel() for p in stage.parameters()),
    }


def run_pipeline_variant(k: int | None, head: str, cfg: dict) -> dict:
    from tests.distributed import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        rows = run_ranks(_pipeline_worker, 4, tmp, k, head, cfg, store="tcp", timeout=3600)
    d, tokens_step = cfg["width"], cfg["batch"] * cfg["block"]  # per replica and step
    first = [r for r in rows if r["stage"] == 0]
    last = [r for r in rows if r["stage"] == 1]
    # measured: what stage 0 sent forward and stage 1 sent back, per step; constant over steps and replicas
    (fwd,) = {b for r in first for b in r["forward_bytes"]}
    (bwd,) = {b for r in last for b in r["backward_bytes"]}
    dense_fp32 = 2 * tokens_step * d * 4
    losses = [r["held_out_loss"] for r in last]
    label = "unconstrained" if k is None else f"k=d/{d // k}" if d % k == 0 else f"k={k}"
    return {
        "k": k, "label": label + (", subspace head" if k is not None and head == "subspace" else ""),
        "head": head, "tokens": cfg["steps"] * 2 * tokens_step, "held_out_loss": statistics.mean(losses),
        "held_out_loss_per_replica": losses, "bytes_forward_per_step": fwd, "bytes_backward_per_step": bwd,
        "bytes_per_step": fwd + bwd, "ratio_fp32": dense_fp32 / (fwd + bwd), "ratio_bf16": dense_fp32 / 2 / (fwd + bwd),
        "ms_per_step": max(r["ms_per_step"] for r in rows), "wall_seconds": max(r["wall_seconds"] for r in rows),
        "trainable_parameters": sum(r["trainable_parameters"] for r in rows if r["replica"] == 0),
        "workers": rows,
    }


def main_pipeline(args: argparse.Namespace, argv: list[str] | None) -> dict:
    from benchmarks.pipeline import _data

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = {"steps": args.steps, "sync_every": args.sync_every, "batch": args.batch_size, "microbatches": 4,
           "block": args.block_size, "layers": 4, "width": 128, "vocab": 1024, "lr": 1e-3,
           "eval_batches": args.eval_batches, "seed": args.seeds[0]}
    train, val, vocab = _data(cfg["vocab"])  # builds the tokenizer cache once, before the ranks fork
    runs: list[tuple[int | None, str]] = [(None, "dense")] + [(cfg["width"] // q, "dense") for q in args.divisors]
    runs += [(cfg["width"] // q, "subspace") for q in args.subspace_head]
    t0 = time.perf_counter()
    variants = []
    for k, head in runs:
        print(f"2 x 2 pipeline, {'unconstrained' if k is None else f'k={k}, {head} head'} ...", flush=True)
        variants.append(run_pipeline_variant(k, head, cfg))
        v = variants[-1]
        print(f"  held-out {v['held_out_loss']:.4f}, {v['bytes_per_step']:,} B/step, {v['ms_per_step']:.0f} ms/step",
              flush=True)
    ref = variants[0]
    for v in variants:
        v["loss_ratio"] = v["held_out_loss"] / ref["held_out_loss"]
    out = {
        "command": "python -m benchmarks.subspace " + " ".join(argv if argv is not None else sys.argv[1:]),
        "layout": "2 replicas x 2 stages, 4 Gloo ranks (fork + TCPStore), Pipeline 1F1B + FGDiLoCo(mesh=...)",
        "config": {**cfg, "vocab_size": vocab, "n_head": 4, "topology": "random", "outer_momentum": 0.3,
                   "tokens_per_step_per_replica": cfg["batch"] * cfg["block"]},
        "unigram_loss": unigram_loss(train, val, vocab),
        "seconds_total": time.perf_counter() - t0, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
        "note": "bytes measured by Pipeline (PipelineStats) on the wire; wall times on a shared 2-core machine "
                "under load from other jobs: indicative only",
        "variants": variants,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{'variant':<26}{'held-out':>10}{'vs unc.':>9}{'bytes/step':>12}{'vs fp32':>9}{'vs bf16':>9}"
          f"{'ms/step':>9}")
    for v in variants:
        print(f"{v['label']:<26}{v['held_out_loss']:>10.4f}{v['loss_ratio']:>9.3f}{v['bytes_per_step']:>12,}"
              f"{v['ratio_fp32']:>8.1f}x{v['ratio_bf16']:>8.1f}x{v['ms_per_step']:>9.0f}")
    print(f"unigram baseline {out['unigram_loss']:.4f}; {out['seconds_total']:.0f} s; wrote {args.out}")
    if not all(math.isfinite(v["held_out_loss"]) for v in variants):
        raise SystemExit("a run diverged")
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulated", action="store_true",
                   help="single process, two simulated stages (the first version); default: the real 2 x 2 run")
    p.add_argument("--sync-every", type=int, default=20, help="2 x 2: inner steps per outer round")
    p.add_argument("--subspace-head", type=int, nargs="*", default=[8],
                   help="2 x 2: divisors also run with the last stage's head constrained like the tied one "
                        "(GPT.split(subspace_head='subspace')); the other runs use the dense untied head")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps per variant (equal tokens; default 200 for 2 x 2, 300 simulated)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per replica and step (16; 8 simulated)")
    p.add_argument("--block-size", type=int, default=None, help="context (64; 128 simulated)")
    p.add_argument("--divisors", type=int, nargs="+", default=[4, 8, 16], help="k = n_embd / divisor")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="one run per seed and variant (model init, U / E_fix and batch order); default 0 for 2 x 2 "
                        "(only the first is used there), 0 1 simulated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/subspace_pipeline.json (2 x 2), subspace.json (simulated)")
    args = p.parse_args(argv)
    sim = args.simulated
    defaults = {"steps": 300 if sim else 200, "batch_size": 8 if sim else 16, "block_size": 128 if sim else 64,
                "seeds": [0, 1] if sim else [0],
                "out": RESULTS / ("subspace.json" if sim else "subspace_pipeline.json")}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    torch.set_num_threads(args.threads)
    if not sim:
        return main_pipeline(args, argv)
    base = TrainConfig()
    cfg = replace(base, steps=args.steps, batch_size=args.batch_size, block_size=args.block_size,
                  warmup_steps=min(base.warmup_steps, max(args.steps // 10, 1))).validate()
    data = load_data(cfg, args.eval_batches)  # the validation batches are the same for every seed
    ranks: list[int | None] = [None] + [cfg.n_embd // q for q in args.divisors]
    t0, cpu0 = time.perf_counter(), time.process_time()
    runs: dict[int | None, list[dict]] = {k: [] for k in ranks}
    for seed in args.seeds:
        for k in ranks:
            print(f"training {'unconstrained' if k is None else f'k={k}'}, seed {seed} ...", flush=True)
            runs[k].append(run_variant(k, replace(cfg, seed=seed), data, args.eval_every))
    variants = []
    for k in ranks:
        v = dict(runs[k][0])  # bytes, parameters and layout do not depend on the seed
        v["held_out_losses"] = [r["held_out_loss"] for r in runs[k]]
        v["held_out_loss"] = sum(v["held_out_losses"]) / len(args.seeds)
        v["curves"] = [r["curve"] for r in runs[k]]
        del v["curve"]
        v["ms_per_step"] = sorted(r["ms_per_step"] for r in runs[k])[len(args.seeds) // 2]
        worst = [r["max_out_of_subspace"] for r in runs[k] if r["max_out_of_subspace"] is not None]
        v["max_out_of_subspace"] = max(worst) if worst else None
        variants.append(v)
    ref = variants[0]
    for v in variants:
        v["loss_ratio"] = v["held_out_loss"] / ref["held_out_loss"]
        v["loss_ratio_per_seed"] = [a / b for a, b in zip(v["held_out_losses"], ref["held_out_losses"])]
    out = {
        "command": "python -m benchmarks.subspace " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                   "vocab_size": data["vocab_size"], "block_size": cfg.block_size, "batch_size": cfg.batch_size,
                   "steps": cfg.steps, "lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "seeds": args.seeds,
                   "stages": 2, "boundary_after_block": cfg.n_layer // 2, "eval_batches": args.eval_batches,
                   "threads": args.threads},
        "unigram_loss": data["unigram"],
        "seconds_total": time.perf_counter() - t0,
        "cpu_seconds_total": time.process_time() - cpu0,
        "note": "single process, two simulated stages; wall times measured on a shared 2-core machine under load",
        "variants": variants,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{'variant':<14}{'held-out':>10}{'vs unc.':>9}{'per seed':>16}{'bytes/step':>12}{'vs fp32':>9}"
          f"{'vs bf16':>9}{'ms/step':>9}")
    for v in variants:
        per_seed = " ".join(f"{r:.3f}" for r in v["loss_ratio_per_seed"])
        print(f"{v['label']:<14}{v['held_out_loss']:>10.4f}{v['loss_ratio']:>9.3f}{per_seed:>16}"
              f"{v['bytes_per_step']:>12,}{v['ratio_fp32']:>8.1f}x{v['ratio_bf16']:>8.1f}x{v['ms_per_step']:>9.0f}")
    print(f"unigram baseline {data['unigram']:.4f}; wrote {args.out}")
    if not all(math.isfinite(v["held_out_loss"]) for v in variants):
        raise SystemExit("a run diverged")
    return out


if __name__ == "__main__":
    main()
