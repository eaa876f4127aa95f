"""An *elastic pipeline* FG-DiLoCo job: each replica is its model's S stages, and a replica that loses a stage
restarts as a whole and rejoins while the other replicas train on.

    fgdiloco launch --workers 2 --stages 2 --max-restarts 3 examples/elastic_pipeline.py --checkpoint-dir ckpt

``fgdiloco launch --stages S`` runs every worker slot (a replica) as its own ``torchrun`` job of S processes, its
stages; torchrun restarts the S together when one dies. The script's additions to a plain pipeline loop:
``init_replica_group`` (the replica's process group, fresh on every restart), ``ReplicaMesh(1, S)`` (one replica:
the others are other jobs), ``FGDiLoCo(..., mesh=mesh, elastic=True)`` (each stage gossips with the same stage of
the other replicas), and a checkpoint per stage. ``--crash-worker K --crash-stage S --crash-round R`` makes that
stage die (``os._exit``) at round R of its first life; ``--results DIR`` writes ``DIR/worker<k>.stage<s>.json``;
``--log-rounds`` prints a line per outer round and stage (``benchmarks.chaos --pipeline`` reads them).
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from fgdiloco import FGDiLoCo, ReplicaMesh
from fgdiloco.elastic import init_replica_group
from fgdiloco.pipeline import Pipeline
from fgdiloco.pretrain import GPT, GPTConfig, lm_loss

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=20, help="outer rounds")
p.add_argument("--sync-every", type=int, default=4, help="H, inner steps per outer round")
p.add_argument("--checkpoint-dir", default=None, help="write <dir>/worker<k>.stage<s>.pt (and resume from it)")
p.add_argument("--crash-worker", type=int, default=None)
p.add_argument("--crash-stage", type=int, default=0)
p.add_argument("--crash-round", type=int, default=3)
p.add_argument("--results", default=None)
p.add_argument("--log-rounds", action="store_true", help="print a line per outer round (with its time)")
args = p.parse_args()

torch.set_num_threads(1)
worker = int(os.environ["FGDILOCO_WORKER"])  # fgdiloco launch sets it: this replica's slot
life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
init_replica_group("gloo")  # this replica's stages (torchrun --nproc-per-node S), on a store prefix of this life
mesh = ReplicaMesh(1, int(os.environ["WORLD_SIZE"]))
torch.manual_seed(0)  # the same model on every process: its stages fit together, the replicas start equal
config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
stage = GPT(config).split(mesh.stages)[mesh.stage]
pipe = Pipeline(stage, mesh, lm_loss, n_microbatches=2)
opt = FGDiLoCo(stage, torch.optim.AdamW(stage.parameters(), lr=3e-3), sync_every=args.sync_every, elastic=True,
               mesh=mesh)
ckpt = Path(args.checkpoint_dir) / f"worker{worker}.stage{mesh.stage}.pt" if args.checkpoint_dir else None
if ckpt is not None and ckpt.exists():  # a restart: this stage's own checkpoint, then the replica rejoins
    opt.load_state_dict(torch.load(ckpt, weights_only=False))
# The stages' checkpoints can be a round apart (a death between two stages' saves): the replica's stages first enter
# the same round (the live one, collectively), then seed their data from it, so that they read the same batches
opt.rejoin()
batches = torch.Generator().manual_seed(1000 * worker + opt.round)  # each stage draws one batch per step
losses = []
while opt.round < args.rounds:
    if (args.crash_worker, args.crash_stage, args.crash_round) == (worker, mesh.stage, opt.round) and life == 0:
        os._exit(1)
    walk = (torch.randint(0, 64, (8, 1), generator=batches) + torch.randint(1, 4, (8, 17), generator=batches)
            .cumsum(1)) % 64  # a learnable sequence: random steps of 1-3 around the vocabulary
    loss = pipe.step(walk[:, :-1], walk[:, 1:])  # forward + backward through the replica; the loss on the last stage
    before = opt.round
    opt.step()
    opt.zero_grad()
    if loss is not None:
        losses.append(loss.item())
    if args.log_rounds and opt.round != before and opt.last_round is not None and opt.last_round.round == before:
        print(f"worker {worker} stage {mesh.stage} round {before:3d}  loss {losses[-1] if losses else 0.0:.3f}  "
              f"failed {opt.last_round.failed_exchanges}  at {time.time():.3f}", flush=True)
    if ckpt is not None and opt.round != before:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save(opt.state_dict(), ckpt.with_suffix(".tmp"))
        os.replace(ckpt.with_suffix(".tmp"), ckpt)  # atomic
print(f"worker {worker} stage {mesh.stage} (life {life}) done at round {opt.round}, rejoins {opt.rejoins}", flush=True)
opt.close()
if args.results:
    Path(args.results).mkdir(parents=True, exist_ok=True)
    (Path(args.results) / f"worker{worker}.stage{mesh.stage}.json").write_text(json.dumps({
        "life": life, "round": opt.round, "rejoins": opt.rejoins, "losses": losses}))
