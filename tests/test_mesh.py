"""ReplicaMesh and FGDiLoCo over replicas × stages: the grid's groups, argument checks, gossip that never crosses
stages, DiLoCo equivalence of 2 replicas × 2 stages, a dead stage stopping only its replica, the example GPT."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fgdiloco import Dense, FGDiLoCo, LocalHub, ReplicaMesh
from fgdiloco.gossip.mix import Mixer
from fgdiloco.gossip.topology import make_topology
from fgdiloco.pipeline import Pipeline, PipelineError
from fgdiloco.pretrain import GPT, GPTConfig, lm_loss
from fgdiloco.testing import run_ranks
from tests.reference import INNER_LR, batch, diloco_reference, make_model
from tests.test_pipeline import split_mlp

H = 4


def _layout(rank: int, world: int) -> dict:
    mesh = ReplicaMesh(2, 2, timeout=30.0)
    gossip = torch.tensor([float(rank)])
    dist.all_reduce(gossip, group=mesh.gossip_group)  # CPU tensor on the Gloo gossip group
    pipeline = torch.tensor([float(rank)])
    dist.all_reduce(pipeline, group=mesh.pipeline_group)
    # identical stage layouts on both stages: only the stage index tells their frames apart
    torch.manual_seed(rank)
    layer = nn.Linear(4, 4)
    opt = FGDiLoCo(layer, torch.optim.SGD(layer.parameters(), lr=0.1), sync_every=2, mesh=mesh)
    try:
        FGDiLoCo(layer, torch.optim.SGD(layer.parameters(), lr=0.1), sync_every=2, mesh=mesh,
                 process_group=dist.group.WORLD)
        both = "no error"
    except ValueError as e:
        both = str(e)
    return {
        "both": both,
        "coords": (mesh.replica, mesh.stage), "replicas": mesh.replicas, "stages": mesh.stages,
        "pipeline": dist.get_process_group_ranks(mesh.pipeline_group),
        "gossip": dist.get_process_group_ranks(mesh.gossip_group),
        "gossip_backend": dist.get_backend(mesh.gossip_group),
        "stage_ranks": mesh.stage_ranks(), "replica_ranks": mesh.replica_ranks(),
        "other": (mesh.stage_ranks(0), mesh.replica_ranks(1), mesh.rank_of(1, 0)),
        "sums": (gossip.item(), pipeline.item()), "fingerprint": opt.fingerprint,
        "gossip_world": (opt.rank, opt.world_size),
        "weight": layer.weight.detach().clone(), "repr": repr(mesh),
    }


def test_mesh_groups_coordinates_and_stage_fingerprints(tmp_path):
    res = run_ranks(_layout, 4, tmp_path)
    for rank, r in enumerate(res):
        replica, stage = divmod(rank, 2)
        assert r["coords"] == (replica, stage) and (r["replicas"], r["stages"]) == (2, 2)
        assert r["pipeline"] == r["stage_ranks"] == [2 * replica, 2 * replica + 1]
        assert r["gossip"] == r["replica_ranks"] == [stage, stage + 2]
        assert r["gossip_backend"] == "gloo"
        assert r["other"] == ([0, 1], [1, 3], 2)
        assert r["sums"] == (2 * stage + 2, 4 * replica + 1)
        assert r["gossip_world"] == (replica, 2)
        assert f"replica={replica}, stage={stage}" in r["repr"]
        assert r["both"] == "pass either mesh (gossip over mesh.gossip_group) or process_group, not both"
        # broadcast_init copied replica 0's stage, within the stage only
        torch.testing.assert_close(r["weight"], res[stage]["weight"], rtol=0, atol=0)
    assert not torch.equal(res[0]["weight"], res[1]["weight"])
    # one fingerprint per stage: equal across replicas, different across stages of the same layout
    assert res[0]["fingerprint"] == res[2]["fingerprint"] != res[1]["fingerprint"] == res[3]["fingerprint"]

    # a stage fed a frame of the other stage rejects it and keeps its own value (it is never mixed in)
    hub = LocalHub(2)
    fps = [res[0]["fingerprint"], res[1]["fingerprint"]]
    values = [[torch.full((4, 4), 1.0)], [torch.full((4, 4), 3.0)]]
    out: dict[int, object] = {}

    def worker(rank: int) -> None:
        mixer = Mixer("mix2", make_topology("random", 2, 0), hub.transport(rank), Dense(), 1, fps[rank], 10.0)
        out[rank] = mixer.run(values[rank], 0)

    import threading
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank in range(2):
        assert out[rank].failed == 1 and "rejected frame" in out[rank].errors[0]
        assert "fingerprint" in out[rank].errors[0]
        torch.testing.assert_close(out[rank].values[0], values[rank][0], rtol=0, atol=0)


def _bad_arguments(rank: int, world: int) -> list[str]:
    msgs = []
    for args, kwargs in [((3, 1), {}), ((0, 2), {}), ((2, 0), {}), ((2, 1.0), {}), ((True, 2), {}),
                         ((1, 2), {"stage_timeout": 0}), ((1, 2), {"timeout": "5"}), ((1, 2), {"process_group": 3})]:
        try:
            ReplicaMesh(*args, **kwargs)
        except (TypeError, ValueError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    sub = dist.new_group([0])
    if rank == 0:
        try:
            ReplicaMesh(1, 1, sub)
        except ValueError as e:
            msgs.append(f"{type(e).__name__}: {e}")
    mesh = ReplicaMesh(2, 1, dist.group.WORLD)  # nothing was built by the failed calls: a valid mesh still works
    msgs.append(repr(mesh))
    # both ranks have built the mesh's groups before either exits: a rank that left while its peer was still in
    # Gloo's connect made the peer fail with "connection closed by peer" (seen once in a fresh-clone CI)
    dist.barrier(group=mesh.gossip_group)
    return msgs


def test_bad_arguments_raise_naming_the_argument_before_building_anything(tmp_path):
    msgs = run_ranks(_bad_arguments, 2, tmp_path)[0]
    want = ["ValueError: replicas * stages must equal the world size 2, got replicas=3 x stages=1 = 3",
            "ValueError: replicas must be an int >= 1, got 0",
            "ValueError: stages must be an int >= 1, got 0",
            "TypeError: stages must be an int >= 1, got float",
            "TypeError: replicas must be an int >= 1, got bool",
            "ValueError: stage_timeout must be seconds > 0 (a finite number), got 0",
            "TypeError: timeout must be seconds > 0 (a finite number), got str",
            "TypeError: process_group must be a torch.distributed ProcessGroup or None, got int"]
    assert msgs[: len(want)] == want
    assert msgs[len(want)].startswith("ValueError: process_group must hold every rank of the default group")
    assert msgs[-1].startswith("ReplicaMesh(replicas=2, stages=1, rank=0")


def test_mesh_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ReplicaMesh(1, 1)


def test_wrapper_rejects_a_mesh_of_the_wrong_type_or_with_a_process_group():
    model = make_model()
    with pytest.raises(TypeError, match="mesh must be a fgdiloco.ReplicaMesh or None, got str"):
        FGDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, mesh="2x2")


# ------------------------------------------------------------------ 2 replicas x 2 stages of the reference MLP
def _train(rank: int, world: int, schedule: str, topology: str, rounds: int, die_at: int | None) -> dict:
    mesh = ReplicaMesh(2, 2, timeout=5.0)
    stage = split_mlp(make_model(seed=0))[mesh.stage]
    pipe = Pipeline(stage, mesh, torch.nn.functional.mse_loss, 4, schedule)
    opt = FGDiLoCo(stage, torch.optim.AdamW(stage.parameters(), lr=INNER_LR), sync_every=H, topology=topology,
                   codec="dense", mix1_codec="dense", mesh=mesh, timeout=2.0, outer_momentum=0.5 if die_at else 0.9)
    failed = []
    for step in range(rounds * H):
        if rank == 3 and step == die_at:
            os._exit(0)  # stage 1 of replica 1 dies in the middle of a round
        x, y = batch(mesh.replica, step)
        t0 = time.monotonic()
        try:
            pipe.step(x, y)
        except PipelineError as e:
            return {"error": str(e), "missing": e.rank, "seconds": time.monotonic() - t0, "step": step}
        opt.step()
        opt.zero_grad()
        if (step + 1) % H == 0:
            failed.append(opt.last_round.failed_exchanges)
    return {"params": [p.detach().clone() for p in stage.parameters()], "round": opt.round, "failed": failed,
            "errors": opt.last_round.errors}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_replicas_of_two_stages_with_allreduce_are_diloco(tmp_path, schedule):
    rounds = 3
    res = run_ranks(_train, 4, tmp_path, schedule, "allreduce", rounds, None)
    want = diloco_reference([make_model(seed=0).state_dict()] * 2, rounds, H)
    for rank, r in enumerate(res):
        replica, stage = divmod(rank, 2)
        assert r["round"] == rounds and sum(r["failed"]) == 0
        for got, w in zip(r["params"], want[replica][2 * stage: 2 * stage + 2]):
            torch.testing.assert_close(got, w, rtol=0, atol=1e-5)


def test_a_dead_stage_stops_its_replica_and_the_other_replica_trains_on(tmp_path):
    rounds, die_at = 5, H + 2
    res = run_ranks(_train, 4, tmp_path, "1f1b", "random", rounds, die_at, allow_missing=(3,), timeout=120)
    assert res[3] is None
    stopped = res[2]
    assert stopped["missing"] == 3 and stopped["step"] == die_at
    assert "rank 3 (stage 1 of replica 1) is dead, hung or stopped" in stopped["error"]
    assert stopped["seconds"] < 5.0 + 1.5  # a dead peer fails at once; at most the mesh timeout
    for rank in (0, 1):
        r = res[rank]
        assert r["round"] == rounds  # replica 0 finished every round
        assert sum(r["failed"][:1]) == 0  # round 0, before the death: no failure
        assert sum(r["failed"][1:]) >= 2  # its exchanges with replica 1's stage failed and were counted
        assert all(torch.isfinite(p).all() for p in r["params"])


# ------------------------------------------------------------------ 2 x 2 random gossip on the example GPT
GPT_CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _gpt_batch(replica: int, step: int, b: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up by a stride (mod 32) from a random start: learnable, different per replica."""
    g = torch.Generator().manual_seed(7919 * replica + step)
    start = torch.randint(0, 32, (b, 1), generator=g)
    stride = torch.randint(1, 4, (b, 1), generator=g)
    seq = (start + stride * torch.arange(GPT_CFG.block_size + 1)) % 32
    return seq[:, :-1], seq[:, 1:]


