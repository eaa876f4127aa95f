"""Mix2 codecs on the example GPT's real pseudo-gradients: bytes on the wire, speed, and the loss they reach.

Run from the repository root::

    python -m benchmarks.compression                 # bytes + speed, then one `fgdiloco pretrain` run per codec
    python -m benchmarks.compression --no-train      # bytes + speed only (about a minute)

1. **Bytes and speed.** ("Mix2 bytes": the exact path's one frame; "pairwise": all frames one worker sends in a
   pairwise exchange, for LowRank the two messages of its pair-agreed projection plus the accept byte.) The
   default ``fgdiloco pretrain`` GPT on the bundled corpus takes ``--rounds`` rounds of
   ``sync_every`` AdamW steps on one worker; each round's pseudo-gradient Δ (all parameters) is encoded by every
   codec in turn, each codec keeping its own state across rounds (warm start, error feedback), and framed exactly
   as Mix2 sends it (48-byte header, zstd level 1). Reported per codec: Mix2 frame bytes per exchange (median over
   rounds after the first), the ratio to dense fp32 (4 bytes per element, no frame), the relative error
   ‖Δ − Δ̂‖/‖Δ‖ of what the receiver decodes, and encode + frame + unframe + decode throughput in MB/s of dense
   fp32 input on one thread.
2. **Loss.** The same ``fgdiloco pretrain`` run (default configuration, 4 workers) once per codec; the held-out loss
   at the end, and its ratio to the uncompressed (dense) run.

Results go to ``benchmarks/results/compression.json``; benchmarks/RESULTS.md quotes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from fgdiloco.factor import BF16, Codec, Dense, Int8, LowRank, decode_frame, encode_frame, layout_fingerprint
from fgdiloco.pretrain.config import TrainConfig
from fgdiloco.pretrain.data import build_tokenizer, encode_corpus, load_text, sample_batch, split_tokens
from fgdiloco.pretrain.launcher import launch
from fgdiloco.pretrain.model import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"

# name -> (codec factory, TrainConfig overrides for the loss run)
VARIANTS: dict[str, tuple] = {
    "dense": (Dense, {"codec": "dense"}),
    "bf16": (BF16, {"codec": "bf16"}),
    "int8": (Int8, {"codec": "int8"}),
}
for _r in (1, 4, 16):
    VARIANTS[f"lowrank r={_r}"] = (lambda r=_r: LowRank(rank=r), {"codec": "lowrank", "codec_rank": _r})
    VARIANTS[f"lowrank r={_r} no-EF"] = (lambda r=_r: LowRank(rank=r, error_feedback=False),
                                         {"codec": "lowrank", "codec_rank": _r, "error_feedback": False})


def pseudo_gradients(cfg: TrainConfig, rounds: int) -> tuple[list[list[torch.Tensor]], list[tuple]]:
    """``rounds`` consecutive real pseudo-gradients of the example GPT (one worker, AdamW, ``cfg.sync_every``
    steps each)."""
    text = load_text(cfg.data)
    tok = build_tokenizer(text, cfg.tokenizer, cfg.vocab_size, cache_dir=cfg.cache_dir)
    train, _ = split_tokens(encode_corpus(text, tok), cfg.val_fraction)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(tok.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(cfg.seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = []
    for _ in range(rounds):
        start = [p.detach().clone() for _, p in named]
        for _ in range(cfg.sync_every):
            x, y = sample_batch(train, cfg.batch_size, cfg.block_size, g)
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
        out.append([s - p.detach() for s, (_, p) in zip(start, named)])
    return out, [(n, p.shape, p.dtype) for n, p in named]


def pair_bytes(make: Callable[[], Codec], deltas: list[list[torch.Tensor]], fingerprint: bytes) -> float:
    """Median bytes one worker sends in a *pairwise* Mix2 exchange (all the frames of its pair session, e.g. the
    two messages of the low-rank pair-agreed projection, plus the accept byte), consecutive pseudo-gradients
    standing in for the two peers."""
    a, b = make(), make()
    sizes = []
    for k in range(len(deltas) - 1):
        sessions = [a.pair_session(deltas[k], lower=True, peer=k + 1),
                    b.pair_session(deltas[k + 1], lower=False, peer=k)]
        msgs = [next(s) for s in sessions]
        sent, phase = 0, 0
        while True:
            frames = [encode_frame(m.codec, m.body, sender=w, round=phase, fingerprint=fingerprint,
                                   shuffle=m.codec.shuffle) for w, m in enumerate(msgs)]
            sent += len(frames[0])
            replies = [decode_frame(frames[1 - w], msgs[w].codec, msgs[w].like, fingerprint=fingerprint)
                       for w in range(2)]
            try:
                msgs = [s.send(r) for s, r in zip(sessions, replies)]
            except StopIteration:
                break
            phase += 1
        sizes.append(sent + 1)
    return statistics.median(sizes)


def measure_codec(codec: Codec, deltas: list[list[torch.Tensor]], fingerprint: bytes) -> dict:
    frames, errors, seconds = [], [], []
    n = sum(t.numel() for t in deltas[0])
    for k, delta in enumerate(deltas):
        t0 = time.perf_counter()
        body, own = codec.encode(delta, stateful=True)
        frame = encode_frame(codec, body, sender=0, round=k, fingerprint=fingerprint, shuffle=codec.shuffle)
        got = decode_frame(frame, codec, delta, fingerprint=fingerprint)
        seconds.append(time.perf_counter() - t0)
        assert all(torch.equal(a, b) for a, b in zip(own, got))  # the receiver decodes what the sender mixes
        num = sum(float(torch.sum((d - g) ** 2)) for d, g in zip(delta, got))
        den = sum(float(torch.sum(d**2)) for d in delta)
        frames.append(len(frame))
        errors.append((num / den) ** 0.5)
    warm = slice(1, None) if len(deltas) > 1 else slice(None)
    frame_bytes = statistics.median(frames[warm])
    return {
        "codec": repr(codec),
        "mix2_bytes_per_exchange": frame_bytes,
        "ratio_to_dense_fp32": 4 * n / frame_bytes,
        "relative_error": statistics.median(errors[warm]),
        "encode_decode_MBps": 4 * n / 1e6 / statistics.median(seconds[warm]),
        "elements": n,
    }


def train_loss(name: str, overrides: dict, base: TrainConfig, out: Path) -> dict:
    cfg = replace(base, out=str(out / name.replace(" ", "_").replace("=", "")), quiet=True, **overrides)
    t0 = time.perf_counter()
    summary = launch(cfg)
    return {"final_eval_loss": summary["final_eval_loss"], "initial_eval_loss": summary["initial_eval_loss"],
            "bytes_sent": summary["bytes_sent_per_worker"], "wall_seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="pseudo-gradients to encode per codec")
    parser.add_argument("--no-train", action="store_true", help="skip the pretraining runs")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), help=f"subset of {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=None, help="override the pretrain run's steps per worker")
    parser.add_argument("--out", type=Path, default=RESULTS / "compression.json")
    args = parser.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    base = TrainConfig()
    if args.steps:
        base = replace(base, steps=args.steps)

    deltas, layout = pseudo_gradients(base, args.rounds)
    fp = layout_fingerprint(layout)
    rows: dict[str, dict] = {}
    print(f"{'codec':<22} {'Mix2 bytes':>11} {'vs fp32':>8} {'pairwise':>9} {'vs fp32':>8} {'rel.err':>8} "
          f"{'MB/s':>7}")
    for name in args.variants:
        rows[name] = measure_codec(VARIANTS[name][0](), deltas, fp)
        r = rows[name]
        r["pairwise_bytes_per_exchange"] = pair_bytes(VARIANTS[name][0], deltas, fp)
        r["pairwise_ratio_to_dense_fp32"] = 4 * r["elements"] / r["pairwise_bytes_per_exchange"]
        print(f"{name:<22} {r['mix2_bytes_per_exchange']:>11,.0f} {r['ratio_to_dense_fp32']:>7.1f}x "
              f"{r['pairwise_bytes_per_exchange']:>9,.0f} {r['pairwise_ratio_to_dense_fp32']:>7.1f}x "
              f"{r['relative_error']:>8.3f} {r['encode_decode_MBps']:>7.0f}")

    if not args.no_train:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.variants:
                rows[name].update(train_loss(name, VARIANTS[name][1], base, Path(tmp)))
                print(f"{name:<22} final held-out loss {rows[name]['final_eval_loss']:.4f} "
                      f"({rows[name]['wall_seconds']:.0f} s)", flush=True)
        if "dense" in rows and "final_eval_loss" in rows["dense"]:
            ref = rows["dense"]["final_eval_loss"]
            for r in rows.values():
                r["loss_ratio_to_dense"] = r["final_eval_loss"] / ref

    result = {"config": {"rounds": args.rounds, "sync_every": base.sync_every, "steps": base.steps,
                         "workers": base.workers, "model": f"{base.n_layer}x{base.n_embd}",
                         "vocab_size": base.vocab_size, "elements": deltas[0] and sum(t.numel() for t in deltas[0])},
              "codecs": rows, "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
