"""Fragments, overlapped Mix2, the outer merge and any outer optimizer (Streaming DiLoCo, Douillard et al., arXiv
2501.18512): the exact mode equals a plain Streaming DiLoCo reference; fragments split the parameters and the
bytes; gossip with fragments, overlap and merge preserves the workers' average for every codec (hypothesis); torch
outer optimizers, their state mixed in Mix1, checkpoints and the errors."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fgdiloco import FGDiLoCo, FGDiLoCoConfig, LocalHub
from fgdiloco.outer.fragments import split_fragments
from fgdiloco.testing import run_ranks
from tests.reference import INNER_LR, loss_of, make_model, streaming_reference

H = 4


def _opt(model: torch.nn.Module, **kw) -> FGDiLoCo:
    return FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), **kw)


def _train(opt: FGDiLoCo, rank: int, steps: int) -> None:
    for s in range(steps):
        loss_of(opt.model, rank, s).backward()
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------ exact mode = Streaming DiLoCo
def _exact(rank: int, world: int, steps: int, overlap: int, alpha: float) -> dict:
    model = make_model(seed=rank)
    opt = _opt(model, sync_every=H, fragments=2, overlap_steps=overlap, merge_alpha=alpha, topology="allreduce",
               codec="dense", timeout=30.0)
    frags = opt.fragments
    _train(opt, rank, steps)
    out = {"params": [p.detach().clone() for p in model.parameters()], "fragments": frags, "round": opt.round,
           "last": opt.last_round.as_dict()}
    opt.close()
    return out


@pytest.mark.parametrize(("overlap", "alpha"), [(0, 0.0), (1, 0.0), (1, 0.5)])
def test_the_exact_mode_is_streaming_diloco(tmp_path, overlap, alpha):
    steps = 5 * H
    res = run_ranks(_exact, 4, tmp_path, steps, overlap, alpha)
    init = [make_model(seed=r).state_dict() for r in range(4)]
    want = streaming_reference(init, steps, H, res[0]["fragments"], overlap=overlap, alpha=alpha)
    for r, got in enumerate(res):
        assert got["round"] == steps // (H // 2)  # one outer round per fragment sync
        for g, w in zip(got["params"], want[r]):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert res[0]["last"]["fragment"] == 1 and res[0]["last"]["inner_steps"] == H // 2
    # the fragment synced last: identical on every replica, unless the merge kept part of each one's own progress
    last = res[0]["fragments"][res[0]["last"]["fragment"]]
    assert (alpha > 0) == any(not torch.equal(res[0]["params"][k], res[1]["params"][k]) for k in last)


# ------------------------------------------------------------------ fragments
def test_fragments_split_the_parameters_in_order_by_size_or_as_given():
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    assert split_fragments(1, names, params) == [[0, 1, 2, 3]]
    two = split_fragments(2, names, params)
    assert sorted(i for f in two for i in f) == [0, 1, 2, 3] and all(two)
    assert split_fragments([model[2], [params[0], params[1]]], names, params) == [[2, 3], [0, 1]]
    with pytest.raises(ValueError, match=r"leave 2 trainable parameter\(s\) out \(2.weight, 2.bias\)"):
        split_fragments([model[0]], names, params)
    with pytest.raises(ValueError, match="in exactly one fragment"):
        split_fragments([model[0], [params[0]], model[2]], names, params)
    with pytest.raises(ValueError, match="more than the model's 4"):
        split_fragments(5, names, params)
    with pytest.raises(TypeError, match=r"fragments\[0\] must be an nn.Module or a list of parameters"):
        split_fragments(["x"], names, params)


def test_each_fragment_round_moves_only_its_fragment_and_about_1_over_f_of_mix2s_bytes():
    out: dict[int, dict] = {}

    def worker(hub: LocalHub, rank: int, fragments: int) -> None:
        model = make_model(seed=0)
        opt = _opt(model, sync_every=H, fragments=fragments, transport=hub.transport(rank), codec="dense",
                   mix1_codec="dense", timeout=20.0, topology="ring")
        before = [p.detach().clone() for p in model.parameters()]
        rows = []
        for s in range(H):
            loss_of(model, rank, s).backward()
            opt.step()
            opt.zero_grad()
            if opt.last_round is not None and opt.last_round.round == len(rows):
                rows.append(opt.last_round)
        out[rank] = {"rows": rows, "frags": opt.fragments, "before": before,
                     "anchor": [t.clone() for t in opt.outer.theta0]}
        opt.close()

    sent = {}
    for fragments in (1, 2):
        hub = LocalHub(2)  # a job of its own (the first one's closed workers left their exchange keys behind)
        threads = [threading.Thread(target=worker, args=(hub, r, fragments)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        rows = out[0]["rows"]
        assert len(rows) == fragments and [r.fragment for r in rows] == list(range(fragments))
        sent[fragments] = [r.mix2_bytes_sent for r in rows]
    # the first fragment's round ended after H/2 steps, moving only its own parameters' round-start values
    assert abs(sum(sent[2]) - sent[1][0]) < 200  # the same pseudo-gradient bytes in all (frames add headers)
    assert max(sent[2]) < 0.9 * sent[1][0]


def test_settings_of_fragments_overlap_and_merge_are_checked():
    with pytest.raises(ValueError, match=r"fragments=3 must divide sync_every=4"):
        FGDiLoCoConfig(sync_every=4, fragments=3)
    with pytest.raises(ValueError, match=r"overlap_steps must be < sync_every / fragments = 2"):
        FGDiLoCoConfig(sync_every=4, fragments=2, overlap_steps=2)
    with pytest.raises(ValueError, match=r"merge_alpha must be a number in \[0, 1\]"):
        FGDiLoCoConfig(merge_alpha=-0.1)
    with pytest.raises(TypeError, match="fragments must be an int >= 1 or a list"):
        FGDiLoCoConfig(fragments="two")
    with pytest.raises(ValueError, match="outer_optimizer must be None, one of 'nesterov', 'sgd', 'adam'"):
        FGDiLoCoConfig(outer_optimizer="lion")
    assert FGDiLoCoConfig(outer_optimizer="nesterov").outer_optimizer is None


# ------------------------------------------------------------------ gossip: the average is preserved
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fragments=st.sampled_from([1, 2]), overlap=st.integers(0, 1), alpha=st.sampled_from([0.0, 0.5]),
       codec=st.sampled_from(["dense", "int8", "lowrank"]), seed=st.integers(0, 2**16))
def test_gossip_with_fragments_overlap_and_merge_preserves_the_workers_average(fragments, overlap, alpha, codec,
                                                                               seed):
    """Every pairwise round preserves the pair's sum, and the outer step is linear: after every outer round the
    mean over workers of the round-start parameters is the exact-average outer step of the means (for every codec;
    float rounding aside). The merge only moves each worker's live parameters."""
    m, steps = 4, 3 * H
    hub = LocalHub(m)
    records: dict[int, list] = {r: [] for r in range(m)}

    def worker(rank: int) -> None:
        model = make_model(seed=rank)
        opt = _opt(model, sync_every=H, fragments=fragments, overlap_steps=overlap, merge_alpha=alpha, codec=codec,
                   mix1_codec="dense", transport=hub.transport(rank), timeout=20.0, seed=seed, outer_momentum=0.5)
        def recording(real):
            def run(values, outer_round):
                res = real(values, outer_round)
                records[rank].append((outer_round, [v.double() for v in values],
                                      [t.double() for t in opt.outer.theta0],
                                      [b.double() for b in opt.outer.momentum]))
                return res
            return run

        for mixer in opt._mixer2s:  # one Mix2 per fragment
            mixer.run = recording(mixer.run)
        commits = []
        real_commit = opt.outer.commit

        def commit(indices, theta, merge_alpha=0.0):
            real_commit(indices, theta, merge_alpha)
            commits.append((list(indices), [t.double() for t in opt.outer.theta0],
                            [b.double() for b in opt.outer.momentum]))

        opt.outer.commit = commit
        _train(opt, rank, steps)
        records[rank] = [(*rec, *c) for rec, c in zip(records[rank], commits)]
        opt.close()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(len(records[r]) == steps // (H // fragments) for r in range(m))
    for e in range(len(records[0])):
        idx = records[0][e][4]
        for j, k in enumerate(idx):
            delta = sum(records[r][e][1][j] for r in range(m)) / m
            theta = sum(records[r][e][2][k] for r in range(m)) / m
            mom = sum(records[r][e][3][k] for r in range(m)) / m
            new_m = 0.5 * mom + delta
            want = theta - 0.7 * (delta + 0.5 * new_m)
            got = sum(records[r][e][5][k] for r in range(m)) / m
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
            torch.testing.assert_close(sum(records[r][e][6][k] for r in range(m)) / m, new_m, rtol=0, atol=2e-5)


# ------------------------------------------------------------------ any outer optimizer
def test_a_torch_sgd_outer_optimizer_equals_the_builtin_nesterov_step():
    def run(**kw) -> list[torch.Tensor]:
        model = make_model(seed=0)
        opt = _opt(model, sync_every=2, outer_lr=0.7, outer_momentum=0.9, **kw)
        _train(opt, 0, 8)
        opt.close()
        return [p.detach() for p in model.parameters()]

    builtin = run()
    for got in (run(outer_optimizer="sgd"),
                run(outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True))):
        for g, w in zip(got, builtin):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_an_adam_outer_optimizer_with_sgds_outer_lr_is_warned_about():
    """outer_lr 0.7 scales SGD's pseudo-gradient but is Adam's step per parameter: `fgdiloco pretrain
    --outer-optimizer adam` diverged (7.6 -> 34) without a word. Warned at construction; a step on the parameters'
    scale and SGD's 0.7 are not."""
    import warnings

    with pytest.warns(UserWarning, match=r"outer_optimizer='adamw' with outer_lr=0.7: Adam normalises"):
        _opt(make_model(), sync_every=2, outer_optimizer="adamw").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _opt(make_model(), sync_every=2, outer_optimizer="adam", outer_lr=1e-2).close()
        _opt(make_model(), sync_every=2, outer_optimizer="sgd").close()
    assert FGDiLoCoConfig(outer_optimizer="ADAM", outer_lr=0.1).outer_lr_note() is not None
    assert FGDiLoCoConfig(outer_optimizer=None).outer_lr_note() is None


