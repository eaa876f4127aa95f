"""Run under torchrun by tests/test_launch.py: 2 workers, FG-DiLoCo over torchrun's own store."""

import json
import os
import sys

import torch
import torch.distributed as dist

from fgdiloco import FGDiLoCo
from tests.reference import INNER_LR, loss_of, make_model

dist.init_process_group("gloo")
rank = dist.get_rank()
model = make_model(seed=rank)  # different seeds: broadcast_init must make them equal
opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=3, topology="exponential",
               timeout=20.0)
start = [p.detach().clone() for p in model.parameters()]
for step in range(9):
    loss_of(model, rank, step).backward()
    opt.step()
    opt.zero_grad()
s = opt.last_round
out = {"rank": rank, "rounds": opt.round, "failed": opt.failed_exchanges_total, "mix2_bytes": s.mix2_bytes_received,
       "start": [p.flatten().tolist() for p in start]}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
opt.close()
dist.destroy_process_group()
