"""Pretrain a small GPT with Factored Gossip DiLoCo: the Lightning way in.

    python examples/pretrain_lightning.py [--data PATH] [--workers 4] [--steps 200] [--sync-every 50]
    python examples/pretrain_lightning.py --workers 4 --stages 2      # 2 replicas x 2 pipeline stages

The same GPT and the same real text as ``fgdiloco pretrain`` (``fgdiloco.pretrain.model`` / ``data``; default:
the bundled public-domain corpus), as a ``LightningModule`` + ``LightningDataModule``, trained with
``Trainer(strategy="fgdiloco")``: one process per replica (Lightning's launcher re-runs this script for each),
ordinary AdamW steps on each replica's own shard of random text windows, and every ``sync_every`` steps an outer
round that gossips with a peer. ``GossipMonitor`` shows utilisation and consensus distance in the progress bar and
logs every round's diagnostics to ``<out>/lightning_logs/version_*/metrics.csv``. The defaults take about 4
minutes on a 2-core CPU.

With ``--stages S`` every replica is S processes holding one pipeline stage each (``GPT.split(S)``):
``FGDiLoCoStrategy(pipeline_stages=S, n_microbatches=m)`` with :class:`PipelinedGPTModule`, which implements the
strategy's pipeline contract (``configure_pipeline_stage`` / ``pipeline_loss``, ``training_step`` through
``trainer.strategy.pipeline_step``); gossip runs among the same stage of the ``workers / S`` replicas.
"""

from __future__ import annotations

import argparse
import math
import os

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import fgdiloco  # noqa: F401 - registers strategy="fgdiloco"
from fgdiloco.pretrain import data
from fgdiloco.pretrain.model import GPT, GPTConfig, lm_loss
from lightning_callbacks import FGDiLoCoStrategy, GossipMonitor


class Windows(Dataset):
    """``n`` random windows of ``tokens`` (seeded): item ``i`` is ``(x, y)``, next-token targets, ``[block]`` each.
    Lightning's ``DistributedSampler`` gives every replica its own share of the windows."""

    def __init__(self, tokens: torch.Tensor, n: int, block_size: int, seed: int):
        if tokens.numel() < block_size + 1:
            raise ValueError(f"{tokens.numel()} tokens are too few for windows of {block_size} (+1)")
        self.tokens, self.block = tokens, block_size
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, tokens.numel() - block_size, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[self.starts[i] : self.starts[i] + self.block + 1].long()
        return w[:-1], w[1:]


class TextData(pl.LightningDataModule):
    def __init__(self, path: str | None, vocab_size: int, block_size: int, batch_size: int, train_windows: int,
                 val_windows: int = 64, seed: int = 0):
        super().__init__()
        self.path, self.vocab_size, self.block_size = path, vocab_size, block_size
        self.batch_size, self.train_windows, self.val_windows, self.seed = batch_size, train_windows, val_windows, seed
        self.cache = data.cache_dir_for(path)

    def _tokens(self) -> tuple[object, torch.Tensor]:
        text = data.load_text(self.path)
        tok = data.build_tokenizer(text, "bpe", vocab_size=self.vocab_size, cache_dir=self.cache)
        return tok, data.encode_corpus(text, tok, cache_dir=self.cache)

    def prepare_data(self) -> None:  # one process per machine: learn the BPE and encode, into the cache
        self._tokens()

    def setup(self, stage: str) -> None:  # every process: read the cache
        self.tokenizer, tokens = self._tokens()
        self.train_tokens, self.val_tokens = data.split_tokens(tokens)
        self.unigram = data.unigram_loss(self.train_tokens, self.val_tokens, self.tokenizer.vocab_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Windows(self.train_tokens, self.train_windows, self.block_size, self.seed),
                          batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Windows(self.val_tokens, self.val_windows, self.block_size, self.seed + 1),
                          batch_size=self.batch_size)


class GPTModule(pl.LightningModule):
    def __init__(self, block_size: int, lr: float = 3e-3, warmup: int = 20, steps: int = 200):
        super().__init__()
        self.save_hyperparameters()
        self.model: GPT | None = None

    def configure_model(self) -> None:
        # built once the data module has set up (the BPE's real vocabulary size is known then), on every rank
        # with the same seed; the strategy broadcasts rank 0's weights anyway
        if self.model is None:
            torch.manual_seed(0)
            vocab = self.trainer.datamodule.tokenizer.vocab_size
            self.model = GPT(GPTConfig(vocab_size=vocab, block_size=self.hparams.block_size))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, loss = self.model(*batch)
        self.log("train_loss", loss, prog_bar=True)  # this replica's value: no sync_dist between rounds
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        _, loss = self.model(*batch)
        self.log("val_loss", loss, prog_bar=True)  # each replica evaluates itself; the logger shows rank 0

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.95), weight_decay=0.1)
        warmup, total = self.hparams.warmup, max(self.hparams.steps, self.hparams.warmup + 1)

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10 %
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

        sch = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