def _gpt(rank: int, world: int, rounds: int) -> dict:
    mesh = ReplicaMesh(2, 2, timeout=20.0)
    torch.manual_seed(0)
    stage = GPT(GPT_CFG).split(2)[mesh.stage]
    pipe = Pipeline(stage, mesh, lm_loss, 2, "1f1b")
    # with 2 replicas a lossless pairwise round is the exact average; low-rank Mix2 leaves them apart
    opt = FGDiLoCo(stage, torch.optim.AdamW(stage.parameters(), lr=3e-3), sync_every=H, topology="random",
                   codec="lowrank", mesh=mesh, timeout=20.0, outer_momentum=0.3, seed=1)
    held_out = [_gpt_batch(100 + i, 0) for i in range(2)]

    def evaluate() -> float | None:
        losses = [pipe.eval_loss(x, y) for x, y in held_out]
        return None if losses[0] is None else float(sum(losses) / len(losses))

    evals = [evaluate()]
    for step in range(rounds * H):
        pipe.step(*_gpt_batch(mesh.replica, step))
        opt.step()
        opt.zero_grad()
        if (step + 1) % H == 0:
            evals.append(evaluate())
    return {"evals": evals, "params": [p.detach().clone() for p in stage.parameters()],
            "failed": opt.failed_exchanges_total, "activation_bytes": pipe.activation_bytes_sent_total,
            "mix_bytes": opt.last_round.bytes_sent}


def test_two_by_two_random_gossip_on_the_example_gpt_trains_and_replicas_differ(tmp_path):
    rounds = 4
    res = run_ranks(_gpt, 4, tmp_path, rounds, timeout=240)
    for rank in (1, 3):  # the last stages hold the loss
        evals = res[rank]["evals"]
        assert evals[-1] < 0.8 * evals[0], evals
    assert all(r["failed"] == 0 for r in res)
    for stage in (0, 1):  # gossip averages, but does not make replicas equal between exact rounds
        a, b = res[stage]["params"], res[2 + stage]["params"]
        gap = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))
        assert gap > 1e-3, gap
    # stage 0 sends activations [8, 16, 32] fp32 forward per step; stage 1 their gradients back
    assert res[0]["activation_bytes"] == res[1]["activation_bytes"] == rounds * H * 8 * 16 * 32 * 4
    assert all(r["mix_bytes"] > 0 for r in res)
