"""``fgdiloco pretrain --device``: the resolution logic with torch.cuda.is_available / device_count monkeypatched
(no GPU needed), bf16 autocast only where the GPU has it, batches and the model left alone on the CPU."""

from __future__ import annotations

import argparse

import pytest
import torch

from fgdiloco.pretrain import device as dev
from fgdiloco.pretrain.config import TrainConfig, add_train_arguments


def _gpus(monkeypatch, n: int, capability: tuple[int, int] = (9, 0)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)


def test_auto_without_a_gpu_is_the_cpu(monkeypatch):
    _gpus(monkeypatch, 0)
    p = dev.resolve_device("auto", worker=3, workers=4)
    assert p.device == torch.device("cpu") and not p.shared and not p.bf16
    with pytest.raises(RuntimeError, match="no CUDA device"):
        dev.resolve_device("cuda", worker=0, workers=1)


@pytest.mark.parametrize("gpus, workers, want, shared", [
    (4, 4, [0, 1, 2, 3], False),  # one GPU per worker
    (8, 2, [0, 1], False),
    (2, 4, [0, 1, 0, 1], True),  # workers share GPUs
    (1, 2, [0, 0], True),
])
def test_workers_take_gpus_round_robin(monkeypatch, gpus, workers, want, shared):
    _gpus(monkeypatch, gpus)
    for choice in ("auto", "cuda"):
        got = [dev.resolve_device(choice, worker=w, workers=workers) for w in range(workers)]
        assert [p.device for p in got] == [torch.device("cuda", i) for i in want]
        assert all(p.shared == shared and p.bf16 for p in got)


def test_cpu_is_the_cpu_even_with_gpus(monkeypatch):
    _gpus(monkeypatch, 2)
    assert dev.resolve_device("cpu", worker=1, workers=2).device == torch.device("cpu")
    with pytest.raises(ValueError, match="one of auto, cpu, cuda"):
        dev.resolve_device("tpu", worker=0, workers=1)


def test_bf16_autocast_only_where_the_gpu_has_it(monkeypatch):
    _gpus(monkeypatch, 1, capability=(7, 0))  # a V100: no native bf16
    assert not dev.resolve_device("cuda", worker=0, workers=1).bf16
    _gpus(monkeypatch, 1, capability=(8, 0))
    assert dev.resolve_device("cuda", worker=0, workers=1).bf16
    cpu = dev.Placement(torch.device("cpu"))
    with cpu.autocast():
        assert not torch.is_autocast_enabled()


def test_a_cpu_placement_moves_nothing():
    batches = lambda step: (torch.zeros(2, 3), torch.ones(2, 3))
    assert dev.on_device(batches, torch.device("cpu")) is batches
    model, evals = torch.nn.Linear(3, 3), [(torch.zeros(1), torch.zeros(1))]
    assert dev.place(dev.Placement(torch.device("cpu")), model, evals) is evals


def test_device_is_a_field_and_a_flag(monkeypatch):
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_train_arguments(p)
    assert TrainConfig.from_arguments(p.parse_args([])).device == "auto"
    assert TrainConfig.from_arguments(p.parse_args(["--device", "cpu"])).device == "cpu"
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "tpu"])
    _gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="no CUDA device"):
        TrainConfig(device="cuda").validate()