class PipelinedGPTModule(GPTModule):
    """:class:`GPTModule` as pipeline stages: the strategy's contract for ``pipeline_stages > 1``. The module holds
    no parameters itself; ``configure_pipeline_stage`` returns this rank's stage, which the strategy keeps as
    ``self.pipeline_module`` (so ``self.parameters()`` in ``configure_optimizers`` are the stage's)."""

    def configure_model(self) -> None:  # the model is built per stage, below
        pass

    def configure_pipeline_stage(self, stage: int, stages: int) -> torch.nn.Module:
        # the same seed on every rank: the stages of one replica fit together (and replicas start alike)
        torch.manual_seed(0)
        vocab = self.trainer.datamodule.tokenizer.vocab_size
        return GPT(GPTConfig(vocab_size=vocab, block_size=self.hparams.block_size)).split(stages)[stage]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)  # mean over the microbatch

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.trainer.strategy.pipeline_step(*batch)  # forward + backward through the replica's stages
        self.log("train_loss", loss, prog_bar=True)  # the replica's loss, on each of its stages
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.trainer.strategy.pipeline_eval(*batch), prog_bar=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="text file or folder (default: the bundled corpus)")
    p.add_argument("--workers", type=int, default=4, help="processes = replicas x stages")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages per replica (default: no pipeline)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per batch with --stages")
    p.add_argument("--steps", type=int, default=200, help="inner steps per replica")
    p.add_argument("--sync-every", type=int, default=None, help="inner steps per outer round (default: 50)")
    p.add_argument("--topology", default=None, help="random (default), exponential, ring or allreduce")
    p.add_argument("--codec", default=None, help="Mix2 codec, e.g. lowrank (default), dense or bf16")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="outer Nesterov momentum (default 0.9; with only a few rounds 0.3 avoids overshooting)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--val-every", type=int, default=50, help="validate every N steps")
    p.add_argument("--out", default="runs/pretrain_lightning")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))

    gossip = {k: v for k, v in (("sync_every", args.sync_every), ("topology", args.topology),
                                ("codec", args.codec), ("outer_momentum", args.outer_momentum)) if v is not None}
    if args.stages is not None:
        if args.stages < 1 or args.workers % args.stages:
            p.error(f"--stages must be >= 1 and divide --workers ({args.workers}), got {args.stages}")
        gossip.update(pipeline_stages=args.stages, n_microbatches=args.microbatches)
    strategy = FGDiLoCoStrategy(**gossip) if gossip else "fgdiloco"
    replicas = args.workers // (args.stages or 1)
    dm = TextData(args.data, args.vocab_size, args.block_size, args.batch_size,
                  train_windows=args.steps * args.batch_size * replicas)
    monitor = GossipMonitor()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.workers,
        max_steps=args.steps,
        max_epochs=1,  # the data module holds exactly --steps batches per replica (and the progress bar says so)
        val_check_interval=args.val_every,
        num_sanity_val_steps=0,
        callbacks=[monitor],
        logger=CSVLogger(args.out),
        log_every_n_steps=10,
        enable_checkpointing=False,
    )
    module = (PipelinedGPTModule if args.stages is not None else GPTModule)(args.block_size, steps=args.steps)
    trainer.fit(module, datamodule=dm)

    fgd = trainer.strategy.fgdiloco
    if trainer.is_global_zero:
        last = monitor.history[-1] if monitor.history else {}
        pipe = trainer.strategy.pipeline
        if pipe is not None:
            print(f"\n{replicas} replicas x {args.stages} stages ({pipe.schedule_name}, {pipe.n_microbatches} "
                  f"microbatches): rank 0 sent {pipe.activation_bytes_sent_total / 1e6:.1f} MB of activations and "
                  f"gradients, last step's bubble {pipe.last_step.bubble:.0%}", end="")
        print(f"\n{replicas} replicas, {fgd.round} outer rounds of {fgd.sync_every} steps; "
              f"held-out loss {float(trainer.callback_metrics['val_loss']):.3f} "
              f"(unigram baseline {dm.unigram:.3f}); last round: utilisation "
              f"{last.get('gossip/utilisation', float('nan')):.0%}, consensus distance "
              f"{last.get('gossip/consensus_distance', float('nan')):.3g}, "
              f"{last.get('gossip/bytes_sent', 0) / 1e6:.2f} MB sent; logs in {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
