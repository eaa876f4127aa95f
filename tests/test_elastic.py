"""Elastic workers (docs/faults.md): checked checkpoints, resume order, unsynchronised parameters, who may take part,
adaptive deadlines, departures and deaths. Multi-process tests run on real Gloo ranks (fgdiloco/testing.py)."""

from __future__ import annotations

import copy
import os
import signal
import time
import warnings

import pytest
import torch

from fgdiloco import FGDiLoCo
from fgdiloco.factor import Dense
from fgdiloco.gossip import Mixer, make_topology
from fgdiloco.gossip.mix import DEADLINE_MIN_SAMPLES
from fgdiloco.testing import run_ranks
from tests.reference import INNER_LR, loss_of, make_model

H = 3


def _opt(model=None, **kwargs) -> FGDiLoCo:
    model = model or make_model(seed=0)
    kwargs.setdefault("sync_every", H)
    return FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), **kwargs)


def _train(opt: FGDiLoCo, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        loss_of(opt.model, rank, step).backward()
        opt.step()
        opt.zero_grad()


def _flat(opt: FGDiLoCo) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in opt.model.parameters()]


# ------------------------------------------------------------------ checked load_state_dict
def _snapshot(opt: FGDiLoCo) -> dict:
    s = copy.deepcopy(opt.state_dict())
    s["_params"] = [p.detach().clone() for p in opt.model.parameters()]
    return s


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), k
            for u, v in zip(x, y):
                _assert_same({"v": u}, {"v": v})
        elif isinstance(x, dict):
            _assert_same(x, y)
        else:
            assert x == y, k


def _bad(state: dict, change) -> dict:
    s = copy.deepcopy(state)
    change(s)
    return s


def _shape(key: str):
    def f(s):
        s[key][0] = torch.zeros(3, 3)
    return f


BAD_STATES = {
    "no steps_in_round": (lambda s: s.pop("steps_in_round"), r"lacks the key 'steps_in_round'"),
    "no anchor": (lambda s: s.pop("anchor"), r"lacks the key 'anchor'"),
    "no momentum": (lambda s: s.pop("momentum"), r"lacks the key 'momentum'"),
    "no inner": (lambda s: s.pop("inner"), r"lacks the key 'inner'"),
    "no params": (lambda s: s.pop("params"), r"lacks the key 'params'"),
    "no rank": (lambda s: s.pop("rank"), r"lacks the key 'rank'"),
    "another rank": (lambda s: s.update(rank=1), r"saved by rank=1, this worker has rank=0"),
    "another world size": (lambda s: s.update(world_size=4), r"saved by world_size=4, this worker has world_size=1"),
    "version 99": (lambda s: s.update(version=99), r"not an FGDiLoCo state dict of version 1, 2, 3"),
    "not a dict": (lambda s: s.clear(), r"not an FGDiLoCo state dict"),
    "anchor shape": (_shape("anchor"), r"'anchor' entry for 0.weight has shape \(3, 3\), the model's parameter has "
                                       r"\(12, 6\)"),
    "momentum shape": (_shape("momentum"), r"'momentum' entry for 0.weight has shape"),
    "params shape": (_shape("params"), r"'params' entry for 0.weight has shape"),
    "anchor too short": (lambda s: s["anchor"].pop(), r"'anchor' must be a list of 4 tensors"),
    "anchor of ints": (lambda s: s["anchor"].__setitem__(1, torch.zeros(12, dtype=torch.long)),
                       r"'anchor' entry for 0.bias must be a floating-point tensor"),
    "momentum not a list": (lambda s: s.update(momentum=None), r"'momentum' must be a list of 4 tensors"),
    "steps_in_round past sync_every": (lambda s: s.update(steps_in_round=H), r"'steps_in_round' must be an int in"),
    "negative round": (lambda s: s.update(round=-1), r"'round' must be an int >= 0"),
    "inner groups": (lambda s: s["inner"]["param_groups"][0]["params"].pop(),
                     r"'inner' has parameter groups of sizes \[3\], the inner optimizer \[4\]"),
    "codec": (lambda s: s["codec"].update(name="int8"), r"saved with codec='int8', this run uses 'lowrank'"),
    "seed": (lambda s: s.update(seed=5), r"seed=5, this run uses seed=0"),
    "topology": (lambda s: s.update(topology="ring"), r"topology='ring', this run uses 'random'"),
    "layout": (lambda s: s.update(fingerprint=b"\0" * 8), r"another model layout"),
    "buffers": (lambda s: s["buffers"].update(extra=torch.zeros(1)), r"'buffers' must hold the model's buffers"),
    # the inner optimizer's state (AdamW): torch loads any of these, and the next step fails
    "inner exp_avg shape": (lambda s: s["inner"]["state"][0].update(exp_avg=torch.zeros(3)),
                            r"'inner' state 'exp_avg' of 0.weight has shape \(3,\), the inner optimizer's has "
                            r"\(12, 6\)"),
    "inner exp_avg not a tensor": (lambda s: s["inner"]["state"][1].update(exp_avg="x"),
                                   r"'inner' state 'exp_avg' of 0.bias must be a tensor, got str"),
    "inner no step": (lambda s: s["inner"]["state"][0].pop("step"), r"'inner' state of 0.weight lacks 'step'"),
    "inner state not a dict": (lambda s: s["inner"]["state"].update({0: 3}),
                               r"'inner' state of 0.weight must be a dict"),
    "inner state of no parameter": (lambda s: s["inner"]["state"].update({99: {}}),
                                    r"'inner' holds a state for the parameter id 99"),
    # the pseudo-gradient an overlapped Mix2 was mixing: one per parameter of the next round's fragment
    "overlap_delta not a list": (lambda s: s.update(overlap_delta="garbage"),
                                 r"'overlap_delta' must be a list of 4 tensors .*got str"),
    "overlap_delta too short": (lambda s: s.update(overlap_delta=[torch.zeros(1)]),
                                r"'overlap_delta' must be a list of 4 tensors .*got 1"),
    "overlap_delta shape": (lambda s: s.update(overlap_delta=[torch.zeros(3, 3)] * 4),
                            r"'overlap_delta' entry for 0.weight has shape \(3, 3\)"),
}

