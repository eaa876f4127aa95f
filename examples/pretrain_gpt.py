"""Pretrain a small GPT with Factored Gossip DiLoCo: the plain-PyTorch way in.

    torchrun --standalone --nproc_per_node=4 examples/pretrain_gpt.py [--data PATH] [--steps 200]

Each process is one worker with its own replica. It takes ordinary AdamW steps on its own batches;
``FGDiLoCo`` gossips with a peer every ``--sync-every`` steps, inside ``opt.step()``.
(``fgdiloco pretrain`` does the same with metrics, plots and a DDP baseline.)
"""

import argparse
import os

import torch
import torch.distributed as dist

from fgdiloco import FGDiLoCo
from fgdiloco.pretrain import data
from fgdiloco.pretrain.model import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--data", default=None, help="text file or folder (default: the bundled corpus)")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--sync-every", type=int, default=25)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--block-size", type=int, default=128)
args = p.parse_args()

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()

# Data: rank 0 trains and caches the tokenizer first; the other ranks then load it from the cache.
cache = data.cache_dir_for(args.data)
if rank != 0:
    dist.barrier()
text = data.load_text(args.data)
tok = data.build_tokenizer(text, "bpe", vocab_size=2048, cache_dir=cache)
tokens = data.encode_corpus(text, tok, cache_dir=cache)
if rank == 0:
    dist.barrier()
train, val = data.split_tokens(tokens)
gen = torch.Generator().manual_seed(1000 + rank)  # each worker samples its own batches
val_batches = [data.sample_batch(val, 16, args.block_size, torch.Generator().manual_seed(i)) for i in range(4)]

torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=args.block_size))
inner = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
opt = FGDiLoCo(model, inner, sync_every=args.sync_every, topology="random")  # collective: all ranks


@torch.no_grad()
def held_out_loss() -> float:
    model.eval()
    loss = sum(model(x, y)[1].item() for x, y in val_batches) / len(val_batches)
    model.train()
    return loss


if rank == 0:
    print(f"{world} workers, unigram baseline {data.unigram_loss(train, val, tok.vocab_size):.3f}, "
          f"step 0 held-out loss {held_out_loss():.3f}", flush=True)
for step in range(args.steps):
    for g in inner.param_groups:  # short linear warm-up
        g["lr"] = 3e-3 * min(1.0, (step + 1) / 20)
    x, y = data.sample_batch(train, args.batch_size, args.block_size, gen)
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()  # every sync_every-th step also runs the outer round
    opt.zero_grad()
    if (step + 1) % args.sync_every == 0 and rank == 0:
        s = opt.last_round
        print(f"round {opt.round:3d}  step {step + 1:4d}  train {loss.item():.3f}  held-out {held_out_loss():.3f}  "
              f"util {s.utilisation:.0%}  sent {s.bytes_sent / 1e6:.1f} MB  consensus {s.consensus_distance or 0:.3g}",
              flush=True)
opt.close()
dist.destroy_process_group()
