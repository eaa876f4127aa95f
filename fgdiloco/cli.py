"""The ``fgdiloco`` console command.

``fgdiloco pretrain``: pretrain a small GPT on real text with Factored Gossip DiLoCo on local worker processes
(defaults: 4 workers on the bundled public-domain corpus, about 3 minutes on 2 CPU cores).
``fgdiloco simulate``: the analytic round model of ``benchmarks/simulate.py`` (utilisation and wall time of DDP,
DiLoCo and FG-DiLoCo against bandwidth and number of workers, consensus of the gossip topologies; needs a source
checkout). Each subcommand adds itself in its own ``add_<name>_parser`` function.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


def _int_at_least(minimum: int) -> Any:
    """An argparse ``type`` accepting integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1)
_count = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return v


def add_pretrain_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``pretrain`` to ``subparsers``."""
    from .pretrain.worker import CODECS, TOPOLOGIES, TrainConfig

    d = TrainConfig()
    p = subparsers.add_parser(
        "pretrain",
        help="pretrain a small GPT on text with Factored Gossip DiLoCo (local worker processes)",
        description="Pretrain a small nanoGPT-style model on real text with Factored Gossip DiLoCo: --workers local "
                    "processes (torchelastic, Gloo, OMP_NUM_THREADS=1) each take --steps AdamW steps and gossip "
                    "every --sync-every steps. Writes metrics.jsonl, summary.json and loss.png to --out. "
                    "With no arguments it trains on the bundled public-domain corpus in about 3 minutes on 2 "
                    "CPU cores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("workers and synchronisation")
    g.add_argument("--workers", type=_positive_int, default=d.workers, help="number of worker processes (replicas)")
    g.add_argument("--steps", type=_positive_int, default=d.steps, help="inner optimizer steps per worker")
    g.add_argument("--sync-every", type=_positive_int, default=d.sync_every,
                   help="H: inner steps per outer round")
    g.add_argument("--topology", choices=TOPOLOGIES, default=d.topology, help="gossip topology")
    g.add_argument("--mix1-rounds", type=_count, default=d.mix1_rounds,
                   help="gossip rounds of Mix1 (non-blocking parameter mix) per outer round")
    g.add_argument("--mix2-rounds", type=_count, default=d.mix2_rounds,
                   help="gossip rounds of Mix2 (blocking pseudo-gradient mix) per outer round")
    g.add_argument("--codec", choices=CODECS, default=d.codec, help="Mix2's codec")
    g.add_argument("--rank", type=_positive_int, default=d.rank, help="rank of the lowrank codec")
    g.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                   help="lowrank without error feedback (an ablation; it is on by default)%(default).0s")
    g.add_argument("--outer-lr", type=_positive_float, default=d.outer_lr, help="outer learning rate")
    g.add_argument("--outer-momentum", type=float, default=d.outer_momentum, help="outer Nesterov momentum")
    g.add_argument("--baseline", choices=["ddp", "localsgd"], default=None,
                   help="train a comparison instead: 'ddp' (DistributedDataParallel, gradients all-reduced every "
                        "step) or 'localsgd' (PyTorch's PeriodicModelAverager every --sync-every steps)")
    g.add_argument("--timeout", type=_positive_float, default=d.timeout, help="seconds per gossip exchange")
    g = p.add_argument_group("inner optimizer and batches")
    g.add_argument("--lr", type=_positive_float, default=d.lr, help="AdamW peak learning rate")
    g.add_argument("--warmup-steps", type=_count, default=d.warmup_steps, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient-norm clipping (0: off)")
    g.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="sequences per step per worker")
    g.add_argument("--block-size", type=_positive_int, default=d.block_size, help="tokens per sequence")
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=_positive_int, default=d.n_layer, help="transformer blocks")
    g.add_argument("--n-head", type=_positive_int, default=d.n_head, help="attention heads")
    g.add_argument("--n-embd", type=_positive_int, default=d.n_embd, help="model width")
    g.add_argument("--dropout", type=float, default=d.dropout, help="dropout probability")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="UTF-8 text file or folder of .txt files "
                        "(default: the bundled public-domain corpus)%(default).0s")
    g.add_argument("--tokenizer", choices=["bpe", "bytes"], default=d.tokenizer,
                   help="byte-level BPE (trained on the data, cached) or raw UTF-8 bytes")
    g.add_argument("--vocab-size", type=_positive_int, default=d.vocab_size, help="BPE vocabulary size")
    g.add_argument("--val-fraction", type=float, default=d.val_fraction, help="held-out tail of the tokens")
    g.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where to cache the tokenizer and token ids (default: .fgdiloco-cache/ beside the data, or "
                        "~/.cache/fgdiloco when the data folder is read-only)%(default).0s")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=d.out, metavar="DIR", help="output folder")
    g.add_argument("--seed", type=_count, default=d.seed, help="random seed (model, batches, gossip schedule)")
    g.add_argument("--eval-every", type=_positive_int, default=d.eval_every, help="outer rounds between evaluations")
    g.add_argument("--eval-batches", type=_positive_int, default=d.eval_batches,
                   help="held-out batches per evaluation")
    g.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    p.set_defaults(func=run_pretrain, subparser=p)
    return p


def _config_from_args(args: argparse.Namespace) -> Any:
    import dataclasses

    from .pretrain.worker import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def run_pretrain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .pretrain.data import load_text
    from .pretrain.worker import launch

    try:
        cfg = _config_from_args(args).validate()
        load_text(cfg.data)  # unreadable data fails here in one line, not inside every worker
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {cfg.out!r} is a file; give a folder (it is created if missing)")
    method = (f"{cfg.baseline} baseline" if cfg.baseline
              else f"Factored Gossip DiLoCo ({cfg.topology}, codec {cfg.codec})")
    print(f"[fgdiloco] pretrain: {cfg.workers} workers x {cfg.steps} steps, {method}, sync every {cfg.sync_every}, "
          f"data: {cfg.data or 'bundled corpus'}, out: {cfg.out}", flush=True)
    try:
        summary = launch(cfg)
    except Exception as e:  # noqa: BLE001 - a worker failed: say so and exit non-zero
        print(f"[fgdiloco] pretrain failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    print(_summary_text(summary), flush=True)
    return 0


def _summary_text(s: dict[str, Any]) -> str:
    util = "-" if s.get("utilisation") is None else f"{100 * s['utilisation']:.1f}%"
    lines = [
        "[fgdiloco] done:",
        f"  held-out loss   {s['initial_eval_loss']:.3f} -> {s['final_eval_loss']:.3f} "
        f"(mean over workers {s['final_eval_loss_mean']:.3f}; unigram baseline {s['unigram_loss']:.3f})",
        f"  tokens          {s['tokens'] / 1e6:.2f}M in {s['wall_seconds']:.1f} s of training "
        f"({s['tokens_per_second']:.0f} tokens/s without evaluation; set-up {s['setup_seconds']:.1f} s)",
        f"  utilisation     {util}   bytes sent per worker {s['bytes_sent'] / 1e6:.2f} MB   "
        f"failed exchanges {s['failed_exchanges']}",
        f"  outputs         {s.get('summary_path', '')}  {s.get('metrics_path', '')}  {s.get('plot_path', '')}",
    ]
    return "\n".join(lines)


def _benchmarks_simulate() -> Any:
    """``benchmarks.simulate`` of the source checkout this package lives in, or None (installed from a wheel)."""
    import importlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "simulate.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.simulate")


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to ``subparsers`` (the model lives in ``benchmarks/simulate.py`` of a source checkout)."""
    p = subparsers.add_parser(
        "simulate",
        help="analytic model of a round: utilisation of DDP, DiLoCo and FG-DiLoCo vs bandwidth and workers",
        description="Predict compute utilisation and wall time per round of DDP, DiLoCo and FG-DiLoCo from measured "
                    "codec bytes on the example GPT, compute time per step, bandwidth, latency and M (up to 1024); "
                    "simulate the consensus contraction of the gossip topologies; validate against "
                    "benchmarks/results/wan.json when present. Writes benchmarks/results/simulate.json and PNGs. "
                    "Same as python -m benchmarks.simulate (needs a source checkout).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    mod = _benchmarks_simulate()
    if mod is not None:
        mod.add_arguments(p)
    p.set_defaults(func=run_simulate, subparser=p)
    return p


def run_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    mod = _benchmarks_simulate()
    if mod is None:
        print("[fgdiloco] simulate needs a source checkout of fgdiloco (benchmarks/simulate.py beside the package)",
              file=sys.stderr)
        return 1
    mod.print_report(mod.run(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="fgdiloco", description="Factored Gossip DiLoCo for PyTorch.")
    parser.add_argument("--version", action="version", version=f"fgdiloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_pretrain_parser(sub)
    add_simulate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fgdiloco`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args, args.subparser) or 0)


if __name__ == "__main__":
    sys.exit(main())