# a torch outer optimizer's state (Adam): torch loads most of these, and the next outer step fails
BAD_TORCH_OUTER_STATES = {
    "only exp_avg, a string": (lambda s: s["outer_optimizer"]["torch"]["state"].update({0: {"exp_avg": "x"}}),
                               r"'outer_optimizer' state of 0.weight lacks 'step'"),
    "exp_avg a string": (lambda s: s["outer_optimizer"]["torch"]["state"][0].update(exp_avg="x"),
                         r"'outer_optimizer' state 'exp_avg' of 0.weight must be a tensor, got str"),
    "exp_avg shape": (lambda s: s["outer_optimizer"]["torch"]["state"][2].update(exp_avg=torch.zeros(3)),
                      r"'outer_optimizer' state 'exp_avg' of 2.weight has shape \(3,\), the outer optimizer's has "
                      r"\(1, 12\)"),
    "exp_avg_sq missing": (lambda s: s["outer_optimizer"]["torch"]["state"][3].pop("exp_avg_sq"),
                           r"'outer_optimizer' state of 2.bias lacks 'exp_avg_sq'"),
    "not a torch state": (lambda s: s.update(outer_optimizer={"x": 1}),
                          r"'outer_optimizer' must be a torch outer optimizer's state"),
    "no param_groups": (lambda s: s["outer_optimizer"]["torch"].pop("param_groups"),
                        r"'outer_optimizer' must be a torch optimizer's state_dict\(\)"),
    "an extra group": (lambda s: s["outer_optimizer"]["torch"]["param_groups"].append({"params": [7], "lr": 1.0}),
                       r"'outer_optimizer' has parameter groups of sizes \[4, 1\], the outer optimizer \[4\]"),
    "another class": (lambda s: s["outer_optimizer"].update({"class": "torch.optim.sgd.SGD"}),
                      r"saved by torch.optim.sgd.SGD, this run's outer optimizer is torch.optim.adam.Adam"),
}


