"""Does gossip keep the replicas together over a long run? FG-DiLoCo variants next to DiLoCo for 100+ outer rounds.

Run from the repository root::

    python -m benchmarks.consensus                  # the full study (about 15-20 minutes on 2 cores)
    python -m benchmarks.consensus --quick          # 30 rounds, fewer variants: a smoke run
    python -m benchmarks.consensus --sync-every 10 --variants "FG lowrank" "FG lowrank, F=2, tau=2" \
        "FG lowrank, F=2, tau=2, alpha=0.5"      # Streaming DiLoCo's knobs at H = 10 (about 15 minutes)

1. **Training** (the example GPT, 2 layers of width 64, on the bundled corpus, 4 workers, batches of 16 × 64 tokens,
   H = 5, 100 outer rounds, AdamW inner at lr 3e-3 with clipping at 1.0, Nesterov outer lr 0.7 / momentum 0.9,
   DiLoCo's long-run setting). The workers are threads of this process talking through :class:`fgdiloco.LocalHub`;
   each runs the example job's training loop (:class:`fgdiloco.pretrain.loop.Loop`) with the real
   :class:`fgdiloco.FGDiLoCo` wrapper (:class:`fgdiloco.pretrain.sync.FGDiLoCoSync`) and reports into the variant's
   shared accumulators; every variant starts from the same weights and sees the same batches. Variants: DiLoCo
   (``topology="allreduce"``), FG-DiLoCo with the dense codec and with the default low-rank codec
   (``LowRank(rank=4)``, int8), ``mix2_rounds`` ∈ {0, 1, 2}, each with the outer momentum gossiped in Mix1
   (``mix_momentum=True``, the default) or kept local, and low rank with Streaming DiLoCo's fragments (F = 2),
   overlap (τ) and merge (α) (``--sync-every 10``: H = 10, results in ``consensus_h10.json``; with fragments the
   Mix2 contraction is fragment 0's). Reported per round: held-out loss of each worker and of the
   workers' average model, the disagreement of parameters, pseudo-gradients (before and after Mix2: Mix2's
   contraction on real pseudo-gradients) and outer momentum (RMS per element of ``x_i − x̄`` over all workers, and
   relative to ``‖x̄‖``), and bytes per worker.
2. **Matrices** (the simulator's setting: M = 8 and 32 workers, one random matching per gossip round,
   ``64 × 96`` pseudo-gradients = a shared component + per-worker noise, the shared part 0×, 1× or 1000× the
   noise): one pairwise round's contraction ``‖(I−J)X̄‖ / ‖(I−J)X‖`` per codec, averaged over 6 rounds, through the
   same pair sessions and frames the mixer runs (:func:`fgdiloco.gossip.mix.pair_round_in_process`).

Results: ``benchmarks/results/consensus.json`` and ``consensus.png``; benchmarks/RESULTS.md quotes the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from fgdiloco import FGDiLoCoConfig, LocalHub
from fgdiloco.factor import BF16, Dense, Int8, LowRank
from fgdiloco.gossip import make_topology
from fgdiloco.gossip.mix import pair_round_in_process
from fgdiloco.pretrain.data import build_tokenizer, encode_corpus, load_text, sample_batch, split_tokens
from fgdiloco.pretrain.loop import Loop, Point, Reporter, RoundEnd
from fgdiloco.pretrain.model import GPT, GPTConfig
from fgdiloco.pretrain.recipe import held_out_loss
from fgdiloco.pretrain.sync import FGDiLoCoSync

RESULTS = Path(__file__).resolve().parent / "results"

WORKERS, H, BATCH, BLOCK = 4, 5, 16, 64
MODEL = dict(n_layer=2, n_head=2, n_embd=64)
INNER_LR, GRAD_CLIP, OUTER_LR, OUTER_MOMENTUM = 3e-3, 1.0, 0.7, 0.9  # the pretrain job's inner lr and clipping

VARIANTS: dict[str, dict] = {
    "DiLoCo": dict(topology="allreduce", codec="dense", mix1_codec="dense"),
    "FG dense": dict(codec="dense"),
    "FG dense, local momentum": dict(codec="dense", mix_momentum=False),
    "FG lowrank": dict(codec=lambda: LowRank(rank=4)),
    "FG lowrank, local momentum": dict(codec=lambda: LowRank(rank=4), mix_momentum=False),
    "FG lowrank, mix2_rounds=0": dict(codec=lambda: LowRank(rank=4), mix2_rounds=0),
    "FG lowrank, mix2_rounds=2": dict(codec=lambda: LowRank(rank=4), mix2_rounds=2),
    "FG lowrank, mix1 dense": dict(codec=lambda: LowRank(rank=4), mix1_codec="dense"),
    "FG lowrank, mix1_rounds=2": dict(codec=lambda: LowRank(rank=4), mix1_rounds=2),
    "FG lowrank, exponential, mix1_rounds=2": dict(codec=lambda: LowRank(rank=4), topology="exponential",
                                                   mix1_rounds=2),
    "FG dense, exponential, mix1_rounds=2, mix2_rounds=2": dict(codec="dense", mix1_codec="dense",
                                                                topology="exponential", mix1_rounds=2,
                                                                mix2_rounds=2),
    "FG lowrank, tau=2": dict(codec=lambda: LowRank(rank=4), overlap_steps=2),
    "FG lowrank, tau=2, local momentum": dict(codec=lambda: LowRank(rank=4), overlap_steps=2, mix_momentum=False),
    "FG lowrank, tau=4, local momentum": dict(codec=lambda: LowRank(rank=4), overlap_steps=4, mix_momentum=False),
    "FG lowrank r8, tau=4, local momentum": dict(codec=lambda: LowRank(rank=8), overlap_steps=4,
                                                 mix_momentum=False),
    "FG lowrank r8, tau=4, local momentum, exponential, mix2_rounds=2": dict(
        codec=lambda: LowRank(rank=8), overlap_steps=4, mix_momentum=False, topology="exponential", mix2_rounds=2),
    "FG lowrank, F=2": dict(codec=lambda: LowRank(rank=4), fragments=2),
    "FG lowrank, F=2, alpha=0.5": dict(codec=lambda: LowRank(rank=4), fragments=2, merge_alpha=0.5),
    "FG lowrank, F=2, tau=2": dict(codec=lambda: LowRank(rank=4), fragments=2, overlap_steps=2),
    "FG lowrank, F=2, tau=2, alpha=0.5": dict(codec=lambda: LowRank(rank=4), fragments=2, overlap_steps=2,
                                              merge_alpha=0.5),
}
QUICK = ("DiLoCo", "FG dense", "FG lowrank", "FG lowrank, local momentum")


class _Spread:
    """Across-worker disagreement of one quantity per round, accumulated as the workers report (thread-safe):
    ``‖(I−J)X‖² = Σ‖x_i‖² − ‖Σx_i‖²/M``, in float64."""

    def __init__(self, m: int):
        self.m = m
        self._sum: dict[int, torch.Tensor] = {}
        self._sq: dict[int, float] = {}
        self._n: dict[int, int] = {}
        self.done: dict[int, tuple[float, float, torch.Tensor]] = {}  # round -> (rms of x_i − x̄, relative, mean)
        self._lock = threading.Lock()

    def add(self, t: int, tensors: list[torch.Tensor], keep_mean: bool = False) -> None:
        flat = torch.cat([x.detach().double().reshape(-1) for x in tensors])
        with self._lock:
            if t not in self._sum:
                self._sum[t], self._sq[t], self._n[t] = torch.zeros_like(flat), 0.0, 0
            self._sum[t] += flat
            self._sq[t] += float(flat @ flat)
            self._n[t] += 1
            if self._n[t] == self.m:
                s = self._sum.pop(t)
                sq = self._sq.pop(t)
                del self._n[t]
                mean = s / self.m
                dis2 = max(sq - float(s @ s) / self.m, 0.0)
                rms = math.sqrt(dis2 / (self.m * flat.numel()))
                rel = math.sqrt(dis2 / self.m) / max(float(mean.norm()), 1e-30)
                self.done[t] = (rms, rel, mean.float() if keep_mean else torch.empty(0))


def _data(quick: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    text = load_text(None)
    tok = build_tokenizer(text, "bpe", 2048)
    train, val = split_tokens(encode_corpus(text, tok), 0.05)
    return train, val, tok.vocab_size


def _eval_set(val: torch.Tensor, batches: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(999)
    return [sample_batch(val, 16, BLOCK, g) for _ in range(batches)]


class _Spreads(Reporter):
    """One worker's reports into the variant's shared accumulators: every round the disagreement of its round-start
    parameters and outer momentum and its bytes sent; at every evaluation point its held-out loss."""

    def __init__(self, shared: dict, sync: FGDiLoCoSync, eval_every: int, rounds: int, fragments: int = 1):
        self.shared, self.opt, self.eval_every, self.rounds = shared, sync.opt, eval_every, rounds
        self.f = fragments  # with F fragments, every F-th fragment round ends an outer round of H steps
        self._bytes = 0  # bytes sent in the fragment rounds of the outer round so far

    def round_done(self, end: RoundEnd) -> None:
        self._bytes += end.stats["bytes_sent"]
        if end.done % self.f:
            return
        done = end.done // self.f
        t = done - 1
        evaluated = done % self.eval_every == 0 or done == self.rounds
        self.shared["params"].add(t, self.opt.outer.theta0, keep_mean=evaluated)
        self.shared["momentum"].add(t, self.opt.outer.momentum)
        with self.shared["lock"]:
            self.shared["bytes"].setdefault(t, []).append(self._bytes)
        self._bytes = 0

    def record(self, point: Point) -> bool:
        if point.round > 0 and point.round % self.f == 0:
            with self.shared["lock"]:
                self.shared["losses"].setdefault(point.round // self.f - 1, []).append(point.eval_loss)
        return False


def _worker(rank: int, knobs: dict, hub: LocalHub, init: dict, cfg: GPTConfig, data: tuple, shared: dict,
            rounds: int, eval_every: int, h: int) -> None:
    """One worker (a thread): the example job's training loop with FG-DiLoCo on the in-process hub, AdamW at a
    constant learning rate, clipping at ``GRAD_CLIP``; Mix2's inputs and outputs recorded for its contraction."""
    train, val, _ = data
    torch.set_num_threads(1)
    model = GPT(cfg)
    model.load_state_dict(init)
    config = FGDiLoCoConfig.build(sync_every=h, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, timeout=120.0,
                                  seed=1, **{k: (v() if callable(v) else v) for k, v in knobs.items()})
    sync = FGDiLoCoSync(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), config, grad_clip=GRAD_CLIP,
                        transport=hub.transport(rank))
    real_run = sync.opt._mixer2.run

    def recorded(values, outer_round):  # fragment 0's Mix2 (its rounds are 0, F, 2F, ...)
        key = outer_round // len(sync.opt.fragments)
        shared["delta_in"].add(key, values)
        res = real_run(values, outer_round)
        shared["delta_out"].add(key, res.values)
        return res

    sync.opt._mixer2.run = recorded
    g = torch.Generator().manual_seed(1000 + rank)
    f = len(sync.opt.fragments)  # with fragments the loop's rounds are fragment rounds, F per H steps
    Loop(sync, _Spreads(shared, sync, eval_every, rounds, f), lambda step: sample_batch(train, BATCH, BLOCK, g),
         _eval_set(val), steps=rounds * h, sync_every=h // f, eval_every=eval_every * f).run()


def train_variant(name: str, knobs: dict, rounds: int, data: tuple, eval_every: int, h: int = H) -> dict:
    """The variant ``knobs`` on ``WORKERS`` threads for ``rounds`` rounds: per-round disagreement, Mix2's
    contraction, bytes, and the held-out losses of the workers and of their average model."""
    train, val, vocab = data
    hub = LocalHub(WORKERS)
    cfg = GPTConfig(vocab, BLOCK, **MODEL)
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    shared = {"params": _Spread(WORKERS), "momentum": _Spread(WORKERS), "delta_in": _Spread(WORKERS),
              "delta_out": _Spread(WORKERS), "losses": {}, "bytes": {}, "lock": threading.Lock()}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            _worker(rank, knobs, hub, init, cfg, data, shared, rounds, eval_every, h)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            hub.dead.add(rank)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(WORKERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    rows = _rows(shared, rounds, cfg, val)
    return {"summary": _summary(name, time.perf_counter() - t0, rows, rounds), "rounds": rows}


def _rows(shared: dict, rounds: int, cfg: GPTConfig, val: torch.Tensor) -> list[dict]:
    params, momentum, delta_in, delta_out = (shared[k] for k in ("params", "momentum", "delta_in", "delta_out"))
    avg_model = GPT(cfg)
    names = [n for n, p in avg_model.named_parameters() if p.requires_grad]
    rows = []
    for t in range(rounds):
        row = {"round": t + 1, "bytes_sent_per_worker": statistics.fmean(shared["bytes"][t]),
               "param_rms": params.done[t][0], "param_relative": params.done[t][1],
               "momentum_rms": momentum.done[t][0], "momentum_relative": momentum.done[t][1],
               # with fragments: fragment 0's Mix2 (a fragment's last round may end after the last step)
               "pseudo_gradient_relative": delta_in.done.get(t, (0.0, 0.0))[1],
               "mix2_contraction": (delta_out.done[t][0] / delta_in.done[t][0])
               if t in delta_in.done and delta_in.done[t][0] > 0 else 0.0}
        if t in shared["losses"]:
            mean = params.done[t][2]
            off, sd = 0, {}
            for n, p in avg_model.named_parameters():
                if n in names:
                    sd[n] = mean[off : off + p.numel()].view(p.shape)
                    off += p.numel()
            with torch.no_grad():
                for n, p in avg_model.named_parameters():
                    p.copy_(sd[n])
            row["loss_workers"] = sorted(shared["losses"][t])
            row["loss_average_model"] = held_out_loss(avg_model, _eval_set(val))
        rows.append(row)
    return rows


def _summary(name: str, seconds: float, rows: list[dict], rounds: int) -> dict:
    half = rounds // 2
    second = [r["param_relative"] for r in rows[half:]]
    q = max(len(second) // 4, 1)
    return {
        "variant": name,
        "seconds": seconds,
        "final_loss_average_model": rows[-1]["loss_average_model"],
        "final_loss_workers_mean": statistics.fmean(rows[-1]["loss_workers"]),
        "param_relative_second_half_start": statistics.fmean(second[:q]),
        "param_relative_second_half_end": statistics.fmean(second[-q:]),
        "momentum_relative_end": statistics.fmean(r["momentum_relative"] for r in rows[-q:]),
        "mix2_contraction_median": statistics.median(r["mix2_contraction"] for r in rows[1:]),
        "bytes_sent_per_worker_per_round": statistics.fmean(r["bytes_sent_per_worker"] for r in rows[1:]),
    }


def matrix_study(ms: tuple[int, ...] = (8, 32), rounds: int = 6) -> list[dict]:
    codecs = {"dense": Dense, "bf16": BF16, "int8": Int8,
              "lowrank r=1": lambda: LowRank(rank=1), "lowrank r=4": lambda: LowRank(rank=4),
              "lowrank r=1 fp32": lambda: LowRank(rank=1, quantize="fp32"),
              "lowrank r=4 fp32": lambda: LowRank(rank=4, quantize="fp32")}
    out = []
    for m in ms:
        topo = make_topology("random", m, 3)
        for shared in (0.0, 1.0, 1000.0):
            for name, make in codecs.items():
                g = torch.Generator().manual_seed(7)
                common = torch.randn(64, 96, generator=g) * shared
                xs = [[common + torch.randn(64, 96, generator=g)] for _ in range(m)]
                cs = [make() for _ in range(m)]
                ratios = []
                for r in range(rounds):
                    before = _disagreement(xs)
                    xs, _ = pair_round_in_process(cs, xs, [topo.peer(i, r) for i in range(m)])
                    ratios.append(_disagreement(xs) / before)
                out.append({"M": m, "shared": shared, "codec": name, "ratio_per_round": statistics.fmean(ratios),
                            "max_ratio": max(ratios)})
    return out


def _disagreement(xs: list[list[torch.Tensor]]) -> float:
    stacked = torch.stack([x[0].double() for x in xs])
    return float(torch.linalg.norm(stacked - stacked.mean(0)))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for name, res in results["training"].items():
        rows = res["rounds"]
        ev = [r for r in rows if "loss_average_model" in r]
        axes[0][0].plot([r["round"] for r in ev], [r["loss_average_model"] for r in ev], label=name)
        axes[0][1].semilogy([r["round"] for r in rows], [r["param_relative"] for r in rows], label=name)
        axes[1][0].semilogy([r["round"] for r in rows], [max(r["momentum_relative"], 1e-12) for r in rows],
                            label=name)
        axes[1][1].plot([r["round"] for r in rows[1:]], [r["mix2_contraction"] for r in rows[1:]], label=name)
    axes[0][0].set(title="held-out loss of the workers' average model", xlabel="outer round", ylabel="loss")
    axes[0][1].set(title="parameter disagreement ‖θ_i − θ̄‖ / ‖θ̄‖", xlabel="outer round")
    axes[1][0].set(title="outer momentum disagreement (relative)", xlabel="outer round")
    axes[1][1].set(title="Mix2 contraction ‖(I−J)Δ̄‖ / ‖(I−J)Δ‖", xlabel="outer round")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="30 rounds and four variants")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--sync-every", type=int, default=H, help=f"H, inner steps per outer round (default {H})")
    p.add_argument("--variants", nargs="*", default=None, help=f"a subset of {list(VARIANTS)} (DiLoCo is always run)")
    p.add_argument("--out", type=Path, default=RESULTS, metavar="FOLDER",
                   help="folder for consensus*.json and .png (default benchmarks/results); --variants are added to "
                        "the file of an earlier run of the same job there")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    rounds = 30 if args.quick else args.rounds
    names = QUICK if args.quick else tuple(VARIANTS)
    if args.variants:
        unknown = sorted(set(args.variants) - set(VARIANTS))
        if unknown:
            p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
        names = tuple(dict.fromkeys(["DiLoCo", *args.variants]))
    print("[consensus] matrices (M = 8, 32) ...", flush=True)
    matrices = matrix_study()
    for row in matrices:
        if row["shared"] in (0.0, 1000.0):
            print(f"  M={row['M']:2d} shared={row['shared']:6g} {row['codec']:18s} ratio/round "
                  f"{row['ratio_per_round']:.3f} (max {row['max_ratio']:.3f})", flush=True)
    data = _data(args.quick)
    training = {}
    h = args.sync_every
    config = {"workers": WORKERS, "sync_every": h, "rounds": rounds, "batch": BATCH, "block": BLOCK, **MODEL,
              "inner_lr": INNER_LR, "grad_clip": GRAD_CLIP, "outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM}
    stem = ("consensus_quick" if args.quick else "consensus") + ("" if h == H else f"_h{h}")
    earlier = args.out / f"{stem}.json"
    if args.variants and "DiLoCo" not in args.variants and earlier.exists():
        old = json.loads(earlier.read_text())
        if old.get("config") == config and "DiLoCo" in old["training"]:  # the baseline of the same job: reuse it
            training["DiLoCo"] = old["training"]["DiLoCo"]
            names = tuple(n for n in names if n != "DiLoCo")
    for name in names:
        print(f"[consensus] {name}: {rounds} rounds ...", flush=True)
        training[name] = train_variant(name, VARIANTS[name], rounds, data, args.eval_every, h)
        s = training[name]["summary"]
        print(f"  loss(avg model) {s['final_loss_average_model']:.4f}  workers {s['final_loss_workers_mean']:.4f}  "
              f"param rel {s['param_relative_second_half_start']:.2e} -> {s['param_relative_second_half_end']:.2e}  "
              f"momentum rel {s['momentum_relative_end']:.2e}  mix2 contraction {s['mix2_contraction_median']:.3f}  "
              f"{s['bytes_sent_per_worker_per_round'] / 1e3:.0f} kB/round  {s['seconds']:.0f} s", flush=True)
    base = training["DiLoCo"]["summary"]["final_loss_average_model"]
    for res in training.values():
        res["summary"]["loss_vs_diloco"] = res["summary"]["final_loss_average_model"] / base - 1
    results = {"config": config, "matrices": matrices, "training": training}
    args.out.mkdir(parents=True, exist_ok=True)
    previous = args.out / f"{stem}.json"
    if args.variants and previous.exists():  # add these variants to an earlier run's results (same config)
        old = json.loads(previous.read_text())
        if old.get("config") == results["config"]:
            old["training"].update(training)
            training = results["training"] = old["training"]
            base = training["DiLoCo"]["summary"]["final_loss_average_model"]
            for res in training.values():
                res["summary"]["loss_vs_diloco"] = res["summary"]["final_loss_average_model"] / base - 1
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / f"{stem}.png")
    print("\n| variant | loss, average model | vs DiLoCo | param. disagreement, 2nd half (start → end) | "
          "momentum disagreement | Mix2 contraction | bytes/worker/round |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, res in training.items():
        s = res["summary"]
        print(f"| {name} | {s['final_loss_average_model']:.4f} | {100 * s['loss_vs_diloco']:+.2f} % | "
              f"{s['param_relative_second_half_start']:.2e} → {s['param_relative_second_half_end']:.2e} | "
              f"{s['momentum_relative_end']:.2e} | {s['mix2_contraction_median']:.3f} | "
              f"{s['bytes_sent_per_worker_per_round'] / 1e3:.0f} kB |")
    print(f"[consensus] wrote {args.out / (stem + '.json')} and {stem}.png")
    return results


if __name__ == "__main__":
    main()