def test_an_adam_outer_step_mixes_its_moments_and_checkpoints_them():
    hub = LocalHub(2)
    states: dict[int, dict] = {}

    def worker(rank: int) -> None:
        model = make_model(seed=rank)
        opt = _opt(model, sync_every=2, outer_optimizer="adam", outer_lr=1e-2, transport=hub.transport(rank),
                   codec="dense", mix1_codec="dense", timeout=20.0, topology="ring")
        _train(opt, rank, 6)
        states[rank] = {"dict": opt.state_dict(), "last": opt.last_round, "moments": opt.outer.momentum}
        opt.close()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    last = states[0]["last"]
    assert last.momentum_distance is not None and last.mix1_bytes_sent > 0
    assert len(states[0]["moments"]) == 2 * 4 and any(float(m.abs().sum()) > 0 for m in states[0]["moments"])
    saved = states[0]["dict"]
    assert saved["outer_optimizer"] is not None and saved["momentum"] == [] and saved["fragments"] == 1
    model = make_model(seed=0)
    fresh = _opt(model, sync_every=2, outer_optimizer="adam", outer_lr=1e-2, transport=LocalHub(2).transport(0),
                 codec="dense", mix1_codec="dense", topology="ring")
    fresh.load_state_dict(saved)
    for a, b in zip(fresh.outer.momentum, states[0]["moments"]):
        torch.testing.assert_close(a, b)
    builtin = _opt(make_model(seed=0), sync_every=2, transport=LocalHub(2).transport(0), codec="dense",
                   mix1_codec="dense", topology="ring")
    with pytest.raises(ValueError, match="another kind of outer optimizer"):
        builtin.load_state_dict(saved)
    fresh.close(), builtin.close()