@pytest.mark.filterwarnings("ignore:outer_optimizer=.*Adam normalises:UserWarning")  # state, not convergence
@pytest.mark.parametrize(("outer", "name"), [(None, n) for n in BAD_STATES]
                         + [("adam", n) for n in BAD_TORCH_OUTER_STATES])
def test_every_bad_state_dict_raises_value_error_before_anything_changes(outer, name):
    """The built-in outer step's and a torch outer optimizer's (Adam: moments and step counts) bad states alike."""
    opt = _opt(outer_optimizer=outer)
    _train(opt, 0, 0, 2 * H + 1)  # stepped, mid-round: momentum, anchor and AdamW state are all non-trivial
    good = opt.state_dict()
    change, match = (BAD_STATES if outer is None else BAD_TORCH_OUTER_STATES)[name]
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(_bad(good, change))
    _assert_same(_snapshot(opt), before)
    _train(opt, 0, 2 * H + 1, 3 * H + 1)  # an outer step still works
    opt.load_state_dict(good)  # and the good one still loads
    opt.close()


@pytest.mark.filterwarnings("ignore:outer_optimizer=.*Adam normalises:UserWarning")  # state, not convergence
@pytest.mark.parametrize("outer", [None, "adam"])
def test_a_state_dict_is_a_copy_and_rewinds_the_wrapper_bit_for_bit(outer):
    """state_dict() copies the inner (AdamW) and outer optimizers' states too, and load_state_dict() keeps copies:
    training on changes neither the saved dict nor the next rewind from it."""
    opt = _opt(outer_optimizer=outer)
    _train(opt, 0, 0, H + 1)
    saved = opt.state_dict()
    kept = copy.deepcopy(saved)
    _train(opt, 0, H + 1, 3 * H + 2)
    first = _flat(opt)
    _assert_same(saved, kept)
    for _ in range(2):
        opt.load_state_dict(saved)
        _train(opt, 0, H + 1, 3 * H + 2)
        assert _flat(opt) == first
        _assert_same(saved, kept)
    opt.close()


def test_older_formats_load_with_a_warning():
    opt = _opt()
    _train(opt, 0, 0, 2 * H)  # a round boundary
    v3 = opt.state_dict()
    v2 = {k: v for k, v in v3.items() if k not in ("params", "buffers", "generation")} | {"version": 2}
    v1 = {k: v for k, v in v2.items() if k != "momentum"} | {
        "version": 1, "outer": {"state": {i: {"momentum_buffer": m} for i, m in enumerate(v3["momentum"])},
                                "param_groups": []}}
    for old in (v2, v1):
        fresh = _opt(make_model(seed=9), broadcast_init=False)
        with pytest.warns(UserWarning, match=r"older format \(version [12]"):
            fresh.load_state_dict(old)
        # saved at a round boundary: the model's parameters come from the anchor, so they equal the saved run's
        for p, q in zip(fresh.model.parameters(), opt.model.parameters()):
            assert torch.equal(p, q)
        for m, n in zip(fresh.outer.momentum, opt.outer.momentum):
            assert torch.equal(m, n)
        fresh.close()
    opt.close()


def _rewind(rank: int, world: int, k: int, more: int) -> dict:
    opt = _opt(topology="random", seed=4, timeout=20.0)
    _train(opt, rank, 0, k * H)
    saved = copy.deepcopy(opt.state_dict())
    _train(opt, rank, k * H, (k + more) * H)
    first = _flat(opt)
    t0 = time.perf_counter()
    opt.load_state_dict(saved)  # rewind a wrapper that has stepped (and has round k + more prepared)
    assert opt.round == k
    _train(opt, rank, k * H, (k + more) * H)
    seconds = time.perf_counter() - t0
    out = {"first": first, "again": _flat(opt), "failed": opt.failed_exchanges_total, "seconds": seconds}
    opt.close()
    return out


