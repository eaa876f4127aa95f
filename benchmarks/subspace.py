"""Subspace compression of stage-boundary activations: what it saves (bytes) and what it costs (loss), with seeds.

Run from the repository root (one thread per process; on a shared machine under ``nice``)::

    python -m benchmarks.subspace --jobs 2               # the measurement below (62 min on 2 shared cores)
    python -m benchmarks.subspace --steps 40 --seeds 0   # smoke run
    python -m benchmarks.subspace --pipeline             # the earlier real 2 x 2 Gloo run (width 128, 1 seed)

**Set-up (default).** :data:`WIDE`: the example GPT made wider, so that 32x and 64x compression leave a usable rank
(d = 256: k = 8 at d/32, k = 4 at d/64; the width-128 example would have k = 4 at 32x): 4 pre-norm blocks, width
256, 4 heads, context 64, the bundled corpus with a 1024-token BPE (about 0.82 M training tokens, 43 k held out),
3.7 M parameters (the untied head included). Each variant is ``GPT(config, subspace_rank=k,
subspace_stages=2).split(2)`` (:mod:`fgdiloco.pretrain.model`; Ramasinghe et al., "Subspace Networks", arXiv
2506.01260): stage 0 holds the embeddings and blocks 0-1, which write through the d × k basis ``U``; stage 1 holds
blocks 2-3 (plain: nothing they write crosses a boundary) and the untied dense head. The unconstrained model is
``GPT(config).split(2)``, so both have the same untied head and differ only in the constraint. Both stages run in
**one process, as two simulated stages** (:func:`two_stage_step`): stage 0's output crosses a simulated wire as
``x`` (d numbers per token, unconstrained) or as ``c = Uᵀ(x − E_fix[tokens])`` (k per token) through
:meth:`~fgdiloco.pipeline.subspace.SubspaceCodec.boundary_out` / ``boundary_in``; backward, ``∂L/∂x`` or ``∂L/∂c``
comes back. This is the computation :class:`fgdiloco.pipeline.Pipeline` runs with
:func:`~fgdiloco.pretrain.model.activation_codec_for` (tested equal in ``tests/test_pipeline_subspace.py``), without
the processes.

Training: ``fgdiloco pretrain``'s inner recipe (:mod:`fgdiloco.pretrain.recipe`: AdamW (0.9, 0.95), weight decay
0.1 on matrices, linear warm-up over 50 steps then cosine decay to 0.1 of lr 2e-3, gradient clipping at 1.0),
batches of 16 × 64 tokens; ``--steps`` (1000) steps, so **equal tokens** for every variant (1.02 M, 1.25 passes
over the training split). Seeds 0, 1, 2: the seed sets the initialisation, ``U`` / ``E_fix`` and the batch order;
a seed's batches are the same for every variant. Why 1000 steps: with fewer, the unconstrained seeds disagree by
more than 1 % (three seeds, each run to the end of its own schedule: 1.5 % apart at 600 steps, on 32 k random
held-out tokens; 0.25 % at 1000; the mid-schedule points of the 1000-step runs spread 0.9-2.9 %). Held-out loss:
mean next-token cross-entropy over the first 640 non-overlapping 64-token windows of the held-out split (40,960
tokens, the same for every run), through the two stages and the codec.

Bytes: those of the tensors that actually cross the boundary per optimiser step (fp32), forward and backward; the
token ids do not travel (every stage reads the batch). **Equal wall time over a 100 Mbit/s link** is a model, not
a measurement: a step takes ``compute + (forward + backward bytes) / link`` seconds, where ``compute`` is the
process CPU time of the step measured here (forward, backward and optimiser of both stages, one thread:
insensitive to other jobs' load, unlike wall time) and the link carries both directions one after the other at
``--link-mbit`` (100). Both stages' compute is counted in series (no pipeline overlap), which understates what
compression gains. For each divisor in ``--equal-time`` (8, 32) the unconstrained model is trained again, with its
own schedule, for the steps that fit into the subspace run's modelled time (``N · t_k / t_dense``), and the two
held-out losses are compared at that equal time.

Results go to ``benchmarks/results/subspace.json`` (``--out``); keys:

* ``command``, ``config`` (model, data, schedule, steps, seeds, stages, ``boundary_after_block``, evaluation,
  ``link_mbit_s``), ``unigram_loss`` (context-free baseline), ``seconds_total`` (wall) / ``cpu_seconds_total``
  (all processes) of this run, ``jobs`` (``--jobs``: runs at once, in forked processes), ``load_average`` (at the
  end), ``note``.
* ``variants``: one per model, ``k`` (None: unconstrained), ``label``, ``compression`` (d / k), ``steps``,
  ``tokens``; ``held_out_losses`` (per seed) and their ``held_out_loss_mean`` / ``_std`` (sample std) / ``_min`` /
  ``_max``, ``spread`` ((max − min) / mean over seeds); ``loss_ratio`` (mean / unconstrained mean),
  ``loss_ratio_per_seed`` (paired by seed); ``bytes_forward_per_step`` / ``bytes_backward_per_step`` /
  ``bytes_per_step``, ``ratio_fp32`` (the unconstrained boundary's bytes / these, both directions);
  ``compute_seconds_per_step`` (median over steps and seeds), ``link_seconds_per_step``,
  ``modelled_seconds_per_step`` and ``modelled_seconds`` (the whole run); ``trainable_parameters``;
  ``max_out_of_subspace`` (largest out-of-subspace component of stage 0's output, relative, at the end: float
  rounding only); ``curves`` (per seed: ``step``, ``tokens``, ``train_loss``, ``held_out_loss``).
* ``equal_wall_time``: per divisor in ``--equal-time``, ``k``, ``label``, ``modelled_seconds`` (the subspace
  run's), ``subspace_steps``, ``subspace_held_out_losses`` and their mean, ``unconstrained_steps`` (that fit in
  the same modelled time), ``unconstrained_held_out_losses`` and their mean / min / max, ``subspace_lower``.
* ``targets``: what issue 20 asked for, each ``name``, ``value``, ``target``, ``met``.

``--pipeline`` keeps the earlier real run (2 replicas x 2 stages on 4 Gloo ranks, FG-DiLoCo, width 128, one
seed; ``benchmarks/results/subspace_pipeline.json``), now with the stages built for their split.
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
from torch import nn

from fgdiloco.pretrain.config import TrainConfig
from fgdiloco.pretrain.data import sample_batch, unigram_loss
from fgdiloco.pretrain.model import GPT, GPTConfig, two_stage_loss, two_stage_step
from fgdiloco.pretrain.recipe import clip_gradients, inner_optimizer, next_batch

RESULTS = Path(__file__).resolve().parent / "results"

# The wider example configuration: width 256 keeps k = 8 at 32x and k = 4 at 64x compression; CPU-sized (3.7 M
# parameters with the 1024-token BPE and the untied head, about 0.25 s per step of 16 x 64 tokens on one core).
WIDE = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 64, "vocab": 1024}
STAGES = 2


def held_out_windows(val: torch.Tensor, block: int, windows: int, per_batch: int = 64
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``windows`` non-overlapping ``block``-token windows of ``val`` (and their next-token targets), in
    batches of ``per_batch``: the same held-out tokens for every run."""
    windows = min(windows, (val.numel() - 1) // block)
    x = val[: windows * block].view(windows, block).long()
    y = val[1: windows * block + 1].view(windows, block).long()
    return [(x[i:i + per_batch], y[i:i + per_batch]) for i in range(0, windows, per_batch)]


def label_of(k: int | None, d: int) -> str:
    return "unconstrained" if k is None else f"k=d/{d // k}" if d % k == 0 else f"k={k}"


def train_run(k: int | None, seed: int, cfg: TrainConfig, data: dict, evals: int) -> dict:
    """One run of ``cfg.steps`` steps: the variant ``k`` (None: unconstrained) with ``seed``."""
    gcfg = GPTConfig(data["vocab_size"], cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout)
    torch.manual_seed(seed)
    model = GPT(gcfg, subspace_rank=k, subspace_seed=seed, subspace_stages=None if k is None else STAGES,
                stage_embeddings=k is not None and cfg.stage_embeddings)
    stages = model.split(STAGES)
    del model
    codec = None if k is None else stages[0].subspace_codec(check=False)  # measured at the end, see below
    holder = nn.ModuleList(stages)
    opt = inner_optimizer(holder, cfg)
    g = torch.Generator().manual_seed(seed)  # a seed's batches, in the same order for every variant
    every = max(cfg.steps // evals, 1)
    curve, cpu, fwd, bwd = [], [], 0, 0
    for step in range(cfg.steps):
        x, y = next_batch(opt, cfg, step, data["train"], g)
        c0 = time.process_time()
        loss, fwd, bwd = two_stage_step(stages, x, y, codec)
        clip_gradients(holder.parameters(), cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        cpu.append(time.process_time() - c0)
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            curve.append({"step": step + 1, "tokens": (step + 1) * cfg.batch_size * cfg.block_size,
                          "train_loss": loss, "held_out_loss": two_stage_loss(stages, codec, data["held_out"])})
            print(f"  {label_of(k, cfg.n_embd)} seed {seed}: step {step + 1}/{cfg.steps} train {loss:.4f} "
                  f"held-out {curve[-1]['held_out_loss']:.4f} ({1000 * statistics.median(cpu):.0f} ms CPU/step)",
                  flush=True)
    worst = None
    if codec is not None:  # stage 0's output is in the subspace (float rounding): the boundary lost nothing
        idx = data["held_out"][0][0]
        with torch.no_grad():
            worst = codec.residual(stages[0](idx), idx).max_relative
    return {"held_out_loss": curve[-1]["held_out_loss"], "curve": curve, "cpu": cpu[len(cpu) // 10:] or cpu,
            "bytes_forward": fwd, "bytes_backward": bwd, "max_out_of_subspace": worst,
            "trainable_parameters": sum(p.numel() for p in holder.parameters())}


_DATA: dict = {}  # the data of the parent, inherited by the forked job processes
_CHILD_CPU = [0.0]  # CPU seconds of the runs done in job processes


def _job(job: tuple[int | None, int, TrainConfig], evals: int) -> dict:
    k, seed, cfg = job
    torch.set_num_threads(1)
    c0 = time.process_time()
    print(f"training {label_of(k, cfg.n_embd)}, seed {seed}, {cfg.steps} steps ...", flush=True)
    out = train_run(k, seed, cfg, _DATA, evals)
    out["process_cpu"] = time.process_time() - c0
    return out


def _run_all(jobs: list[tuple[int | None, int, TrainConfig]], data: dict, evals: int, workers: int) -> list[dict]:
    """The results of every ``(k, seed, cfg)`` of ``jobs``, in order (independent, seeded runs: the result does not
    depend on where or in which order they run), in ``workers`` forked processes (1: here)."""
    _DATA.update(data)
    if workers <= 1:
        return [_job(job, evals) for job in jobs]
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        out = [f.result() for f in [pool.submit(_job, job, evals) for job in jobs]]
    _CHILD_CPU[0] += sum(r["process_cpu"] for r in out)
    return out


def _stats(values: list[float]) -> dict:
    mean = statistics.fmean(values)
    return {"mean": mean, "std": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values),
            "max": max(values), "spread": (max(values) - min(values)) / mean}


def summarise_variant(k: int | None, runs: list[dict], cfg: TrainConfig, link_bytes_per_s: float) -> dict:
    losses = [r["held_out_loss"] for r in runs]
    s = _stats(losses)
    fwd, bwd = runs[0]["bytes_forward"], runs[0]["bytes_backward"]  # static shapes: the same every step and seed
    compute = statistics.median([c for r in runs for c in r["cpu"]])
    link = (fwd + bwd) / link_bytes_per_s
    worst = [r["max_out_of_subspace"] for r in runs if r["max_out_of_subspace"] is not None]
    d = cfg.n_embd
    return {
        "k": k, "label": label_of(k, d), "compression": 1.0 if k is None else d / k, "steps": cfg.steps,
        "tokens": cfg.steps * cfg.batch_size * cfg.block_size, "held_out_losses": losses,
        "held_out_loss_mean": s["mean"], "held_out_loss_std": s["std"], "held_out_loss_min": s["min"],
        "held_out_loss_max": s["max"], "spread": s["spread"],
        "bytes_forward_per_step": fwd, "bytes_backward_per_step": bwd, "bytes_per_step": fwd + bwd,
        "compute_seconds_per_step": compute, "link_seconds_per_step": link,
        "modelled_seconds_per_step": compute + link, "modelled_seconds": cfg.steps * (compute + link),
        "trainable_parameters": runs[0]["trainable_parameters"],
        "max_out_of_subspace": max(worst) if worst else None, "curves": [r["curve"] for r in runs],
    }


def load_data(vocab: int, block: int, windows: int) -> dict:
    from benchmarks.pipeline import _data

    train, val, vocab_size = _data(vocab)
    return {"train": train, "val": val, "vocab_size": vocab_size, "held_out": held_out_windows(val, block, windows),
            "unigram": unigram_loss(train, val, vocab_size)}


def _targets(variants: list[dict], equal: list[dict], d: int) -> list[dict]:
    by = {v["k"]: v for v in variants}
    ref = by[None]
    out = [{"name": "unconstrained seeds agree within 1 %", "value": ref["spread"], "target": "< 0.01",
            "met": ref["spread"] < 0.01}]

    def gap(q: int) -> float | None:
        v = by.get(d // q)
        return None if v is None else v["loss_ratio"] - 1

    for q, limit in ((32, 0.03), (64, 0.05)):
        g = gap(q)
        if g is not None:
            out.append({"name": f"k=d/{q}: held-out loss within {limit:.0%} of unconstrained (mean of seeds)",
                        "value": g, "target": f"<= {limit}", "met": g <= limit})
    if d // 32 in by:
        v = by[d // 32]
        out.append({"name": "k=d/32: 32x fewer boundary bytes both ways",
                    "value": [ref["bytes_forward_per_step"] / v["bytes_forward_per_step"],
                              ref["bytes_backward_per_step"] / v["bytes_backward_per_step"]],
                    "target": "[32, 32]", "met": v["bytes_forward_per_step"] * 32 == ref["bytes_forward_per_step"]
                    and v["bytes_backward_per_step"] * 32 == ref["bytes_backward_per_step"]})
    g = gap(8)
    if g is not None:
        out.append({"name": "k=d/8: gap below the unconstrained seed spread", "value": g,
                    "target": f"< {ref['spread']:.4f}", "met": g < ref["spread"]})
    for e in equal:
        out.append({"name": f"{e['label']}: lower held-out loss than unconstrained at equal modelled wall time",
                    "value": [e["subspace_held_out_loss_mean"], e["unconstrained_held_out_loss_mean"]],
                    "target": "first < second", "met": e["subspace_lower"]})
    return out


def main_simulated(args: argparse.Namespace, argv: list[str] | None) -> dict:
    base = TrainConfig()
    cfg = replace(base, steps=args.steps, batch_size=args.batch_size, block_size=WIDE["block_size"],
                  n_layer=WIDE["n_layer"], n_head=WIDE["n_head"], n_embd=args.width, lr=args.lr,
                  warmup_steps=min(args.warmup_steps, max(args.steps // 10, 1)), min_lr_ratio=0.1,
                  vocab_size=WIDE["vocab"], stage_embeddings=not args.no_stage_embeddings).validate()
    data = load_data(WIDE["vocab"], cfg.block_size, args.held_out_windows)
    d = cfg.n_embd
    ranks: list[int | None] = [None] + [d // q for q in args.divisors]
    link = args.link_mbit * 1e6 / 8
    t0, cpu0 = time.perf_counter(), time.process_time()
    jobs = [(k, seed, replace(cfg, seed=seed)) for k in ranks for seed in args.seeds]
    done = iter(_run_all(jobs, data, args.evals, args.jobs))
    runs = {k: [next(done) for _ in args.seeds] for k in ranks}
    variants = [summarise_variant(k, runs[k], cfg, link) for k in ranks]
    ref = variants[0]
    for v in variants:
        v["loss_ratio"] = v["held_out_loss_mean"] / ref["held_out_loss_mean"]
        v["loss_ratio_per_seed"] = [a / b for a, b in zip(v["held_out_losses"], ref["held_out_losses"])]
        v["ratio_fp32"] = ref["bytes_per_step"] / v["bytes_per_step"]
    # equal modelled wall time: the unconstrained model again, for the steps that fit in each subspace run's time
    compared = [v for q in args.equal_time for v in variants if v["k"] == d // q]
    plans = []
    for v in compared:
        steps = max(1, round(cfg.steps * v["modelled_seconds_per_step"] / ref["modelled_seconds_per_step"]))
        plans.append((v, replace(cfg, steps=steps, warmup_steps=min(cfg.warmup_steps, max(steps // 10, 1)))))
        print(f"equal time of {v['label']}: the unconstrained model for {steps} steps", flush=True)
    done = iter(_run_all([(None, seed, replace(short, seed=seed)) for _, short in plans for seed in args.seeds],
                         data, args.evals, args.jobs))
    equal = []
    for v, short in plans:
        unc = [next(done) for _ in args.seeds]
        s = _stats([r["held_out_loss"] for r in unc])
        equal.append({"k": v["k"], "label": v["label"], "link_mbit_s": args.link_mbit,
                      "modelled_seconds": v["modelled_seconds"], "subspace_steps": cfg.steps,
                      "subspace_held_out_losses": v["held_out_losses"],
                      "subspace_held_out_loss_mean": v["held_out_loss_mean"],
                      "unconstrained_steps": short.steps,
                      "unconstrained_modelled_seconds": short.steps * ref["modelled_seconds_per_step"],
                      "unconstrained_held_out_losses": [r["held_out_loss"] for r in unc],
                      "unconstrained_held_out_loss_mean": s["mean"], "unconstrained_held_out_loss_min": s["min"],
                      "unconstrained_held_out_loss_max": s["max"],
                      "subspace_lower": v["held_out_loss_mean"] < s["mean"],
                      "unconstrained_curves": [r["curve"] for r in unc]})
    out = {
        "command": "python -m benchmarks.subspace " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": d, "vocab_size": data["vocab_size"],
                   "block_size": cfg.block_size, "batch_size": cfg.batch_size, "steps": cfg.steps, "lr": cfg.lr,
                   "warmup_steps": cfg.warmup_steps, "min_lr_ratio": cfg.min_lr_ratio,
                   "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip, "seeds": args.seeds,
                   "stages": STAGES, "boundary_after_block": cfg.n_layer // STAGES - 1,
                   "held_out_tokens": sum(y.numel() for _, y in data["held_out"]),
                   "train_tokens": int(data["train"].numel()), "link_mbit_s": args.link_mbit, "threads": 1,
                   "head": "untied, dense (GPT.split's default) for every variant",
                   "stage_embeddings": cfg.stage_embeddings},
        "unigram_loss": data["unigram"],
        "seconds_total": time.perf_counter() - t0, "jobs": args.jobs,
        "cpu_seconds_total": time.process_time() - cpu0 + _CHILD_CPU[0],
        "load_average": os.getloadavg(),
        "note": "single process, two simulated stages (the computation of Pipeline + activation_codec_for); "
                "equal wall time is modelled: measured CPU time per step + boundary bytes / link rate",
        "variants": variants, "equal_wall_time": equal,
    }
    out["targets"] = _targets(variants, equal, d)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    _print_table(out)
    if not all(math.isfinite(v["held_out_loss_mean"]) for v in variants):
        raise SystemExit("a run diverged")
    return out


def _print_table(out: dict) -> None:
    print(f"\n{'variant':<15}{'held-out mean ± std':>22}{'min..max':>17}{'vs unc.':>9}{'per seed':>24}"
          f"{'bytes/step':>12}{'fewer':>8}{'CPU s/step':>11}{'model s/step':>13}")
    for v in out["variants"]:
        per_seed = " ".join(f"{r:.3f}" for r in v["loss_ratio_per_seed"])
        print(f"{v['label']:<15}{v['held_out_loss_mean']:>14.4f} ± {v['held_out_loss_std']:.4f}"
              f"{v['held_out_loss_min']:>9.4f}..{v['held_out_loss_max']:.4f}{v['loss_ratio']:>9.4f}{per_seed:>24}"
              f"{v['bytes_per_step']:>12,}{v['ratio_fp32']:>7.0f}x{v['compute_seconds_per_step']:>11.3f}"
              f"{v['modelled_seconds_per_step']:>13.3f}")
    for e in out["equal_wall_time"]:
        print(f"equal modelled time {e['modelled_seconds']:.0f} s over {e['link_mbit_s']:g} Mbit/s: {e['label']} "
              f"({e['subspace_steps']} steps) {e['subspace_held_out_loss_mean']:.4f} vs unconstrained "
              f"({e['unconstrained_steps']} steps) {e['unconstrained_held_out_loss_mean']:.4f}")
    for t in out["targets"]:
        print(f"{'MET ' if t['met'] else 'MISS'} {t['name']}: {t['value']} (target {t['target']})")
    print(f"unigram baseline {out['unigram_loss']:.4f}; {out['seconds_total']:.0f} s")


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
    from fgdiloco.testing import run_ranks

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
    return {
        "k": k, "label": label_of(k, d) + (", subspace head" if k is not None and head == "subspace" else ""),
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
           "block": 64, "layers": 4, "width": args.width, "vocab": 1024, "lr": 1e-3,
           "eval_batches": 8, "seed": args.seeds[0]}
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
    p.add_argument("--pipeline", action="store_true",
                   help="the earlier real 2 x 2 run on 4 Gloo ranks (default: single process, simulated stages)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps per run (equal tokens; 1000, 2 x 2: 200)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="one run per seed and variant (default 0 1 2; 2 x 2: only the first is used)")
    p.add_argument("--divisors", type=int, nargs="*", default=None,
                   help="k = n_embd / divisor (default 8 32 64; 2 x 2: 4 8 16)")
    p.add_argument("--width", type=int, default=None, help="n_embd (default 256; 2 x 2: 128)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences of 64 tokens per step (and replica)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (simulated)")
    p.add_argument("--warmup-steps", type=int, default=50, help="(simulated; at most a tenth of --steps)")
    p.add_argument("--evals", type=int, default=6, help="held-out evaluations along each run (simulated)")
    p.add_argument("--held-out-windows", type=int, default=640, help="64-token held-out windows (simulated)")
    p.add_argument("--link-mbit", type=float, default=100.0, help="the modelled boundary link, Mbit/s")
    p.add_argument("--equal-time", type=int, nargs="*", default=[8, 32],
                   help="divisors whose equal-wall-time comparison is run (the unconstrained model again)")
    p.add_argument("--sync-every", type=int, default=20, help="2 x 2: inner steps per outer round")
    p.add_argument("--subspace-head", type=int, nargs="*", default=[8],
                   help="2 x 2: divisors also run with the last stage's head constrained like the tied one")
    p.add_argument("--no-stage-embeddings", action="store_true",
                   help="the subspace models without stage embeddings (GPT(stage_embeddings=False)): every stage "
                        "reads the frozen E_fix plus k trained dimensions of the token embedding (simulated)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs in this many forked processes at once, one thread each (simulated; default 1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/subspace.json (2 x 2: subspace_pipeline.json)")
    args = p.parse_args(argv)
    pipe = args.pipeline
    defaults = {"steps": 200 if pipe else 1000, "seeds": [0] if pipe else [0, 1, 2],
                "divisors": [4, 8, 16] if pipe else [8, 32, 64], "width": 128 if pipe else WIDE["n_embd"],
                "out": RESULTS / ("subspace_pipeline.json" if pipe else "subspace.json")}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    torch.set_num_threads(args.threads)
    return main_pipeline(args, argv) if pipe else main_simulated(args, argv)


if __name__ == "__main__":
    main()
