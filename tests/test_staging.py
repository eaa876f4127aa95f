"""The device-aware data path on the CPU (fgdiloco.gossip.staging): the backend choice, the host buffers' reuse and
bookkeeping (forced staging of CPU tensors runs the CUDA path's code minus the stream), fp32 snapshot and momentum on
the parameters' device, and that a staged run is bit-identical to an unstaged one. GPU checks: tests/test_cuda.py."""

from __future__ import annotations

import threading

import pytest
import torch

from fgdiloco import FGDiLoCo, LocalHub
from fgdiloco.gossip.staging import HostBoundary, HostStaging, pipeline_backend
from tests.reference import INNER_LR, loss_of, make_model


@pytest.mark.parametrize("backend, gpus, ranks, want", [
    ("nccl", 2, 2, "nccl"),  # a GPU per stage
    ("nccl", 4, 2, "nccl"),
    ("nccl", 1, 2, "gloo"),  # stages sharing a GPU: NCCL refuses two ranks on one device
    ("nccl", 0, 1, "gloo"),
    ("gloo", 8, 2, "gloo"),  # a Gloo job stays on Gloo
    ("cpu:gloo,cuda:nccl", 2, 2, "nccl"),
])
def test_pipeline_backend(backend, gpus, ranks, want):
    assert pipeline_backend(backend, gpus=gpus, ranks_on_host=ranks) == want


def test_cpu_tensors_pass_through():
    s = HostStaging()
    x = [torch.randn(3, 4), torch.randn(5)]
    assert s.to_host(x, "a").wait()[0] is x[0]
    copied = s.to_host(x, "a", copy=True).wait()
    assert copied[0] is not x[0] and all(torch.equal(a, b) for a, b in zip(copied, x))
    assert s.allocations == 0 and s.copies == 0 and not s.needed(x)


def test_forced_staging_reuses_a_slots_buffers():
    s = HostStaging(force=True, pin=False)
    x = [torch.randn(3, 4), torch.randn(5)]
    first = s.to_host(x, ("mix1", 0)).wait()
    assert all(torch.equal(a, b) for a, b in zip(first, x)) and first[0] is not x[0]
    ptrs = [b.data_ptr() for b in first]
    y = [torch.randn(3, 4), torch.randn(5)]
    second = s.to_host(y, ("mix1", 0)).wait()
    assert [b.data_ptr() for b in second] == ptrs  # reused, overwritten
    assert all(torch.equal(a, b) for a, b in zip(second, y))
    assert s.allocations == 2 and s.copies == 4 and s.bytes == 2 * (12 + 5) * 4
    s.to_host(x, ("mix2", 0))  # another slot: its own buffers
    assert s.allocations == 4
    s.to_host([torch.randn(2, 2)], ("mix1", 0))  # another layout: new buffers
    assert s.allocations == 5


def test_to_device_follows_the_like_tensors():
    v = [torch.randn(3), torch.randn(2)]
    like = [torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)]
    out = HostStaging.to_device(v, like)
    assert out[0] is v[0]  # already there: no copy
    assert out[1].dtype == torch.bfloat16 and out[1].device == like[1].device


def test_host_boundary_moves_and_keeps_gradients():
    lin = torch.nn.Linear(3, 2)
    mid, last = HostBoundary(lin, "cpu"), HostBoundary(lin, "cpu", last=True)
    x = torch.randn(4, 3, requires_grad=True)
    mid(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert list(mid.parameters()) == list(lin.parameters())  # the schedule still sees the stage's parameters
    assert last(x).device.type == "cpu"


def test_bf16_model_keeps_fp32_snapshot_and_momentum_on_its_device():
    model = make_model().to(torch.bfloat16)
    opt = FGDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.01), sync_every=2)
    for _ in range(4):
        x = torch.randn(8, next(model.parameters()).shape[1], dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for t, p in zip(opt.outer.theta0 + opt.outer.momentum, list(model.parameters()) * 2):
        assert t.dtype == torch.float32 and t.device == p.device
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt.close()


def _pair(force: bool, rounds: int = 3) -> tuple[list[list[torch.Tensor]], list[HostStaging]]:
    hub = LocalHub(2)
    models = [make_model(seed=rank) for rank in range(2)]
    out: list = [None, None]
    stagings: list = [None, None]

    def worker(rank: int) -> None:
        model = models[rank]
        opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=2,
                       transport=hub.transport(rank), timeout=30.0, broadcast_init=False, mix_momentum=True)
        opt.staging = stagings[rank] = HostStaging(force=force, pin=False)
        for step in range(2 * rounds):
            loss_of(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
        out[rank] = [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.outer.momentum]
        opt.close()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out, stagings


def test_a_staged_run_is_bit_identical_and_allocates_once():
    plain, _ = _pair(force=False)
    staged, stagings = _pair(force=True)
    for a, b in zip(plain, staged):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    n = len(list(make_model().parameters()))
    for s in stagings:
        # Mix1 (parameters + momentum) and Mix2 (the pseudo-gradient): allocated in round 1, reused after
        assert s.allocations == 3 * n
        assert s.copies == 4 * 2 * n + 3 * n  # the next round's Mix1 starts as the third round ends