@pytest.mark.filterwarnings("ignore:outer_optimizer=.*Adam normalises:UserWarning")  # state, not convergence
@pytest.mark.parametrize(("saved_by", "loaded_into", "names"), [
    ("adam", "sgd", ("adam.Adam", "sgd.SGD")),
    ("adam", "adamw", ("adam.Adam", "adamw.AdamW")),
    ("sgd", "adam", ("sgd.SGD", "adam.Adam")),
    (lambda p: torch.optim.Adagrad(p, lr=0.1), "adam", ("adagrad.Adagrad", "adam.Adam")),
])
def test_a_torch_outer_optimizers_state_loads_only_into_the_same_class(saved_by, loaded_into, names):
    """Adam's state loaded into SGD made SGD's parameter groups Adam's (KeyError: 'momentum' at the next outer step);
    into AdamW it trained with Adam's hyperparameters. Refused, naming both classes, and nothing changes."""
    saver = _opt(make_model(seed=0), sync_every=2, outer_optimizer=saved_by, mix_momentum=False)
    _train(saver, 0, 5)
    saved = saver.state_dict()
    opt = _opt(make_model(seed=1), sync_every=2, outer_optimizer=loaded_into, mix_momentum=False)
    _train(opt, 1, 3)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"saved by torch\.optim\.{names[0]}, this run's outer optimizer is "
                                         rf"torch\.optim\.{names[1]}"):
        opt.load_state_dict(saved)
    assert _same(opt.state_dict(), before)
    _train(opt, 1, 2)  # its own outer step still works
    saver.close(), opt.close()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.filterwarnings("ignore:outer_optimizer=.*Adam normalises:UserWarning")  # state, not convergence