def test_loading_into_a_stepped_wrapper_leaves_later_exchanges_failure_free(tmp_path):
    res = run_ranks(_rewind, 4, tmp_path, 2, 3)
    for r in res:
        assert r["failed"] == 0
        assert r["seconds"] < 10.0  # no exchange waited for a timeout (20 s)
        assert r["again"] == r["first"]  # the rewound run retraces the same trajectory, bit for bit
    assert res[0]["first"] != res[1]["first"]  # gossip: replicas differ, so the check above is not vacuous


def _discard(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from fgdiloco.gossip import DistributedTransport, ExchangeError, PeerDeclined

    t = DistributedTransport(timeout=20.0)
    store = dist.distributed_c10d._get_default_store()
    out = {}
    # (a) rank 0 prepared an exchange and gives it up before rank 1 arrives: rank 1 is declined at once
    if rank == 0:
        t.prepare(1, key="a", timeout=20.0)
        t.discard(1, key="a")
        store.set("a-discarded", b"1")
    else:
        store.wait(["a-discarded"])
        t0 = time.perf_counter()
        with pytest.raises(PeerDeclined, match="rank 0"):
            t.open(0, key="a", timeout=20.0)
        out["declined"] = time.perf_counter() - t0
    # (b) both prepared and met; rank 0 gives it up: rank 1's exchange on the dropped group fails at once
    t.prepare(1 - rank, key="b", timeout=20.0)
    t._pending[(1 - rank, "b")].job.result()
    # both sides built: rank 0's Gloo set-up can end before rank 1's, and a group dropped then fails rank 1's
    # set-up itself ("Connection closed by peer": seen once in a full-suite run) instead of its exchange
    store.set(f"b-built/{rank}", b"1")
    store.wait([f"b-built/{1 - rank}"])
    if rank == 0:
        t.discard(1, key="b")
        store.set("b-discarded", b"1")
    else:
        store.wait(["b-discarded"])
        t0 = time.perf_counter()
        with pytest.raises(ExchangeError):
            t.open(0, key="b", timeout=20.0).exchange(b"x")
        out["dropped"] = time.perf_counter() - t0
    store.set(f"done/{rank}", b"1")
    store.wait([f"done/{1 - rank}"])
    t.close()
    return out


def test_a_discarded_prepared_exchange_fails_at_once_on_the_peer(tmp_path):
    res = run_ranks(_discard, 2, tmp_path)
    assert res[1]["declined"] < 1.0 and res[1]["dropped"] < 1.0, res[1]


def _gives_up(rank: int, world: int) -> dict:
    from fgdiloco.gossip import DistributedTransport, PeerDeclined

    t = DistributedTransport(timeout=30.0)
    out = {}
    if rank == 0:
        t0 = time.perf_counter()
        with pytest.raises(PeerDeclined, match="k with rank 1: declined: the peer gave up"):
            t.open(1, key="k", timeout=30.0)
        out["seconds"] = time.perf_counter() - t0
    else:
        t.abandon(0, key="k")  # e.g. its own deadline passed while it was stuck
    t.close()
    return out


def test_a_side_that_gives_up_an_exchange_ends_its_peers_wait_at_once(tmp_path):
    res = run_ranks(_gives_up, 2, tmp_path)
    assert res[0]["seconds"] < 2.0  # not the 30 s timeout


# ------------------------------------------------------------------ resume order
def _resume(rank: int, world: int, phase: str, ckpt: str) -> list[list[float]]:
    k_steps, total = 2 * H + 1, 5 * H  # the checkpoint is taken mid-round
    if phase == "weights first":  # the usual order: restore the model, then build the wrapper (broadcast_init)
        model = make_model(seed=0)
        state = torch.load(f"{ckpt}.{rank}", weights_only=False)
        model.load_state_dict(state["model"])
        opt = _opt(model, topology="random", seed=7, timeout=20.0)
        opt.load_state_dict(state["opt"])
    else:
        opt = _opt(topology="random", seed=7, timeout=20.0)
        if phase == "wrapper first":
            state = torch.load(f"{ckpt}.{rank}", weights_only=False)
            opt.load_state_dict(state["opt"])
            opt.model.load_state_dict(state["model"])
    start = k_steps if phase in ("weights first", "wrapper first") else 0
    stop = k_steps if phase == "save" else total
    _train(opt, rank, start, stop)
    if phase == "save":
        torch.save({"model": opt.model.state_dict(), "opt": opt.state_dict()}, f"{ckpt}.{rank}")
    out = _flat(opt)
    opt.close()
    return out


def test_both_resume_orders_continue_the_same_trajectory(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(_resume, 2, tmp_path, "full", ckpt)
    run_ranks(_resume, 2, tmp_path, "save", ckpt)
    for order in ("weights first", "wrapper first"):
        resumed = run_ranks(_resume, 2, tmp_path, order, ckpt)
        for a, b in zip(full, resumed):
            for x, y in zip(a, b):
                torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=1e-6, msg=order)


# ------------------------------------------------------------------ parameters the wrapper does not synchronise
def test_a_parameter_added_to_the_inner_optimizer_later_is_an_error_at_the_next_step():
    opt = _opt()
    _train(opt, 0, 0, 2)
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.inner_optimizer.add_param_group({"params": [extra]})
    with pytest.raises(RuntimeError, match=r"1 trainable parameter\(s\) are not synchronised.*shape \(3,\) not in "
                                           r"model.*add_param_group"):
        _train(opt, 0, 2, 3)
    opt.close()


def test_a_parameter_unfrozen_later_is_an_error_at_the_next_round():
    model = make_model()
    model[2].bias.requires_grad_(False)
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H)
    model[2].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"not synchronised by FGDiLoCo \(2\.bias\)"):
        _train(opt, 0, 0, H + 1)
    opt.close()


