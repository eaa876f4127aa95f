"""A small Lightning run with ``strategy="fgdiloco"`` that the tests start as a subprocess.

``python tests/lightning_scripts/train.py --out DIR [options]``: Lightning's popen launcher re-executes this command
line for every other rank, so it must not run under pytest. Every rank writes ``DIR/rank{r}.pt`` with what it saw:
the flat parameters after each outer round and at the end, step times, learning rates, the GossipMonitor's history.

The model, data and inner optimizer are defined here (``make_model``, ``make_dataset``, ``make_inner_optimizer``)
so that the tests' plain-wrapper reference uses exactly the same ones.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IN, HIDDEN = 8, 16
INNER_LR = 1e-2


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def make_dataset(n: int, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_stage(seed: int, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``make_model(seed)`` split in two: ``[Linear, Tanh]`` and ``[Linear]`` (``stages=1``: the
    whole model). Chained, the stages are ``make_model(seed)`` with the same parameters."""
    layers = list(make_model(seed))
    if stages == 1:
        return nn.Sequential(*layers)
    if stages != 2:
        raise ValueError(f"the test model splits into 1 or 2 stages, got {stages}")
    return nn.Sequential(*(layers[:2] if stage == 0 else layers[2:]))


# --gpt K: a 2-block GPT in pipeline stages (K > 0: GPT(subspace_rank=K) built for its split, whose boundaries send
# K numbers per token each way; K = 0: the plain split), on token sequences of a noisy walk over the vocabulary
GPT_CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def make_gpt_stage(subspace_rank: int | None, stage: int, stages: int, seed: int,
                   stage_embeddings: bool = False) -> nn.Module:
    """Stage ``stage`` of ``stages`` of the seeded GPT (:func:`fgdiloco.pretrain.build_stage`)."""
    from fgdiloco.pretrain import build_stage
    from fgdiloco.pretrain.model import GPTConfig

    return build_stage(GPTConfig(**GPT_CONFIG), stages, stage, subspace_rank=subspace_rank, seed=seed,
                       stage_embeddings=stage_embeddings)


def make_token_dataset(n: int, seed: int = 4321) -> TensorDataset:
    """``n`` sequences of ``block_size`` token ids and their next-token targets: a walk of random steps in
    {1, 2, 3} modulo the vocabulary, learnable from the context."""
    g = torch.Generator().manual_seed(seed)
    vocab, block = GPT_CONFIG["vocab_size"], GPT_CONFIG["block_size"]
    walk = torch.randint(0, vocab, (n, 1), generator=g) + torch.randint(1, 4, (n, block + 1), generator=g).cumsum(1)
    walk = walk % vocab
    return TensorDataset(walk[:, :-1], walk[:, 1:])


