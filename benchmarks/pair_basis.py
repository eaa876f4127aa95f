"""Which basis should a pairwise low-rank round project onto? Both of LowRank's pair bases on real pseudo-gradients.

Run from the repository root::

    python -m benchmarks.pair_basis            # about two minutes on 2 cores

Four replicas of the model of ``benchmarks.wan``'s job (the example GPT, 2 layers of width 128, vocabulary 1024,
536 k parameters) train on the bundled corpus with different batches: AdamW at lr 3e-3, H = 10 inner steps per
outer round, 16 rounds, and after every round the replicas are set to their average pseudo-gradient (DiLoCo with
outer lr 1, no momentum), so that every basis sees the same inputs. Each round's pseudo-gradients then go through
the two pairwise gossip rounds of Mix2 on the exponential graph (pairs (0, 1), (2, 3), then (0, 2), (1, 3) on the
values after the first), once per codec, each codec keeping its own warm starts across rounds, through the pair
sessions and frames the mixer runs (:func:`fgdiloco.gossip.mix.pair_round_in_process`).

Reported per codec and round: the fraction of the pairs' difference a gossip round removes on the factored
matrices, ``1 − ‖(I − J) X_after‖² / ‖(I − J) X_before‖²`` summed over the factored tensors of each pair (1 for an
exact average of every pair, which dense gossip gives), and the best any rank-r basis can do, the SVD's
``Σ_{k ≤ r} σ_k² / Σ σ_k²`` of each pair's difference. Codecs: ``LowRank(rank=8)`` (int8, the benchmarks' Mix2)
with the difference basis (the default) and the joint basis of earlier releases, and both in fp32.

Results go to ``benchmarks/results/pair_basis.json``; benchmarks/RESULTS.md ("The pair basis") quotes them.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from fgdiloco.factor import LowRank
from fgdiloco.gossip.mix import pair_round_in_process
from fgdiloco.pretrain.data import build_tokenizer, encode_corpus, load_text, sample_batch, split_tokens
from fgdiloco.pretrain.model import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
WORKERS, H, ROUNDS, BATCH, BLOCK, LR, RANK = 4, 10, 16, 8, 64, 3e-3, 8
MODEL = dict(n_layer=2, n_head=4, n_embd=128, block_size=BLOCK)
PAIRS = ([1, 0, 3, 2], [2, 3, 0, 1])  # the exponential graph's two gossip rounds for M = 4
CODECS = {
    "difference int8": lambda: LowRank(rank=RANK),
    "joint int8": lambda: LowRank(rank=RANK, pair_basis="joint"),
    "difference fp32": lambda: LowRank(rank=RANK, quantize="fp32"),
    "joint fp32": lambda: LowRank(rank=RANK, quantize="fp32", pair_basis="joint"),
}


def _pair_sq(xs: list[list[torch.Tensor]], partner: list[int], factored: list[int]) -> float:
    """Σ over pairs and factored tensors of ‖(I − J) X‖² of the pair (= ½‖x_i − x_j‖²)."""
    return sum(0.5 * float((xs[i][t].double() - xs[j][t].double()).square().sum())
               for i, j in enumerate(partner) if i < j for t in factored)


def _best_sq(xs: list[list[torch.Tensor]], partner: list[int], factored: list[int]) -> float:
    """What the best rank-r basis per matrix removes: ½ Σ_{k ≤ r} σ_k² of each pair's difference."""
    total = 0.0
    for i, j in enumerate(partner):
        if i < j:
            for t in factored:
                d = (xs[j][t] - xs[i][t]).double()
                s = torch.linalg.svdvals(d.reshape(d.shape[0], -1))
                total += 0.5 * float(s[:RANK].square().sum())
    return total


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--out", type=Path, default=RESULTS / "pair_basis.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    text = load_text(None)
    tok = build_tokenizer(text, "bpe", 1024)
    train, _ = split_tokens(encode_corpus(text, tok), 0.05)
    base = GPT(GPTConfig(vocab_size=tok.vocab_size, **MODEL))
    models = [copy.deepcopy(base) for _ in range(WORKERS)]
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in models]
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(WORKERS)]
    codecs = {name: [make() for _ in range(WORKERS)] for name, make in CODECS.items()}
    factored = [i for i, f in enumerate(LowRank(rank=RANK).factored(list(base.parameters()))) if f]
    rows = []
    for rnd in range(args.rounds):
        start = [p.detach().clone() for p in models[0].parameters()]
        for model, opt, g in zip(models, opts, gens):
            for _ in range(H):
                x, y = sample_batch(train, BATCH, BLOCK, g)
                _, loss = model(x, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        deltas = [[s - p.detach() for s, p in zip(start, m.parameters())] for m in models]
        row: dict = {"round": rnd}
        for k, partner in enumerate(PAIRS):
            if k == 0:
                inputs = {name: deltas for name in codecs}
            before = {name: _pair_sq(xs, partner, factored) for name, xs in inputs.items()}
            row[f"best_{k}"] = round(_best_sq(deltas if k == 0 else inputs["difference fp32"], partner, factored)
                                     / before["difference fp32"], 4)
            outputs = {}
            for name, xs in inputs.items():
                outputs[name], _ = pair_round_in_process(codecs[name], xs, partner)
                row[f"{name}_{k}"] = round(1 - _pair_sq(outputs[name], partner, factored) / before[name], 4)
            inputs = outputs
        rows.append(row)
        print("round", rnd, {k: v for k, v in row.items() if k != "round"}, flush=True)
        with torch.no_grad():  # DiLoCo with outer lr 1: every replica takes the average pseudo-gradient
            for t, s in enumerate(start):
                mean = sum(d[t] for d in deltas) / WORKERS
                for m in models:
                    list(m.parameters())[t].copy_(s - mean)
    late = [r for r in rows if r["round"] >= args.rounds // 2]
    summary = {f"{name}_{k}": round(statistics.fmean(r[f"{name}_{k}"] for r in late), 4)
               for name in [*CODECS, "best"] for k in range(2)}
    result = {"benchmark": "pair_basis", "command": "python -m benchmarks.pair_basis", "workers": WORKERS, "h": H,
              "rounds": args.rounds, "rank": RANK, "model": MODEL, "factored_tensors": len(factored),
              "removed_fraction_second_half_mean": summary, "rows": rows,
              "seconds": round(time.perf_counter() - t0, 1)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return result


if __name__ == "__main__":
    main()
