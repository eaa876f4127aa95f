"""What the FGDiLoCo wrapper costs: per inner step (vs plain AdamW) and per outer round.

Run from the repository root::

    python -m benchmarks.overhead            # writes benchmarks/results/overhead.json

1. **Inner step.** The example GPT, one process, one thread. Blocks of ``--block`` training steps (forward,
   backward, optimizer step) alternate between plain AdamW and the same AdamW wrapped in ``FGDiLoCo`` with
   ``sync_every`` larger than the run (so no round falls inside a timed block), ``--repeats`` times each; the
   ratio of median block times is the wrapper's overhead (target <= 1.03: between rounds an inner step does
   nothing beyond two hook calls and a counter check). The optimizer step alone is timed the same way, which
   isolates the hooks from forward/backward noise.
2. **Outer round.** The same GPT on 2 and 4 real Gloo ranks (fork + TCPStore): ``FGDiLoCo.sync()`` with the
   default codecs (Mix2 dense fp32, Mix1 bf16) on a random topology, after enough inner steps that Mix1 has
   finished. Reports the blocking time of a round and its parts, and the bytes each worker sends.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from fgdiloco import FGDiLoCo
from fgdiloco.pretrain.model import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4, n_embd=128))


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 2048, (8, 65), generator=g)


def _train_block(model: GPT, opt, start: int, n: int) -> float:
    t0 = time.perf_counter()
    for s in range(start, start + n):
        idx = _batch(s)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - t0


def _step_block(opt, params: list[torch.Tensor], n: int) -> float:
    for p in params:  # constant gradients: time the optimizer step alone
        p.grad = torch.full_like(p, 1e-3)
    t0 = time.perf_counter()
    for _ in range(n):
        opt.step()
    return time.perf_counter() - t0


def inner_step_overhead(block: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    plain_model, wrapped_model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-4)
    wrapped = FGDiLoCo(wrapped_model, torch.optim.AdamW(wrapped_model.parameters(), lr=1e-4),
                       sync_every=10**9)
    _train_block(plain_model, plain, 0, 3)  # warm-up both
    _train_block(wrapped_model, wrapped, 0, 3)
    train = {"plain": [], "fgdiloco": []}
    step = {"plain": [], "fgdiloco": []}
    for r in range(repeats):
        order = [("plain", plain_model, plain), ("fgdiloco", wrapped_model, wrapped)]
        if r % 2:
            order.reverse()
        for name, model, opt in order:
            train[name].append(_train_block(model, opt, 100 * r, block) / block)
        for name, model, opt in order:
            step[name].append(_step_block(opt, list(model.parameters()), 5 * block) / (5 * block))
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in (("train", train), ("step", step))}
    wrapped.close()
    return {
        "params": sum(p.numel() for p in plain_model.parameters()),
        "block_steps": block,
        "repeats": repeats,
        "train_step_seconds": med["train"],
        "train_step_ratio": med["train"]["fgdiloco"] / med["train"]["plain"],
        "optimizer_step_seconds": med["step"],
        "optimizer_step_ratio": med["step"]["fgdiloco"] / med["step"]["plain"],
        "hook_overhead_microseconds": 1e6 * (med["step"]["fgdiloco"] - med["step"]["plain"]),
    }


def _round_worker(rank: int, world: int, rounds: int, sync_every: int) -> list[dict]:
    model = _model()
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-4), sync_every=sync_every,
                   topology="random", timeout=60.0)
    out = []
    for s in range(rounds * sync_every):
        idx = _batch(1000 * rank + s)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if (s + 1) % sync_every == 0:
            out.append(opt.last_round.as_dict())
    return out


def outer_round_cost(world: int, rounds: int, sync_every: int) -> dict:
    import tempfile

    from fgdiloco.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_round_worker, world, tmp, rounds, sync_every, store="tcp", timeout=600)
    rows = [row for per_rank in results for row in per_rank[1:]]  # skip each rank's first round (warm-up)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {
        "world_size": world,
        "sync_every": sync_every,
        "rounds_measured": len(rows),
        "blocked_seconds": statistics.median(r["round_seconds"] - r["inner_seconds"] for r in rows),
        "mix2_seconds": med("mix2_seconds"),
        "mix1_wait_seconds": med("mix1_wait_seconds"),
        "mix1_seconds_background": med("mix1_seconds"),
        "outer_step_seconds": med("outer_seconds"),
        "inner_step_seconds": med("inner_seconds") / sync_every,
        "utilisation": med("utilisation"),
        "mix1_bytes_sent": med("mix1_bytes_sent"),
        "mix2_bytes_sent": med("mix2_bytes_sent"),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", type=int, default=20, help="training steps per timed block")
    parser.add_argument("--repeats", type=int, default=7, help="timed blocks per variant")
    parser.add_argument("--rounds", type=int, default=5, help="outer rounds per rank in the round benchmark")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "overhead.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    inner = inner_step_overhead(args.block, args.repeats)
    print(f"inner step ({inner['params'] / 1e6:.2f} M params): plain {inner['train_step_seconds']['plain'] * 1e3:.2f}"
          f" ms, fgdiloco {inner['train_step_seconds']['fgdiloco'] * 1e3:.2f} ms, "
          f"ratio {inner['train_step_ratio']:.3f} (target <= 1.03)")
    print(f"optimizer step alone: ratio {inner['optimizer_step_ratio']:.3f}, hooks cost "
          f"{inner['hook_overhead_microseconds']:.1f} us per step")
    rounds = [outer_round_cost(w, args.rounds, args.sync_every) for w in (2, 4)]
    for r in rounds:
        print(f"outer round, {r['world_size']} ranks: blocked {r['blocked_seconds'] * 1e3:.1f} ms "
              f"(Mix2 {r['mix2_seconds'] * 1e3:.1f}, Mix1 wait {r['mix1_wait_seconds'] * 1e3:.1f}, outer step "
              f"{r['outer_step_seconds'] * 1e3:.1f}) = {r['blocked_seconds'] / r['inner_step_seconds']:.2f} inner "
              f"steps; sends {r['mix1_bytes_sent'] / 1e6:.2f} MB (Mix1) + {r['mix2_bytes_sent'] / 1e6:.2f} MB (Mix2)")
    result = {"inner_step": inner, "outer_round": rounds, "torch": torch.__version__, "cpus": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