def test_a_parameter_frozen_later_is_an_error_at_the_next_round():
    # the outer momentum went on moving it (by 0.2 over 3 rounds at momentum 0.9), and Mix1 would average it
    model = make_model()
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H)
    _train(opt, 0, 0, H)
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"1 synchronised parameter\(s\) were frozen .* \(0\.weight\)"):
        _train(opt, 0, H, 2 * H)  # the round that ends at step 2H starts the next one: checked there
    opt.close()


def test_an_inner_optimizer_with_parameters_outside_the_model_is_rejected():
    model, head = make_model(), torch.nn.Linear(2, 2)
    inner = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=INNER_LR)
    with pytest.raises(ValueError, match=r"inner_optimizer holds 2 trainable parameter\(s\) that are not trainable "
                                         r"parameters of model"):
        FGDiLoCo(model, inner, sync_every=H)


# ------------------------------------------------------------------ who may take part
def _secrets(rank: int, world: int, rounds: int) -> dict:
    os.environ["FGDILOCO_SECRET"] = "another secret" if rank == 3 else "the job's secret"
    opt = _opt(topology="random", seed=2, timeout=20.0, outer_momentum=0.5)
    assert opt.authenticated
    failed_with, ok_with, errors = [], [], []
    for r in range(rounds):
        _train(opt, rank, r * H, (r + 1) * H)
        s = opt.last_round
        errors += s.errors
        peers = [p for p in s.mix1_peers + s.mix2_peers if p is not None]
        (failed_with if s.failed_exchanges else ok_with).append(peers)
    evals = float(sum(loss_of(opt.model, rank, 10_000 + i) for i in range(4)))
    out = {"failed": opt.failed_exchanges_total, "exchanges": sum(len(p) for p in failed_with + ok_with),
           "errors": errors, "eval": evals, "rounds": opt.round}
    opt.close()
    return out