@pytest.mark.parametrize("outer", ["adam", "sgd"])
def test_a_resumed_outer_optimizer_steps_with_the_constructions_hyperparameters_and_the_saved_state(outer):
    """Resumed with another outer_lr (and betas), a torch outer optimizer kept the saved ones while opt.outer_lr
    reported the new one (the built-in Nesterov step already took the new one). Now it steps with the new ones,
    from the saved moments and step counts."""
    saver = _opt(make_model(seed=0), sync_every=2, outer_optimizer=outer, outer_lr=0.7, outer_momentum=0.9)
    _train(saver, 0, 4)
    saved = saver.state_dict()
    opt = _opt(make_model(seed=0), sync_every=2, outer_optimizer=outer, outer_lr=0.1, outer_momentum=0.5)
    opt.load_state_dict(saved)
    assert opt.outer_lr == 0.1
    group = opt.outer.optimizer.opt.param_groups[0]
    assert group["lr"] == 0.1 and group.get("betas", (0.5, 0.999)) == (0.5, 0.999) and group.get("momentum", 0.5) == 0.5
    state = opt.outer.optimizer.opt.state[opt.outer.optimizer.masters[0]]
    want = saved["outer_optimizer"]["torch"]["state"][0]
    assert want and all(torch.equal(state[k], want[k]) for k in want)
    # the next outer step: θ ← θ̄ − 0.1 · (Adam's or SGD's direction, which does not depend on the lr)
    theta0 = [t.clone() for t in opt.outer.theta0]
    _train(opt, 0, 2)
    slow = [t - u for t, u in zip(opt.outer.theta0, theta0)]
    fast = _opt(make_model(seed=0), sync_every=2, outer_optimizer=outer, outer_lr=0.7, outer_momentum=0.5)
    fast.load_state_dict(saved)
    _train(fast, 0, 2)
    for s_, f in zip(slow, (t - u for t, u in zip(fast.outer.theta0, theta0))):
        torch.testing.assert_close(s_ * 7, f, rtol=1e-4, atol=1e-6)
    saver.close(), opt.close(), fast.close()


def test_an_outer_optimizer_whose_state_cannot_be_mixed_is_refused_by_name():
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"knows how to do for torch.optim.SGD \(momentum_buffer\).*not for Adagrad"):
        FGDiLoCo(model, inner, sync_every=2, outer_optimizer=lambda p: torch.optim.Adagrad(p, lr=0.1))
    ok = FGDiLoCo(model, inner, sync_every=2, mix_momentum=False,
                  outer_optimizer=lambda p: torch.optim.Adagrad(p, lr=0.1))
    ok.close()
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        FGDiLoCo(model, inner, sync_every=2, outer_optimizer=lambda p: None)


def test_fragments_and_overlap_survive_a_checkpoint_mid_round():
    def run(resume_at: int | None) -> list[torch.Tensor]:
        hub = LocalHub(2)
        result: dict[int, list] = {}
        # built here, not in the threads: torch.manual_seed is process-wide, two threads seeding at once race
        models = {r: make_model(seed=r) for r in range(2)}
        spare = {r: make_model(seed=7) for r in range(2)}

        def worker(rank: int) -> None:
            kw = dict(sync_every=H, fragments=2, overlap_steps=1, transport=hub.transport(rank), codec="lowrank",
                      timeout=20.0, topology="ring")
            model = models[rank]
            opt = _opt(model, **kw)
            for s in range(3 * H):
                if resume_at is not None and s == resume_at:
                    state = opt.state_dict()
                    opt.close()
                    model = spare[rank]
                    opt = _opt(model, **kw)
                    opt.load_state_dict(state)
                loss_of(model, rank, s).backward()
                opt.step()
                opt.zero_grad()
            result[rank] = [p.detach().clone() for p in model.parameters()]
            opt.close()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return result[0] + result[1]

    for a, b in zip(run(None), run(H + 1)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
