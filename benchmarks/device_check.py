"""The prepared device check: the GPU path end to end on one GPU, in under 8 minutes. Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.device_check

One line per check with its figure (``ok`` / ``MISS`` against its target); exit status 0 when every check ran and
met its target, 1 otherwise, 2 (with a one-line reason) when no CUDA device exists. Each check runs in its own
process (``--part NAME``), so one that crashes or hangs costs only its own time limit.

Checks: ``gpu-tests`` (pytest tests/test_cuda.py); ``wrapper`` (2 processes sharing the GPU, gossip over Gloo;
Mix1 utilisation with Mix2 off, target >= 99 % at H = 20); ``pipeline`` (2 stages on the GPU, their boundaries
staged through the host over Gloo); ``lightning`` (the strategy with ``accelerator="gpu"``); ``pretrain``
(``fgdiloco pretrain --device cuda --steps 60``); ``overhead`` (wrapper vs plain AdamW per inner step, target <=
1.02x; a round's staging copies against the round at H = 20, target <= 5 %).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

H = 20
PARTS = ("gpu-tests", "wrapper", "pipeline", "lightning", "pretrain", "overhead")
#: seconds each check may take: 465 in all, under the 8 minutes the check is sized for
LIMITS = {"gpu-tests": 90, "wrapper": 75, "pipeline": 45, "lightning": 75, "pretrain": 120, "overhead": 60}


def _gpt(seed: int = 0):
    from fgdiloco.pretrain.model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256))


def _batch(step: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 2048, (16, 129), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


def _line(name: str, figure: str, ok: bool) -> int:
    print(f"CHECK {name}: {figure} {'ok' if ok else 'MISS'}", flush=True)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------- parts
def part_gpu_tests() -> int:
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider"],
                       capture_output=True, text=True)
    last = (r.stdout.strip().splitlines() or ["no output"])[-1]
    return _line("gpu-tests", last, r.returncode == 0 and "skipped" not in last)


def _wrapper_rank(rank: int, world: int, mix2_rounds: int) -> dict:
    from fgdiloco import FGDiLoCo

    torch.cuda.set_device(0)  # both processes share the one GPU
    model = _gpt().cuda()
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=H, timeout=30.0,
                   mix2_rounds=mix2_rounds)
    stats = []
    for step in range(4 * H):
        _, loss = model(*_batch(step * world + rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % H == 0:
            stats.append(opt.last_round)
    opt.close()
    later = stats[1:]  # the first round holds the warm-up (kernels, pair groups)
    return {"util": min(s.utilisation for s in later), "mix1_wait": max(s.mix1_wait_seconds for s in later),
            "failed": sum(s.failed_exchanges for s in stats), "device": str(opt.outer.theta0[0].device),
            "staged": opt.staging.copies}


def part_wrapper() -> int:
    from fgdiloco.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        on = run_ranks(_wrapper_rank, 2, tmp, 1, timeout=35)
        off = run_ranks(_wrapper_rank, 2, tmp, 0, timeout=35)
    util = min(r["util"] for r in off)
    ok = all(r["failed"] == 0 and r["device"].startswith("cuda") and r["staged"] > 0 for r in on + off)
    return _line("wrapper", f"2 processes on 1 GPU, Gloo gossip: Mix2 on util {min(r['util'] for r in on):.3f}, "
                 f"Mix2 off util {util:.4f} (target >= 0.99), Mix1 wait {max(r['mix1_wait'] for r in off):.4f} s, "
                 f"failed exchanges {sum(r['failed'] for r in on + off)}", ok and util >= 0.99)


def _pipeline_rank(rank: int, world: int) -> dict:
    import torch.nn.functional as F

    from fgdiloco import FGDiLoCo, ReplicaMesh
    from fgdiloco.pipeline import Pipeline

    torch.cuda.set_device(0)
    mesh = ReplicaMesh(1, 2)
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    stage = (torch.nn.Sequential(full[0], full[1]) if mesh.stage == 0 else full[2]).cuda()
    pipe = Pipeline(stage, mesh, F.mse_loss, 2, "1f1b", device="cuda")
    opt = FGDiLoCo(stage, torch.optim.AdamW(stage.parameters(), lr=1e-2), sync_every=5, mesh=mesh)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g).cuda()
    y = x[:, :1].sin()
    losses = []
    t0 = time.perf_counter()
    for _ in range(40):
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(float(loss))
    opt.close()
    return {"staged": pipe.staged, "backend": mesh.pipeline_backend, "losses": losses,
            "ms": 1e3 * (time.perf_counter() - t0) / 40}


def part_pipeline() -> int:
    from fgdiloco.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(_pipeline_rank, 2, tmp, timeout=40)
    losses = out[1]["losses"]
    ok = all(r["staged"] for r in out) and losses[-1] < losses[0]
    return _line("pipeline", f"2 stages on 1 GPU over {out[0]['backend']} (staged {out[0]['staged']}): loss "
                 f"{losses[0]:.4f} -> {losses[-1]:.4f}, {out[0]['ms']:.1f} ms/step", ok)


_LIGHTNING = r"""
import torch, pytorch_lightning as pl
from lightning_callbacks import FGDiLoCoStrategy
class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                                          torch.nn.Linear(32, 1))
    def training_step(self, batch, i):
        x, y = batch; loss = torch.nn.functional.mse_loss(self.net(x), y); self.log("loss", loss); return loss
    def configure_optimizers(self): return torch.optim.AdamW(self.parameters(), lr=1e-2)