def test_a_peer_with_another_secret_is_rejected_on_every_exchange_and_the_others_train_on(tmp_path):
    rounds = 6
    res = run_ranks(_secrets, 4, tmp_path, rounds)
    outsider = res[3]
    assert outsider["failed"] == outsider["exchanges"] > 0  # every one of its exchanges was rejected
    assert all("authentication tag does not match" in e or "rejected our frame" in e or "aborted" in e
               for e in outsider["errors"])
    for r in res[:3]:
        assert r["rounds"] == rounds
        assert all("rank 3" in e for e in r["errors"]), r["errors"]  # failures only with the outsider
    assert sum(r["failed"] for r in res[:3]) == outsider["failed"]
    assert any("authentication tag does not match" in e for r in res[:3] for e in r["errors"])


def _scaled(rank: int, world: int, rounds: int) -> dict:
    opt = _opt(topology="random", seed=2, timeout=20.0, outer_momentum=0.5)
    if rank == 1:  # a broken or malicious peer: its pseudo-gradients are sent 1e6x too large
        real = opt._mixer2.run
        opt._mixer2.run = lambda values, outer_round: real([v * 1e6 for v in values], outer_round)
    _train(opt, rank, 0, rounds * H)
    out = {"out_of_scale": opt.out_of_scale_total, "failed": opt.failed_exchanges_total,
           "finite": all(bool(torch.isfinite(p).all()) for p in opt.model.parameters()),
           "max_abs": max(float(p.abs().max()) for p in opt.model.parameters())}
    opt.close()
    return out


def test_a_peer_sending_scaled_pseudo_gradients_is_rejected_and_counted(tmp_path):
    res = run_ranks(_scaled, 2, tmp_path, 4)
    # two workers: every Mix2 exchange pairs them, and rank 0 rejects every one (rank 1's own parameters then
    # drift off by 1e6 as well, so its Mix1 values are rejected too)
    assert res[0]["out_of_scale"] >= 4
    assert res[0]["out_of_scale"] == res[0]["failed"] == res[1]["failed"]
    assert res[1]["out_of_scale"] == 0  # the sender accepts ours; the exchange is rejected by both all the same
    assert res[0]["finite"] and res[0]["max_abs"] < 10.0  # the honest replica is untouched


# ------------------------------------------------------------------ adaptive deadline
def test_the_deadline_is_the_timeout_until_measured_then_median_plus_mads_with_a_floor():
    m = Mixer("mix2", make_topology("random", 2, 0), None, Dense(), 1, b"\0" * 8, timeout=30.0)
    assert m.deadline() == 30.0
    m._durations.extend([0.1] * (DEADLINE_MIN_SAMPLES - 1))
    assert m.deadline() == 30.0
    m._durations.append(0.1)
    assert m.deadline() == pytest.approx(1.0 + 3 * 0.1)  # the floor: MAD is 0
    m._durations.clear()
    m._durations.extend([1.0, 1.0, 1.0, 3.0, 5.0, 1.0, 2.0])  # median 1, MAD 0 ... max(1 + 3, 1 + 6 * 0) = 4
    assert m.deadline() == pytest.approx(4.0)
    m._durations.clear()
    m._durations.extend([1.0, 2.0, 3.0, 4.0, 5.0])  # median 3, MAD 1: max(10, 9) = 10
    assert m.deadline() == pytest.approx(10.0)
    m._durations.extend([20.0] * 16)
    assert m.deadline() == 30.0  # capped by the timeout


# ------------------------------------------------------------------ departures and deaths
def _leaves(rank: int, world: int, rounds: int, leave_after: int) -> dict:
    opt = _opt(topology="random", seed=5, timeout=30.0, outer_momentum=0.5)
    stop = leave_after if rank == 3 else rounds
    blocked, errors, failed, skipped = [], [], [], []
    for r in range(stop):
        _train(opt, rank, r * H, (r + 1) * H)
        s = opt.last_round
        blocked.append(s.round_seconds - s.inner_seconds)
        errors.append(s.errors)
        failed.append(s.failed_exchanges)
        skipped.append(s.skipped_exchanges)
    t0 = time.perf_counter()
    opt.close()
    return {"rounds": opt.round, "blocked": blocked, "errors": errors, "failed": failed, "skipped": skipped,
            "skipped_total": opt.skipped_exchanges_total, "close": time.perf_counter() - t0}