def make_inner_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=INNER_LR)


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy-string", action="store_true", help="strategy='fgdiloco' with its defaults")
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--topology", default="random")
    p.add_argument("--mix2-rounds", type=int, default=1)
    p.add_argument("--codec", default=None, help="Mix2's codec (default: the strategy's)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--uneven", type=int, default=None,
                   help="ranks >= 1 train on this many samples (rank 0 on --samples), without DistributedSampler")
    p.add_argument("--timeout", type=float, default=30.0, help="FGDiLoCo's gossip timeout")
    p.add_argument("--store-timeout", type=float, default=None, help="FGDiLoCo's store_timeout (default: its own)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--manual", action="store_true")
    p.add_argument("--scheduler", action="store_true", help="StepLR(step_size=1, gamma=0.9) every step")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=50.0)
    p.add_argument("--csv", default=None, help="CSVLogger directory")
    p.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint at every epoch end (save_top_k=1)")
    p.add_argument("--keep-checkpoints", action="store_true", help="ModelCheckpoint(save_top_k=-1): keep all")
    p.add_argument("--ckpt-name", default="{epoch}", help="ModelCheckpoint's filename")
    p.add_argument("--top-k", type=int, default=None,
                   help="ModelCheckpoint(monitor='val_loss', mode='min', save_top_k=K) after every validation")
    p.add_argument("--val-losses", default=None,
                   help="the Regressor validates every epoch and logs, without sync_dist, val_loss = the e-th "
                        "number of rank r's row at epoch e: rows separated by '/', numbers by ',' "
                        "('0.1,2,0.5/2,1,0.5'): a per-rank metric the ranks rank differently")
    p.add_argument("--resume", default=None, help="ckpt_path for trainer.fit")
    p.add_argument("--resume-latest", action="store_true",
                   help="resume from the newest checkpoint in --ckpt-dir when there is one (a torchrun restart)")
    p.add_argument("--validate-ckpt", default=None, help="after fit: trainer.validate(ckpt_path=...)")
    p.add_argument("--growth-patience", type=int, default=5)
    p.add_argument("--stages", type=int, default=0,
                   help="pipeline_stages (> 0: the module implements configure_pipeline_stage)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--val", action="store_true", help="validate every epoch (through pipeline_eval with --stages)")
    p.add_argument("--gpt", type=int, default=None, metavar="K",
                   help="with --stages: the pipelined GPT (K > 0: subspace_rank=K, its codec from the module's "
                        "configure_activation_codec; 0: the plain split)")
    p.add_argument("--stage-embeddings", action="store_true",
                   help="with --gpt K > 0: GPT(stage_embeddings=True), every stage re-embeds the token ids")
    p.add_argument("--codec-arg", action="store_true",
                   help="with --gpt: pass the codec as the strategy's activation_codec= instead of the hook")
    p.add_argument("--die-rank", type=int, default=None,
                   help="this global rank dies (--die-by) before training batch --die-step, in the first attempt "
                        "only (under torchrun: while TORCHELASTIC_RESTART_COUNT is 0)")
    p.add_argument("--die-step", type=int, default=None, help="with --die-rank: the global step it dies at")
    p.add_argument("--die-by", choices=("exit", "sigterm"), default="exit",
                   help="with --die-rank: os._exit(1), or a SIGTERM to itself (what a scheduler or kill sends)")
    p.add_argument("--save-rounds", action="store_true",
                   help="after every round, write (global step, parameters) of the rounds so far to "
                        "OUT/rank{r}.attempt{a}.rounds.pt (a: TORCHELASTIC_RESTART_COUNT), kept when the rank dies")
    args = p.parse_args(argv)
    if (args.die_rank is None) != (args.die_step is None):
        p.error("--die-rank and --die-step go together")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger

    import fgdiloco  # noqa: F401 - registers "fgdiloco"
    from lightning_callbacks import FGDiLoCoStrategy, GossipMonitor

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(args.seed)
            self.automatic_optimization = not args.manual

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):
            if self.global_rank == args.slow_rank:
                time.sleep(args.slow_ms / 1000)  # a simulated slow machine
            x, y = batch
            loss = ((self(x) - y) ** 2).mean()
            self.log("train_loss", loss, prog_bar=True)  # rank-local: no sync_dist
            if args.manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
                sch = self.lr_schedulers()
                if sch is not None:
                    sch.step()
                return None
            return loss

        def configure_optimizers(self):
            opt = make_inner_optimizer(self.parameters())
            if not args.scheduler:
                return opt
            sch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}

        if args.val_losses is not None:
            def validation_step(self, batch, batch_idx):
                row = args.val_losses.split("/")[self.global_rank].split(",")
                self.log("val_loss", float(row[self.current_epoch]))  # rank-local: no sync_dist

            def val_dataloader(self):
                return DataLoader(make_dataset(16, seed=99), batch_size=args.batch_size)

        def train_dataloader(self):
            # Lightning replaces the sampler by DistributedSampler(shuffle=True, seed=0) and sets its epoch
            if args.uneven is not None and self.global_rank > 0:
                return DataLoader(make_dataset(args.uneven), batch_size=args.batch_size)
            return DataLoader(make_dataset(args.samples), batch_size=args.batch_size)

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.round_params: list[torch.Tensor] = []
            self.round_steps: list[int] = []
            self.step_times: list[tuple[float, bool]] = []
            self.lrs: list[float] = []
            self._last_end: float | None = None
            self._round = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            fgd = trainer.strategy.fgdiloco
            synced = fgd.round != self._round
            if self._last_end is not None:
                self.step_times.append((now - self._last_end, synced))
            if synced:
                self._round = fgd.round
                self.round_params.append(flat_params(pl_module))
                if args.save_rounds:
                    self.round_steps.append(trainer.global_step)
                    os.makedirs(args.out, exist_ok=True)
                    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                    # written whole or not at all: the agent's SIGTERM may land inside the save
                    path = os.path.join(args.out, f"rank{trainer.global_rank}.attempt{attempt}.rounds.pt")
                    torch.save(list(zip(self.round_steps, self.round_params)), path + ".tmp")
                    os.replace(path + ".tmp", path)
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
            self._last_end = time.perf_counter()

        def on_train_start(self, trainer, pl_module):
            self._round = trainer.strategy.fgdiloco.round

    class PipelinedRegressor(pl.LightningModule):
        """The same regressor under the pipeline contract: no parameters of its own, one stage per rank."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not args.manual

        def configure_pipeline_stage(self, stage: int, stages: int) -> nn.Module:
            return make_stage(args.seed, stage, stages)

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return ((output - target) ** 2).mean()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.trainer.strategy.pipeline_step(x, y)
            self.log("train_loss", loss, prog_bar=True)
            if args.manual:
                opt = self.optimizers()
                self.manual_backward(loss)  # a no-op after pipeline_step (the backward ran in the pipeline)
                opt.step()
                opt.zero_grad()
                return None
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", self.trainer.strategy.pipeline_eval(x, y))

        def configure_optimizers(self):
            return make_inner_optimizer(self.parameters())

        def train_dataloader(self):
            return DataLoader(make_dataset(args.samples), batch_size=args.batch_size)

        def val_dataloader(self):
            return DataLoader(make_dataset(32, seed=99), batch_size=args.batch_size)

    class PipelinedGPT(pl.LightningModule):
        """The GPT under the pipeline contract; records each step's loss and the bytes its boundary sent."""

        def __init__(self) -> None:
            super().__init__()
            self.step_losses: list[float] = []
            self.step_bytes: list[tuple[int, int]] = []

        def configure_pipeline_stage(self, stage: int, stages: int) -> nn.Module:
            return make_gpt_stage(args.gpt or None, stage, stages, args.seed, args.stage_embeddings)

        if not args.codec_arg:
            def configure_activation_codec(self, stage: int, stages: int):
                from fgdiloco.pretrain import activation_codec_for

                return activation_codec_for(self.pipeline_module)  # None for the plain split

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            from fgdiloco.pretrain import lm_loss

            return lm_loss(output, target)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.trainer.strategy.pipeline_step(x, y)
            self.log("train_loss", loss)
            last = self.trainer.strategy.pipeline.last_step
            self.step_losses.append(float(loss))
            self.step_bytes.append((last.forward_bytes_sent, last.backward_bytes_sent))
            return loss

        def configure_optimizers(self):
            return make_inner_optimizer(self.parameters())

        def train_dataloader(self):
            return DataLoader(make_token_dataset(args.samples), batch_size=args.batch_size)

    if args.strategy_string:
        strategy = "fgdiloco"
    else:
        pipeline = {} if not args.stages else dict(pipeline_stages=args.stages, n_microbatches=args.microbatches,
                                                    pipeline_schedule=args.schedule)
        settings = {} if args.codec is None else {"codec": args.codec}
        if args.store_timeout is not None:
            settings["store_timeout"] = args.store_timeout
        if args.codec_arg:
            from fgdiloco.pretrain import activation_codec_for

            pipeline["activation_codec"] = activation_codec_for  # called with this rank's stage
        strategy = FGDiLoCoStrategy(sync_every=args.sync_every, topology=args.topology, outer_lr=args.outer_lr,
                                    mix2_rounds=args.mix2_rounds, seed=args.seed, timeout=args.timeout, **pipeline,
                                    **settings)
    class Die(pl.Callback):
        """Rank ``--die-rank`` exits at once, without clean-up (``--die-by sigterm``: sends itself SIGTERM), when
        global step ``--die-step`` is reached; it prints the time first."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank == args.die_rank and trainer.global_step == args.die_step:
                print(f"rank {args.die_rank} dies at step {args.die_step} (by {args.die_by}) at {time.time():.3f}",
                      flush=True)
                if args.die_by == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                os._exit(1)

    recorder = Recorder()
    monitor = GossipMonitor(growth_patience=args.growth_patience)
    callbacks = [recorder, monitor]
    if args.die_rank is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        callbacks.append(Die())
    if args.ckpt_dir and args.top_k is not None:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename=args.ckpt_name, monitor="val_loss",
                                         mode="min", save_top_k=args.top_k, save_last=False))
    elif args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename=args.ckpt_name,
                                         save_top_k=-1 if args.keep_checkpoints else 1,
                                         every_n_epochs=1, save_last=False))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        logger=CSVLogger(args.csv, name="run") if args.csv else False,
        callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_model_summary=False,
        enable_progress_bar=False,
        log_every_n_steps=1,
        use_distributed_sampler=args.uneven is None,
        num_sanity_val_steps=0,
        **({"limit_val_batches": 0} if args.stages and not args.val else {}),
    )
    model = (PipelinedGPT() if args.gpt is not None else PipelinedRegressor()) if args.stages else Regressor()
    resume = args.resume
    if args.resume_latest:
        if not args.ckpt_dir:
            p.error("--resume-latest needs --ckpt-dir")
        found = sorted(Path(args.ckpt_dir).glob("*.ckpt"), key=lambda f: f.stat().st_mtime)
        resume = str(found[-1]) if found else None
    try:
        trainer.fit(model, ckpt_path=resume)
    except BaseException as err:
        # what ended this rank, in a file of its own: the ranks' tracebacks share one pipe, where a traceback longer
        # than the pipe's atomic write (4 KiB) can be cut by another rank's lines
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, f"rank{trainer.global_rank}.error").write_text(f"{type(err).__name__}: {err}")
        raise

    fgd = trainer.strategy.fgdiloco
    out = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "fgdiloco_kwargs": trainer.strategy.fgdiloco_kwargs,
        "rounds": fgd.round,
        "inner_steps_in_round": fgd.outer.steps_in_round,
        "global_step": trainer.global_step,
        "round_params": recorder.round_params,
        "final_params": flat_params(model),
        "step_times": recorder.step_times,
        "lrs": recorder.lrs,
        "history": monitor.history,
        "progress_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        "failed_exchanges_total": fgd.failed_exchanges_total,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "replica": getattr(trainer.strategy, "replica", None),
        "stage": getattr(trainer.strategy, "stage", None),
        "pipeline": repr(trainer.strategy.pipeline) if getattr(trainer.strategy, "pipeline", None) else None,
        "step_losses": getattr(model, "step_losses", None),
        "step_bytes": getattr(model, "step_bytes", None),
        "resumed_from": resume,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "best_model_path": trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else None,
        "best_k_models": sorted(trainer.checkpoint_callback.best_k_models) if trainer.checkpoint_callback else None,
        "codec_needs_inputs": getattr(getattr(trainer.strategy, "pipeline", None), "codec_needs_inputs", None),
    }
    if args.validate_ckpt:
        metrics = trainer.validate(model, ckpt_path=args.validate_ckpt, verbose=False)
        out["validate"] = {"params": flat_params(model), "metrics": {k: float(v) for k, v in metrics[0].items()}}
    os.makedirs(args.out, exist_ok=True)
    torch.save(out, os.path.join(args.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
