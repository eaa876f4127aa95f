"""The same tokens on 4 workers, as 4 replicas × 1 stage and as 2 replicas × 2 pipeline stages.

Run from the repository root::

    python -m benchmarks.pipeline            # writes benchmarks/results/pipeline.json

The example GPT on the bundled public-domain text (byte-level BPE), 4 real Gloo ranks (fork + TCPStore), FG-DiLoCo
with the random topology and the default codecs. Both layouts see the same tokens per step over the job: 4 × 1 runs
4 replicas on batches of ``--batch`` sequences; 2 × 2 runs 2 replicas on batches of ``2 * --batch`` through a
2-stage 1F1B pipeline (``GPT.split(2)``, ``--microbatches`` microbatches). Per worker it reports:

* ``held_out_loss``: mean next-token cross-entropy (nats) on fixed held-out batches at the end, averaged over
  replicas (through the pipeline for 2 × 2), and at the start;
* ``utilisation``: FG-DiLoCo's inner time / round time (the part not blocked in gossip), median over rounds;
* ``bubble``: the fraction of a pipeline step a stage waits for its neighbour (0 without stages), median over steps;
* ``compute_fraction``: time in forward + backward (+ loss) / training wall time;
* ``gossip_bytes_per_worker`` and ``activation_bytes_per_worker``: bytes sent over the run (Mix1 + Mix2 frames;
  forward activations + backward gradients).

With 2 replicas a random pairwise round is the exact average, so 2 × 2 here mixes like DiLoCo; its per-worker
gossip bytes are about half of 4 × 1's (each worker gossips half the model) and it pays activation bytes instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fgdiloco import FGDiLoCo, ReplicaMesh
from fgdiloco.pipeline import Pipeline
from fgdiloco.pretrain import GPT, GPTConfig, lm_loss
from fgdiloco.pretrain.data import build_tokenizer, cache_dir_for, encode_corpus, load_text, sample_batch, split_tokens

RESULTS = Path(__file__).resolve().parent / "results"


def _data(vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    text = load_text(None)
    cache = cache_dir_for(None)
    tok = build_tokenizer(text, "bpe", vocab, cache_dir=cache)
    train, val = split_tokens(encode_corpus(text, tok, cache_dir=cache))
    return train, val, tok.vocab_size


def _worker(rank: int, world: int, stages: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    train, val, vocab = _data(cfg["vocab"])
    gpt = GPT(GPTConfig(vocab_size=vocab, block_size=cfg["block"], n_layer=cfg["layers"], n_head=4,
                        n_embd=cfg["width"]))
    replicas = world // stages
    mesh = ReplicaMesh(replicas, stages, timeout=120.0) if stages > 1 else None
    module = gpt.split(stages)[mesh.stage] if mesh else gpt
    replica = mesh.replica if mesh else rank
    batch = cfg["batch"] * world // replicas  # the same tokens per step over the job
    pipe = Pipeline(module, mesh, lm_loss, cfg["microbatches"], "1f1b") if mesh else None
    opt = FGDiLoCo(module, torch.optim.AdamW(module.parameters(), lr=cfg["lr"]), sync_every=cfg["sync_every"],
                   topology="random", outer_momentum=0.3, mesh=mesh, timeout=120.0)
    held_out = [sample_batch(val, 16, cfg["block"], torch.Generator().manual_seed(10_000 + i)) for i in range(4)]

    def evaluate() -> float | None:
        with torch.no_grad():
            if pipe is None:
                return sum(float(gpt(x, y)[1]) for x, y in held_out) / len(held_out)
            losses = [pipe.eval_loss(x, y) for x, y in held_out]
            return None if losses[0] is None else sum(float(v) for v in losses) / len(losses)

    first = evaluate()
    gen = torch.Generator().manual_seed(replica)
    compute = 0.0
    util, bubble, gossip_bytes = [], [], 0
    t_start = time.perf_counter()
    for step in range(cfg["steps"]):
        x, y = sample_batch(train, batch, cfg["block"], gen)
        if pipe is None:
            t0 = time.perf_counter()
            _, loss = gpt(x, y)
            loss.backward()
            compute += time.perf_counter() - t0
        else:
            pipe.step(x, y)
            compute += pipe.last_step.compute_seconds
            if step > 0:  # the first step holds the schedule's shape inference
                bubble.append(pipe.last_step.bubble)
        opt.step()
        opt.zero_grad()
        if (step + 1) % cfg["sync_every"] == 0:
            util.append(opt.last_round.utilisation)
            gossip_bytes += opt.last_round.bytes_sent
    wall = time.perf_counter() - t_start
    last = evaluate()
    opt.close()
    return {
        "replica": replica, "stage": mesh.stage if mesh else 0, "held_out_first": first, "held_out_last": last,
        "utilisation": statistics.median(util), "bubble": statistics.median(bubble) if bubble else 0.0,
        "compute_fraction": compute / wall, "wall_seconds": wall, "gossip_bytes": gossip_bytes,
        "activation_bytes": pipe.activation_bytes_sent_total if pipe else 0,
        "params": sum(p.numel() for p in module.parameters()), "batch": batch,
    }


def run_layout(stages: int, cfg: dict) -> dict:
    from fgdiloco.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        rows = run_ranks(_worker, 4, tmp, stages, cfg, store="tcp", timeout=3600)
    losses_last = [r["held_out_last"] for r in rows if r["held_out_last"] is not None]
    losses_first = [r["held_out_first"] for r in rows if r["held_out_first"] is not None]
    mean = lambda key: statistics.mean(r[key] for r in rows)  # noqa: E731
    return {
        "layout": f"{4 // stages}x{stages}", "replicas": 4 // stages, "stages": stages,
        "batch_per_replica": rows[0]["batch"], "tokens": cfg["steps"] * 4 * cfg["batch"] * cfg["block"],
        "held_out_loss_start": statistics.mean(losses_first), "held_out_loss": statistics.mean(losses_last),
        "utilisation": mean("utilisation"), "bubble": mean("bubble"), "compute_fraction": mean("compute_fraction"),
        "wall_seconds": max(r["wall_seconds"] for r in rows),
        "gossip_bytes_per_worker": mean("gossip_bytes"), "activation_bytes_per_worker": mean("activation_bytes"),
        "params_per_worker": mean("params"), "workers": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per worker per step in the 4 x 1 layout")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=RESULTS / "pipeline.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = {k: getattr(args, k) for k in ("steps", "sync_every", "batch", "microbatches", "block", "layers",
                                          "width", "vocab", "lr")}
    _data(args.vocab)  # build the tokenizer cache once, before the ranks fork
    layouts = [run_layout(1, cfg), run_layout(2, cfg)]
    for r in layouts:
        print(f"{r['layout']}: held-out loss {r['held_out_loss_start']:.3f} -> {r['held_out_loss']:.3f}, "
              f"utilisation {r['utilisation']:.3f}, bubble {r['bubble']:.3f}, compute {r['compute_fraction']:.3f}, "
              f"gossip {r['gossip_bytes_per_worker'] / 1e6:.2f} MB/worker, activations "
              f"{r['activation_bytes_per_worker'] / 1e6:.2f} MB/worker, wall {r['wall_seconds']:.1f} s")
    result = {"config": cfg, "layouts": layouts, "torch": torch.__version__, "cpus": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