def test_a_worker_that_closes_early_costs_its_peers_no_timeout(tmp_path):
    rounds, leave_after = 8, 2
    res = run_ranks(_leaves, 4, tmp_path, rounds, leave_after, timeout=120)
    for r in res[:3]:
        assert r["rounds"] == rounds
        later = r["blocked"][leave_after:]
        assert max(later) < 1.0, later  # each round with exchanges with the departed worker stays fast
        assert r["close"] < 5.0
        for errs in r["errors"][leave_after:]:
            assert all("rank 3" in e and ("left" in e or "declined" in e or "discarded" in e) for e in errs), errs
    # the departed worker was met (and skipped at once) at least once after it left
    assert any(r["errors"][k] for r in res[:3] for k in range(leave_after, rounds))
    # a departure is a skip, not a failure: nothing failed, and every line in errors is a counted skip
    assert all(f == 0 for r in res for f in r["failed"])
    assert all(len(r["errors"][k]) == r["skipped"][k] for r in res[:3] for k in range(rounds))
    assert sum(r["skipped_total"] for r in res[:3]) >= 1 and res[3]["skipped_total"] == 0


def _terminated(rank: int, world: int, rounds: int, at: int) -> dict:
    opt = _opt(topology="random", seed=5, timeout=30.0, outer_momentum=0.5)
    blocked, errors = [], []
    for r in range(rounds):
        if rank == 2 and r == at:
            os.kill(os.getpid(), signal.SIGTERM)  # the departure notice is posted, then the default action: death
        _train(opt, rank, r * H, (r + 1) * H)
        blocked.append(opt.last_round.round_seconds - opt.last_round.inner_seconds)
        errors.append(opt.last_round.errors)
    opt.close()
    return {"rounds": opt.round, "blocked": blocked, "errors": errors}


@pytest.mark.slow
def test_a_worker_stopped_by_sigterm_announces_its_departure(tmp_path):
    rounds, at = 7, 2
    res = run_ranks(_terminated, 3, tmp_path, rounds, at, timeout=120, allow_missing=(2,), store="tcp")
    assert res[2] is None
    for r in res[:2]:
        assert r["rounds"] == rounds
        assert max(r["blocked"][at:]) < 1.0, r["blocked"]  # no liveness wait, no timeout: the notice is read
        flat = [e for errs in r["errors"][at + 1:] for e in errs]
        assert all("rank 2" in e and "left" in e for e in flat), flat
    assert any(r["errors"][k] for r in res[:2] for k in range(at + 1, rounds))


def _after_first_message(opt: FGDiLoCo, from_round: int, fault) -> None:
    """Make ``opt``'s Mix2 codec call ``fault()`` in every conversation from outer round ``from_round`` on, once its
    first message has gone both ways (the peer has had our first payload: it is talking with us)."""
    real = opt.codec.pair_session

    def session_with_fault(values, *, lower, peer=None):
        session = real(values, lower=lower, peer=peer)
        reply = yield next(session)
        if opt.round >= from_round:
            fault()
        try:
            while True:
                reply = yield session.send(reply)
        except StopIteration as stop:
            return stop.value

    opt.codec.pair_session = session_with_fault


DIE_ROUND = 14  # late enough for the deadline to be measured (5 Mix2 exchanges) on both survivors


