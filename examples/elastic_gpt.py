"""Pretrain a small GPT as an *elastic* FG-DiLoCo job: workers may die, hang, come back or join.

    fgdiloco launch --workers 4 --max-restarts 3 examples/elastic_gpt.py --checkpoint-dir ckpt

Every worker is its own single-process ``torchrun`` job (``fgdiloco launch`` starts them and serves the gossip
store); the script is the plain-PyTorch loop with three additions: ``FGDiLoCo(..., elastic=True)``, a checkpoint
per worker every ``--checkpoint-every`` rounds (atomic), and loading it when torchrun restarts the worker. The
restarted worker rejoins at the job's live round by itself (``opt.rejoin()`` runs at its first step).

``--crash-worker K --crash-round R`` makes worker K die (``os._exit``) at round R of its first life, to watch a
restart and rejoin; ``--fail-at-start-worker K`` makes it die before it builds anything (in its first
``--fail-at-start-lives`` lives); ``--leave-worker K --leave-round R`` makes it leave early (``opt.close()``: a
departure notice). When the gossip store is out of reach for ``--store-timeout`` seconds, ``opt.step()`` raises
``StoreUnreachable``: the worker stops with its last checkpoint, and ``fgdiloco launch --resume`` (the same command
again) continues from it.
``--join-when PATH`` builds everything, then waits for PATH to exist before it joins (a joiner that arrives at a
chosen moment). ``--chaos`` (for ``benchmarks.chaos``): SIGUSR1 makes the worker leave cleanly at its next step
(``opt.close()``, exit 0), and SIGUSR2 makes it send bad frames for ``--chaos-bad-rounds`` outer rounds
(alternately corrupt: a byte flipped; and foreign: another model layout's fingerprint), which its peers reject.
``--results DIR`` writes ``DIR/worker<k>.pid`` when a worker starts (kept afterwards) and ``DIR/worker<k>.json``
(rounds trained, held-out loss, rejoins, failed exchanges and their messages) when it finishes.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

from fgdiloco import FGDiLoCo
from fgdiloco.pretrain import data
from fgdiloco.pretrain.model import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--data", default=None, help="text file or folder (default: the bundled corpus)")
p.add_argument("--rounds", type=int, default=20, help="outer rounds")
p.add_argument("--sync-every", type=int, default=10, help="H, inner steps per outer round")
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--block-size", type=int, default=64)
p.add_argument("--n-layer", type=int, default=2)
p.add_argument("--n-embd", type=int, default=64)
p.add_argument("--vocab-size", type=int, default=1024)
p.add_argument("--timeout", type=float, default=60.0, help="seconds an exchange may take at most")
p.add_argument("--store-timeout", type=float, default=60.0,
               help="seconds to train on without the gossip store, then checkpoint and stop (resume later)")
p.add_argument("--checkpoint-dir", default=None, help="write <dir>/worker<k>.pt (and resume from it)")
p.add_argument("--checkpoint-every", type=int, default=1, help="rounds between checkpoints")
p.add_argument("--crash-worker", type=int, default=None, help="this worker dies at --crash-round (first life)")
p.add_argument("--crash-round", type=int, default=3)
p.add_argument("--fail-at-start-worker", type=int, default=None,
               help="this worker dies before it builds anything, in its first --fail-at-start-lives lives")
p.add_argument("--fail-at-start-lives", type=int, default=1)
p.add_argument("--leave-worker", type=int, default=None, help="this worker leaves (close()) at --leave-round")
p.add_argument("--leave-round", type=int, default=3)
p.add_argument("--results", default=None, help="write <dir>/worker<k>.json at the end")
p.add_argument("--join-when", default=None,
               help="build everything, then wait for this file to exist before joining the job (a joiner that "
                    "arrives at a chosen moment, whatever its start-up costs)")
p.add_argument("--chaos", action="store_true", help="SIGUSR1: leave cleanly; SIGUSR2: send bad frames for a while")
p.add_argument("--chaos-bad-rounds", type=int, default=2, help="outer rounds of bad frames per SIGUSR2")
args = p.parse_args()
chaos = {"leave": False, "bad_left": 0, "bad_count": 0}
if args.chaos:  # installed before anything else, so no signal of benchmarks.chaos ever meets the default action
    import fgdiloco.gossip.mix as _mix

    _real_encode = _mix.encode_frame

    def _bad_encode(*a, **kw):  # a broken or foreign peer, as its receivers see it
        if chaos["bad_left"] <= 0:
            return _real_encode(*a, **kw)
        if chaos["bad_count"] % 2 and kw.get("fingerprint"):  # foreign: another model's layout
            return _real_encode(*a, **dict(kw, fingerprint=bytes(b ^ 0xFF for b in kw["fingerprint"])))
        frame = bytearray(_real_encode(*a, **kw))  # corrupt: one byte flipped in the middle
        frame[len(frame) // 2] ^= 0xFF
        return bytes(frame)

    _mix.encode_frame = _bad_encode
    signal.signal(signal.SIGUSR1, lambda *_: chaos.update(leave=True))
    signal.signal(signal.SIGUSR2, lambda *_: chaos.update(bad_left=args.chaos_bad_rounds,
                                                          bad_count=chaos["bad_count"] + 1))

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
worker = int(os.environ["FGDILOCO_WORKER"])  # fgdiloco launch sets it (and FGDILOCO_STORE, FGDILOCO_WORKERS)
life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun counts this worker's restarts
if args.fail_at_start_worker == worker and life < args.fail_at_start_lives:
    print(f"worker {worker}: failing at start (life {life}, --fail-at-start-worker)", flush=True)
    os._exit(1)

cache = data.cache_dir_for(args.data)  # built once by whoever gets there first; later workers load it
text = data.load_text(args.data)
tok = data.build_tokenizer(text, "bpe", vocab_size=args.vocab_size, cache_dir=cache)
train, val = data.split_tokens(data.encode_corpus(text, tok, cache_dir=cache))
val_batches = [data.sample_batch(val, 16, args.block_size, torch.Generator().manual_seed(i)) for i in range(4)]

while args.join_when and not Path(args.join_when).exists():
    time.sleep(0.05)
torch.manual_seed(0)  # the same initial model on every worker (an elastic job has no broadcast)
model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=4,
                      n_embd=args.n_embd, dropout=0.0))
inner = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
opt = FGDiLoCo(model, inner, sync_every=args.sync_every, outer_momentum=0.3, timeout=args.timeout,
               store_timeout=args.store_timeout, elastic=True)
gen = torch.Generator().manual_seed(1000 + worker)  # each worker samples its own batches

ckpt = Path(args.checkpoint_dir) / f"worker{worker}.pt" if args.checkpoint_dir else None
if ckpt is not None and ckpt.exists():  # a restart: our own last checkpoint, then rejoin at the live round
    state = torch.load(ckpt, weights_only=False)
    opt.load_state_dict(state["fgdiloco"])
    gen.set_state(state["batches"])
    print(f"worker {worker} (life {life}): resumed from {ckpt} at round {opt.round} at {time.time():.3f}", flush=True)


@torch.no_grad()
def held_out_loss() -> float:
    model.eval()
    loss = sum(model(x, y)[1].item() for x, y in val_batches) / len(val_batches)
    model.train()
    return loss


if args.results:
    Path(args.results).mkdir(parents=True, exist_ok=True)
    (Path(args.results) / f"worker{worker}.pid").write_text(str(os.getpid()))
trained, failed, errors, t0 = [], 0, [], time.time()
while opt.round < args.rounds:
    if args.leave_worker == worker and opt.round == args.leave_round:
        print(f"worker {worker}: leaving at round {opt.round} (--leave-worker)", flush=True)
        break
    if chaos["leave"]:
        print(f"worker {worker}: leaving at round {opt.round} (SIGUSR1) at {time.time():.3f}", flush=True)
        break
    if args.crash_worker == worker and life == 0 and opt.round == args.crash_round:
        print(f"worker {worker}: dying at round {opt.round} (--crash-worker) at {time.time():.3f}", flush=True)
        os._exit(1)
    x, y = data.sample_batch(train, args.batch_size, args.block_size, gen)
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = opt.round
    opt.step()  # every sync_every-th step also runs the outer round (and the first may rejoin the live round)
    opt.zero_grad()
    if opt.round != before and opt.last_round is not None and opt.last_round.round == before:
        s = opt.last_round
        trained.append(s.round)
        failed += s.failed_exchanges
        errors += [f"round {s.round}: {e}" for e in s.errors]
        chaos["bad_left"] -= 1
        print(f"worker {worker} round {s.round:3d}  train {loss.item():.3f}  failed {s.failed_exchanges}  "
              f"rejoins {s.rejoins}  at {time.time():.3f}", flush=True)
        if ckpt is not None and opt.round % args.checkpoint_every == 0:
            tmp = ckpt.with_suffix(".tmp")
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"fgdiloco": opt.state_dict(), "batches": gen.get_state()}, tmp)
            os.replace(tmp, ckpt)  # atomic: a worker killed mid-write keeps its previous checkpoint
loss = held_out_loss()
print(f"worker {worker} done at round {opt.round}, held-out loss {loss:.4f}, rejoins {opt.rejoins}", flush=True)
opt.close()
if args.results:
    Path(args.results).mkdir(parents=True, exist_ok=True)
    (Path(args.results) / f"worker{worker}.json").write_text(json.dumps({
        "worker": worker, "life": life, "rounds_trained": trained, "held_out_loss": loss, "rejoins": opt.rejoins,
        "failed_exchanges": failed, "errors": errors, "final_round": opt.round, "seconds": time.time() - t0,
        "left": chaos["leave"]}))
