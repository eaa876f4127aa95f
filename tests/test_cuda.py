"""GPU tests of the device-aware data path (fgdiloco.gossip.staging, the wrapper on CUDA parameters, a staged
pipeline boundary, --device). They skip, with the reason, where no CUDA device exists; benchmarks/device_check.py
runs them on a GPU with the multi-process checks. Their CPU halves: tests/test_staging.py, tests/test_device.py."""

from __future__ import annotations

import threading

import pytest
import torch

from fgdiloco import FGDiLoCo, LocalHub
from fgdiloco.gossip.staging import HostBoundary, HostStaging
from tests.reference import INNER_LR, batch, make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False); run "
                                       "benchmarks/device_check.py on a GPU machine")


def test_cuda_values_are_staged_into_reused_pinned_buffers():
    s = HostStaging()
    x = [torch.randn(64, 32, device="cuda"), torch.randn(7, device="cuda")]
    first = s.to_host(x, ("mix1", 0)).wait()
    assert all(b.is_pinned() and b.device.type == "cpu" for b in first)
    assert all(torch.equal(b, t.cpu()) for b, t in zip(first, x))
    ptrs = [b.data_ptr() for b in first]
    y = [t * 2 for t in x]
    second = s.to_host(y, ("mix1", 0)).wait()
    assert [b.data_ptr() for b in second] == ptrs and s.allocations == 2
    assert all(torch.equal(b, t.cpu()) for b, t in zip(second, y))
    back = HostStaging.to_device(second, x)
    assert all(b.device == t.device for b, t in zip(back, x))


def test_the_copy_waits_for_pending_work_on_the_current_stream():
    s = HostStaging()
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        a = a @ a / a.norm()  # queued work the copy must see the end of
    got = s.to_host([a], "x").wait()[0]
    assert torch.equal(got, a.cpu())


def _two_workers(device: str, rounds: int = 3) -> list[list[torch.Tensor]]:
    hub = LocalHub(2)
    models = [make_model(seed=rank).to(device) for rank in range(2)]
    out: list = [None, None]

    def worker(rank: int) -> None:
        model = models[rank]
        opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=2,
                       transport=hub.transport(rank), timeout=30.0, broadcast_init=False, codec="dense")
        for step in range(2 * rounds):
            x, y = batch(rank, step)
            ((model(x.to(device)) - y.to(device)) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        for t in opt.outer.theta0 + opt.outer.momentum:
            assert t.device.type == device and t.dtype == torch.float32
        out[rank] = [p.detach().cpu() for p in model.parameters()]
        opt.close()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_the_wrapper_on_cuda_parameters_follows_the_cpu_run():
    cpu, cuda = _two_workers("cpu"), _two_workers("cuda")
    for a, b in zip(cpu, cuda):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_a_host_boundary_stage_computes_on_the_gpu_and_sends_from_the_host():
    lin = torch.nn.Linear(8, 4).cuda()
    stage = HostBoundary(lin, "cuda")
    x = torch.randn(3, 8, requires_grad=True)  # a received (host) activation
    out = stage(x)
    assert out.device.type == "cpu"
    out.sum().backward()
    assert x.grad is not None and x.grad.device.type == "cpu" and lin.weight.grad.device.type == "cuda"


def test_device_auto_picks_the_gpu_with_bf16_where_supported():
    from fgdiloco.pretrain.device import resolve_device

    p = resolve_device("auto", worker=1, workers=2)
    assert p.device.type == "cuda" and p.device.index == 1 % torch.cuda.device_count()
    assert p.bf16 == (torch.cuda.get_device_capability(p.device.index)[0] >= 8)