def _dies(rank: int, world: int, rounds: int, death_file: str) -> dict:
    opt = _opt(topology="random", seed=11, timeout=30.0, outer_momentum=0.5, sync_every=2)
    if rank == 2:  # dies inside its first Mix2 exchange from DIE_ROUND on, after the first payload

        def die() -> None:
            with open(death_file + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.replace(death_file + ".tmp", death_file)
            os._exit(0)

        _after_first_message(opt, DIE_ROUND, die)
    errors, deadlines = [], []
    for r in range(rounds):
        _train(opt, rank, 2 * r, 2 * (r + 1))
        errors.append(opt.last_round.errors)
        deadlines.append(opt.last_round.deadline_seconds)
    out = {"end": time.time(), "errors": errors, "deadlines": deadlines, "rounds": opt.round}
    opt.close()
    return out


def test_a_worker_dying_inside_mix2_costs_the_survivors_one_deadline_and_no_exchange_with_each_other(tmp_path):
    rounds = DIE_ROUND + 4
    death_file = str(tmp_path / "death")
    res = run_ranks(_dies, 3, tmp_path, rounds, death_file, timeout=120, allow_missing=(2,), store="tcp")
    assert res[2] is None
    with open(death_file) as f:
        death = float(f.read())
    for r in res[:2]:
        assert r["rounds"] == rounds
        flat = [e for errs in r["errors"] for e in errs]
        assert all("rank 2" in e for e in flat), flat  # zero failed exchanges between the survivors
        deadline = max(d for d in r["deadlines"][DIE_ROUND - 1:] if d is not None)
        assert deadline < 5.0, r["deadlines"]  # measured, far below the 30 s timeout
        assert r["end"] - death < deadline + 2.0, (r["end"] - death, deadline)
    assert any(res[k]["errors"][j] for k in (0, 1) for j in range(DIE_ROUND, rounds))


HANG_ROUND = 1  # early: fewer than DEADLINE_MIN_SAMPLES (5) exchanges measured, so the deadline is the full 30 s
assert HANG_ROUND < DEADLINE_MIN_SAMPLES


def _hangs(rank: int, world: int, rounds: int) -> dict:
    opt = _opt(topology="random", seed=5, timeout=30.0, liveness=2.0, sync_every=2)
    if rank == 1:  # SIGSTOPs itself inside its Mix2 conversation of HANG_ROUND, after the first payload
        # hung for good (run_ranks kills it at the end)
        _after_first_message(opt, HANG_ROUND, lambda: os.kill(os.getpid(), signal.SIGSTOP))
    blocked, errors = [], []
    for r in range(rounds):
        _train(opt, rank, 2 * r, 2 * (r + 1))
        blocked.append(opt.last_round.mix2_seconds)
        errors.append(opt.last_round.errors)
    out = {"blocked": blocked, "errors": errors}
    opt.close()
    return out


def test_a_peer_hung_in_the_middle_of_a_conversation_costs_its_partner_the_liveness_not_the_deadline(tmp_path):
    """The supervision loop watches the peer's heartbeat for the whole exchange: a peer SIGSTOPped after its first
    payload, while the conversation's deadline is still the 30 s exchange timeout, is given up after the 2 s
    liveness (it waited the 30 s before)."""
    res = run_ranks(_hangs, 2, tmp_path, HANG_ROUND + 3, timeout=120, allow_missing=(1,), store="tcp")
    survivor = res[0]
    assert res[1] is None
    hang = survivor["blocked"][HANG_ROUND]
    assert 2.0 <= hang < 6.0, survivor["blocked"]  # the liveness (2 s) and a few looks, not 30 s
    assert any("no heartbeat" in e and "rank 1" in e for e in survivor["errors"][HANG_ROUND]), survivor["errors"]
    assert max(survivor["blocked"][HANG_ROUND + 1:]) < 1.0, survivor["blocked"]  # back-off: no more waiting


def test_job_secret_comes_from_the_environment_or_a_file(tmp_path):
    from fgdiloco.factor import job_secret

    assert job_secret({}) is None
    assert job_secret({"FGDILOCO_SECRET": "s3"}) == b"s3"
    path = tmp_path / "secret"
    path.write_bytes(b"from a file\n")
    assert job_secret({"FGDILOCO_SECRET_FILE": str(path)}) == b"from a file"
    with pytest.raises(ValueError, match="not both"):
        job_secret({"FGDILOCO_SECRET": "a", "FGDILOCO_SECRET_FILE": str(path)})
    with pytest.raises(ValueError, match="must not be empty"):
        job_secret({"FGDILOCO_SECRET": ""})
    with pytest.raises(ValueError, match="cannot be read"):
        job_secret({"FGDILOCO_SECRET_FILE": str(tmp_path / "missing")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _opt().authenticated is False
