"""Pipeline: gradients equal the unsplit model's, held-out loss, byte and bubble counts, activation codecs,
faults (a dead or hung stage stops its replica with a PipelineError naming it), argument checks."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fgdiloco import ReplicaMesh
from fgdiloco.pipeline import Pipeline, PipelineError
from fgdiloco.testing import run_ranks
from tests.reference import batch, make_model

M = 4  # microbatches


def split_mlp(model: nn.Sequential) -> list[nn.Module]:
    """The reference MLP (Linear 6->12, Tanh, Linear 12->1) as two stages."""
    return [nn.Sequential(model[0], model[1]), nn.Sequential(model[2])]


def _grads(rank: int, world: int, schedule: str) -> dict:
    mesh = ReplicaMesh(1, 2)
    stage = split_mlp(make_model(seed=0))[mesh.stage]
    pipe = Pipeline(stage, mesh, F.mse_loss, M, schedule)
    x, y = batch(0, 0)
    loss = pipe.step(x, y)
    grads = [p.grad.clone() for p in stage.parameters()]
    held_out = pipe.eval_loss(*batch(0, 99))
    # a second step accumulates like loss.backward() does
    pipe.step(x, y)
    twice = [p.grad.clone() for p in stage.parameters()]
    return {"loss": loss, "grads": grads, "twice": twice, "eval": held_out, "stats": pipe.last_step.as_dict()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gradients_equal_the_unsplit_models(tmp_path, schedule):
    results = run_ranks(_grads, 2, tmp_path, schedule)
    model = make_model(seed=0)
    x, y = batch(0, 0)
    want_loss = F.mse_loss(model(x), y)
    want_loss.backward()
    want = [p.grad for p in model.parameters()]
    got = results[0]["grads"] + results[1]["grads"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    for g, w in zip(results[0]["twice"] + results[1]["twice"], want):
        torch.testing.assert_close(g, 2 * w, rtol=0, atol=2e-6)
    assert results[0]["loss"] is None and results[0]["eval"] is None
    torch.testing.assert_close(results[1]["loss"], want_loss.detach(), rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(results[1]["eval"], F.mse_loss(model(batch(0, 99)[0]), batch(0, 99)[1]),
                                   rtol=0, atol=1e-6)
    s0, s1 = results[0]["stats"], results[1]["stats"]
    # 16 rows of 12 float32 activations forward (stage 0), their gradients backward (stage 1)
    assert s0["forward_bytes_sent"] == 16 * 12 * 4 and s0["backward_bytes_sent"] == 0
    assert s1["forward_bytes_sent"] == 0 and s1["backward_bytes_sent"] == 16 * 12 * 4
    assert s0["bytes_received"] == s1["bytes_received"] == 16 * 12 * 4
    assert s0["activation_bytes_sent"] == s1["activation_bytes_sent"] == 768
    for s in (s0, s1):
        assert s["step"] == 1 and s["microbatches"] == M
        assert 0 < s["compute_seconds"] <= s["seconds"]
        assert 0 <= s["bubble"] < 1


# ------------------------------------------------------------------ activation codecs
class Projection(nn.Module):
    """A fixed orthonormal basis U (d x k): sends c = x U forward (k numbers per row), decodes x = c Uᵀ."""

    def __init__(self, d: int, k: int):
        super().__init__()
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(5)))
        self.register_buffer("basis", q[:, :k].contiguous())

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.basis

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        return c @ self.basis.T


def _codec_grads(rank: int, world: int, k: int, as_pair: bool) -> dict:
    mesh = ReplicaMesh(1, 2)
    stage = split_mlp(make_model(seed=0))[mesh.stage]
    codec = Projection(12, k)
    pipe = Pipeline(stage, mesh, F.mse_loss, M, "1f1b",
                    activation_codec=(codec.encode, codec.decode) if as_pair else codec)
    loss = pipe.step(*batch(0, 0))
    return {"grads": [p.grad for p in stage.parameters()], "loss": loss, "stats": pipe.last_step.as_dict()}


@pytest.mark.parametrize(("k", "as_pair"), [(4, False), (12, True)])
def test_an_activation_codec_compresses_both_directions_and_autograd_runs_through_it(tmp_path, k, as_pair):
    res = run_ranks(_codec_grads, 2, tmp_path, k, as_pair)
    # the unsplit model with the boundary projection x -> x U Uᵀ inserted (identity when k = d)
    model = make_model(seed=0)
    proj = Projection(12, k)
    x, y = batch(0, 0)
    loss = F.mse_loss(model[2](proj.decode(proj.encode(model[1](model[0](x))))), y)
    loss.backward()
    for g, w in zip(res[0]["grads"] + res[1]["grads"], [p.grad for p in model.parameters()]):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    torch.testing.assert_close(res[1]["loss"], loss.detach(), rtol=0, atol=1e-6)
    # k numbers per row travel forward, and k per row come back
    assert res[0]["stats"]["forward_bytes_sent"] == 16 * k * 4
    assert res[1]["stats"]["backward_bytes_sent"] == 16 * k * 4


# ------------------------------------------------------------------ faults
def split3(model: nn.Sequential) -> list[nn.Module]:
    return [model[0], model[1], model[2]]


def _fault(rank: int, world: int, kind: str, timeout: float) -> dict:
    mesh = ReplicaMesh(1, world, timeout=timeout)
    stage = (split_mlp if world == 2 else split3)(make_model(seed=0))[mesh.stage]
    pipe = Pipeline(stage, mesh, F.mse_loss, M, "1f1b")
    for step in range(6):
        if rank == world - 1 and step == 3:
            if kind == "dead":
                os._exit(0)
            os.kill(os.getpid(), signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            pipe.step(*batch(0, step))
        except PipelineError as e:
            seconds = time.monotonic() - t0
            try:
                pipe.step(*batch(0, step))
            except PipelineError as again:
                return {"step": step, "rank": e.rank, "ranks": e.ranks, "error": str(e), "seconds": seconds,
                        "again": str(again)}
        for p in stage.parameters():
            p.grad = None
    return {"step": None}


@pytest.mark.parametrize("kind", ["dead", "hung"])
def test_a_dead_or_hung_stage_makes_its_neighbour_raise_naming_it_within_the_timeout(tmp_path, kind):
    timeout = 2.0
    res = run_ranks(_fault, 2, tmp_path, kind, timeout, allow_missing=(1,), timeout=60)
    r = res[0]
    assert r["step"] == 3 and r["rank"] == 1
    assert "rank 1 (stage 1 of replica 0) is dead, hung or stopped" in r["error"]
    assert "mesh timeout of 2 s" in r["error"]
    if kind == "dead":
        assert r["seconds"] < timeout  # a closed connection fails at once
    else:
        assert timeout - 0.1 < r["seconds"] < timeout + 1.5
    assert r["again"].startswith("this pipeline is broken by an earlier failure")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dead", "hung"])
def test_in_three_stages_every_stage_names_only_the_lost_rank(tmp_path, kind):
    timeout = 4.0  # above the 2 s a stage could wait for the others if it did not wait for their timeouts
    res = run_ranks(_fault, 3, tmp_path, kind, timeout, allow_missing=(2,), timeout=60)
    for r in res[:2]:  # the stage next to the lost one and the stage beyond it alike; never the living first stage
        assert r["step"] == 3 and r["ranks"] == [2]
        assert ": rank 2 (stage 2 of replica 0) is dead, hung or stopped" in r["error"]
        # the middle stage, even when its neighbour is dead, waits for the first stage's announcement, which comes
        # when the first stage's transfer with it times out
        assert r["seconds"] < timeout + 1.5


def _model_error(rank: int, world: int) -> dict:
    mesh = ReplicaMesh(1, 2, timeout=10.0)
    stage = split_mlp(make_model(seed=0))[mesh.stage]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise KeyError("the loss failed")

    pipe = Pipeline(stage, mesh, loss_fn, 2, "gpipe")
    try:
        pipe.step(*batch(0, 0))
    except Exception as e:  # noqa: BLE001 - returned to the test
        return {"type": type(e).__name__, "msg": str(e), "rank": getattr(e, "rank", None)}
    return {"type": None}


def test_an_error_in_the_model_or_loss_propagates_unchanged(tmp_path):
    first, last = run_ranks(_model_error, 2, tmp_path, timeout=60)
    assert last == {"type": "KeyError", "msg": "'the loss failed'", "rank": None}
    # the last stage then exits: the first stage sees its neighbour gone
    assert first["type"] == "PipelineError" and first["rank"] == 1


# ------------------------------------------------------------------ arguments
def _bad_pipeline_arguments(rank: int, world: int) -> list[str]:
    mesh = ReplicaMesh(1, 2)
    stage = split_mlp(make_model(seed=0))[mesh.stage]
    msgs = []
    for kwargs in [{"n_microbatches": 0}, {"n_microbatches": 1}, {"n_microbatches": 2.0}, {"schedule": "zb"},
                   {"stage_module": "mlp"}, {"mesh": None}, {"loss_fn": 3}, {"activation_codec": (abs,)},
                   {"activation_codec": 3}]:
        args = {"stage_module": stage, "mesh": mesh, "loss_fn": F.mse_loss, "n_microbatches": 4, **kwargs}
        try:
            Pipeline(**args)
        except (TypeError, ValueError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    pipe = Pipeline(stage, mesh, F.mse_loss, 4)
    x, y = batch(0, 0)
    # every call here fails its checks before any transfer, so the stages need not make the same calls
    calls = [(x[:6], y), (None, y)] if mesh.stage == 0 else [(x, y[:6]), (x, None)]
    for inputs, target in calls:
        try:
            pipe.step(inputs, target)
        except ValueError as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def test_bad_pipeline_arguments_raise_naming_the_argument(tmp_path):
    first, last = run_ranks(_bad_pipeline_arguments, 2, tmp_path)
    want = ["ValueError: n_microbatches must be an int >= 1, got 0",
            "ValueError: n_microbatches must be >= stages (2) for the 1f1b schedule, got 1; use more microbatches "
            "or schedule='gpipe'",
            "TypeError: n_microbatches must be an int >= 1, got float",
            "ValueError: schedule must be one of ['1f1b', 'gpipe'], got 'zb'",
            "TypeError: stage_module must be a torch.nn.Module, got str",
            "TypeError: mesh must be a fgdiloco.ReplicaMesh, got NoneType",
            "TypeError: loss_fn must be callable (output, target) -> loss, got int",
            "TypeError: activation_codec as a tuple must be (encode, decode), two callables",
            "TypeError: activation_codec must be None, an (encode, decode) pair of callables or an object with "
            "encode() and decode() methods, got int"]
    assert first[: len(want)] == want and last[: len(want)] == want
    assert first[len(want)] == ("ValueError: inputs must be tensors whose dim 0 (the batch) is divisible by "
                                "n_microbatches=4, got (6, 6)")
    assert first[len(want) + 1] == "ValueError: inputs are required on the first stage"
    assert last[len(want)] == ("ValueError: target must be a tensor whose dim 0 (the batch) is divisible by "
                               "n_microbatches=4 on the last stage, got (6, 1)")
    assert last[len(want) + 1].endswith("on the last stage, got None")


# ------------------------------------------------------------------ the example GPT's split
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_gpt_split_computes_the_unsplit_models_function(stages):
    from fgdiloco.pretrain import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=8, n_layer=3, n_head=2, n_embd=16))
    parts = model.split(stages)
    idx = torch.randint(0, 40, (3, 8))
    h = idx
    for p in parts:
        h = p(h)
    logits, loss = model(idx, idx)
    torch.testing.assert_close(h, logits, rtol=0, atol=0)
    torch.testing.assert_close(lm_loss(h, idx), loss, rtol=0, atol=0)
    assert [list(p.layers) for p in parts] == {1: [[0, 1, 2]], 2: [[0, 1], [2]], 3: [[0], [1], [2]]}[stages]
    assert hasattr(parts[0], "wte") and hasattr(parts[-1], "lm_head")
    head, emb = parts[-1].lm_head.weight, parts[0].wte.weight
    torch.testing.assert_close(head, emb, rtol=0, atol=0)
    if stages == 1:
        assert head is emb  # one stage keeps the tie
    else:  # untied copies: the head trains on its own stage; the split never aliases the original model
        assert head.data_ptr() != emb.data_ptr()
    assert all(q.data_ptr() != o.data_ptr() for p in parts for q in p.parameters() for o in model.parameters())
    with pytest.raises(ValueError, match=r"stages must be in \[1, n_layer=3\]"):
        model.split(4)
    with pytest.raises(TypeError, match="stages must be an int"):
        model.split("2")