x = torch.randn(512, 16); y = x[:, :1].sin()
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
m = M()
t = pl.Trainer(strategy=FGDiLoCoStrategy(sync_every=4), accelerator="gpu", devices=1, max_epochs=2,
               logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
t.fit(m, dl)
print("RESULT", float(t.callback_metrics["loss"]), next(m.parameters()).device, t.global_step)
"""


def part_lightning() -> int:
    r = subprocess.run([sys.executable, "-c", _LIGHTNING], capture_output=True, text=True)
    got = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    if r.returncode or not got:
        return _line("lightning", f"failed: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}", False)
    _, loss, device, steps = got[-1].split()
    return _line("lightning", f"FGDiLoCoStrategy on {device}: final loss {float(loss):.4f} after {steps} steps",
                 device.startswith("cuda"))


def part_pretrain() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "fgdiloco", "pretrain", "--device", "cuda", "--steps", "60",
                            "--workers", "2", "--quiet", "--out", os.path.join(tmp, "run")],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
    tail = (r.stdout.strip().splitlines() or r.stderr.strip().splitlines() or ["no output"])[-1]
    return _line("pretrain", f"--device cuda --steps 60 --workers 2: rc {r.returncode} in {wall:.0f} s; "
                 f"{tail[:200]}", r.returncode == 0)


def _median_block(model, opt, steps: int, start: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(start, start + steps):
        _, loss = model(*_batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def part_overhead() -> int:
    from fgdiloco import FGDiLoCo
    from fgdiloco.gossip.staging import HostStaging

    plain_model, fg_model = _gpt().cuda(), _gpt().cuda()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    fg = FGDiLoCo(fg_model, torch.optim.AdamW(fg_model.parameters(), lr=1e-3), sync_every=10_000)
    _median_block(plain_model, plain, 5, 0)
    _median_block(fg_model, fg, 5, 0)
    a, b = [], []
    for r in range(7):
        a.append(_median_block(plain_model, plain, 10, 100 * r))
        b.append(_median_block(fg_model, fg, 10, 100 * r))
    ratio = statistics.median(b) / statistics.median(a)
    step = statistics.median(a)
    # a round's staging: Mix1 (parameters + momentum) and Mix2 (the pseudo-gradient) to the host, the results back
    s, theta = HostStaging(), [p.detach().float() for p in fg_model.parameters()]
    mom = [torch.zeros_like(t) for t in theta]
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h1 = s.to_host(theta + mom, ("mix1", 0)).wait()
        h2 = s.to_host(theta, ("mix2", 0)).wait()
        HostStaging.to_device(h1, theta + mom)
        HostStaging.to_device(h2, theta)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    copy = statistics.median(times[1:])
    share = copy / (H * step + copy)
    fg.close()
    ok = ratio <= 1.02 and share <= 0.05
    return _line("overhead", f"wrapper/plain AdamW per inner step {ratio:.3f}x (target <= 1.02; {1e3 * step:.2f} "
                 f"ms/step); staging copies {1e3 * copy:.2f} ms = {100 * share:.2f} % of a round at H = {H} "
                 f"(target <= 5 %)", ok)


# ---------------------------------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, help="run one check in this process")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("device_check: no CUDA device (torch.cuda.is_available() is False): nothing to check", flush=True)
        return 2
    if args.part:
        return globals()["part_" + args.part.replace("-", "_")]()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    failed = []
    t0 = time.perf_counter()
    for name in PARTS:
        try:
            r = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--part", name], env=env,
                               capture_output=True, text=True, timeout=LIMITS[name])
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("CHECK ")]
            print(lines[-1] if lines else f"CHECK {name}: crashed (rc {r.returncode}): "
                  f"{(r.stderr.strip().splitlines() or ['no output'])[-1][:200]} MISS", flush=True)
            if r.returncode or not lines:
                failed.append(name)
        except subprocess.TimeoutExpired:
            print(f"CHECK {name}: timed out after {LIMITS[name]} s MISS", flush=True)
            failed.append(name)
    print(f"device_check: {len(PARTS) - len(failed)}/{len(PARTS)} checks met their targets in "
          f"{time.perf_counter() - t0:.0f} s" + (f"; missed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
