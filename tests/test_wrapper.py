"""FGDiLoCo: DiLoCo equivalence, Mix1 overlap without staleness, argument checks, resume."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from fgdiloco import BF16, FGDiLoCo, LocalHub, LowRank
from fgdiloco.outer.stats import RoundStats
from fgdiloco.testing import run_ranks
from tests.reference import INNER_LR, diloco_reference, loss_of, make_model

H = 4


def _train(rank: int, world: int, rounds: int, kwargs: dict) -> list[list[float]]:
    model = make_model(seed=0)
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, timeout=20.0,
                   **kwargs)
    for step in range(rounds * H):
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    assert opt.round == rounds
    assert opt.failed_exchanges_total == 0
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_allreduce_with_the_lossless_codec_is_diloco(tmp_path):
    rounds, m = 3, 4
    results = run_ranks(_train, m, tmp_path, rounds, {"topology": "allreduce", "codec": "dense"})
    init = make_model(seed=0).state_dict()
    want = diloco_reference([init] * m, rounds, H)
    for rank, got in enumerate(results):
        for g, w in zip(got, want[rank]):
            torch.testing.assert_close(torch.tensor(g).view(w.shape), w, rtol=0, atol=1e-5)
    # every worker holds the same parameters, as DiLoCo's do
    assert all(r == results[0] for r in results)


def _two_jobs(rank: int, world: int, rounds: int) -> list[list[float]]:
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank builds both, as torch asks
    job = rank // 2
    model = make_model(seed=job)  # the two jobs start apart
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, timeout=20.0,
                   process_group=groups[job], topology="allreduce", codec="dense")
    for step in range(rounds * H):
        loss_of(model, dist.get_rank(groups[job]), step).backward()
        opt.step()
        opt.zero_grad()
    assert opt.failed_exchanges_total == 0
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_exact_diloco_on_two_subgroups_at_once_is_two_separate_diloco_jobs(tmp_path):
    """Each transport's collective group is built by its members alone: built over the default group's counter
    (every rank had to call it, in the same order), the two jobs' groups failed to connect or took one name and
    crossed their collectives (the two jobs then ended with the same weights)."""
    rounds = 2
    results = run_ranks(_two_jobs, 4, tmp_path, rounds)
    for job in (0, 1):
        want = diloco_reference([make_model(seed=job).state_dict()] * 2, rounds, H)
        for worker in (0, 1):
            for g, w in zip(results[2 * job + worker], want[worker]):
                torch.testing.assert_close(torch.tensor(g).view(w.shape), w, rtol=0, atol=1e-5)


def _twice_with_one_codec(rank: int, world: int, rounds: int) -> list[list[list[float]]]:
    codec = LowRank(rank=1)  # error feedback: the exact path keeps a residual per tensor
    runs = []
    for _ in range(2):  # the same instance for two runs in one process, one after the other
        model = make_model(seed=0)
        opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, timeout=20.0,
                       topology="allreduce", codec=codec)
        assert opt.codec is not codec and opt.codec.rank == 1
        for step in range(rounds * H):
            loss_of(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
        assert any(e is not None for e in opt.codec.state_dict()["e"])  # the wrapper's copy kept a residual
        opt.close()
        runs.append([p.detach().flatten().tolist() for p in model.parameters()])
    assert codec.state_dict()["shapes"] is None  # the user's instance was never used
    return runs


def test_a_codec_instance_starts_every_wrapper_from_a_fresh_state(tmp_path):
    """A codec instance is copied with its state reset: it used to carry the first run's error-feedback residual
    and warm starts into the second run (and two open wrappers shared one state)."""
    for first, second in run_ranks(_twice_with_one_codec, 2, tmp_path, 2):
        assert first == second


def test_gossip_run_trains_and_replicas_differ_between_exact_rounds(tmp_path):
    results = run_ranks(_train, 4, tmp_path, 3, {"topology": "random"})
    assert results[0] != results[1]


def _stats_run(rank: int, world: int, mix_momentum: bool) -> dict:
    model = make_model(seed=rank)  # different starts: Mix1 has work to do
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, topology="exponential",
                   broadcast_init=False, timeout=20.0, mix_momentum=mix_momentum, codec="dense")
    for step in range(3 * H):
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    return opt.last_round.as_dict()


@pytest.mark.parametrize("mix_momentum", [False, True])
def test_round_diagnostics_are_filled_in(tmp_path, mix_momentum):
    for s in run_ranks(_stats_run, 4, tmp_path, mix_momentum):
        assert s["round"] == 2 and s["inner_steps"] == H
        assert s["mix1_bytes_sent"] > 48 and s["mix2_bytes_sent"] > 48
        assert s["mix1_bytes_received"] > 48 and s["mix2_bytes_received"] > 48
        # dense fp32 pseudo-gradients vs bf16 parameters: Mix2's frames are larger than Mix1's, by at most the
        # 2x of the raw element sizes plus what zstd gains more on bf16 than on fp32 (measured: 1.46x vs 1.19x);
        # Mix1 moving the momentum too doubles its elements
        ratio = s["mix2_bytes_sent"] / s["mix1_bytes_sent"] * (2 if mix_momentum else 1)
        assert ratio > 1.3
        assert ratio < 2 * 1.46
        # size-independent distances: RMS per element and relative to the parameters' norm
        assert 0 < s["consensus_distance"] < 1 and 0 < s["consensus_relative"] < 1
        assert s["pseudo_gradient_distance"] > 0 and s["pseudo_gradient_relative"] > 0
        assert (s["momentum_distance"] is not None) == mix_momentum
        assert 0 < s["utilisation"] <= 1
        parts = s["inner_seconds"] + s["mix2_seconds"] + s["mix1_wait_seconds"] + s["outer_seconds"]
        assert parts == pytest.approx(s["round_seconds"], rel=0.05, abs=2e-3)
        assert s["failed_exchanges"] == 0 and s["errors"] == []


def test_mix1_overlaps_the_inner_steps_and_the_outer_step_uses_mixed_round_start_parameters():
    """Mix1's exchange is held open until both workers have taken every inner step of the round; the round still
    completes, and its result is the one-round FG-DiLoCo update from the *mixed round-start* parameters."""
    m = 2
    gate = threading.Event()
    hub = LocalHub(m, gate=lambda key: gate if key.startswith("mix1/") else None)
    inits = [make_model(seed=10 + r).state_dict() for r in range(m)]
    reached = [threading.Event() for _ in range(m)]
    in_flight_at_last_step = [None] * m
    out: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = make_model()
            model.load_state_dict(inits[rank])
            opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H,
                           topology="random", codec="dense", mix1_codec="dense", transport=hub.transport(rank),
                           timeout=30.0)
            for step in range(H):
                loss_of(model, rank, step).backward()
                if step == H - 1:
                    in_flight_at_last_step[rank] = not opt._round.mix1_done()
                    reached[rank].set()
                opt.step()
                opt.zero_grad()
            assert opt.round == 1
            out[rank] = [p.detach().clone() for p in model.parameters()]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            reached[rank].set()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(m)]
    for t in threads:
        t.start()
    for ev in reached:
        assert ev.wait(60)
    gate.set()  # the slow Mix1 exchange finishes only now
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert in_flight_at_last_step == [True, True]  # every inner step ran while Mix1 was in flight
    want = diloco_reference(inits, 1, H)  # M = 2 pairwise gossip = exact average
    for rank in range(m):
        for g, w in zip(out[rank], want[rank]):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_single_process_without_torch_distributed_runs_local_outer_steps():
    model = make_model()
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, outer_momentum=0.5)
    assert opt.world_size == 1
    held_out = lambda: float(sum(loss_of(model, 0, 10_000 + i).detach() for i in range(4)))
    first = held_out()
    for step in range(10 * H):
        loss_of(model, 0, step).backward()
        opt.step()
        opt.zero_grad()
    assert opt.round == 10
    assert held_out() < 0.5 * first
    assert isinstance(opt.last_round, RoundStats)
    assert opt.last_round.bytes_sent == 0


def test_closure_is_passed_through_and_returns_the_loss():
    model = make_model()
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=2)

    def closure():
        opt.zero_grad()
        loss = loss_of(model, 0, 0)
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) > 0
    assert opt.step(closure) is not None and opt.round == 1


def _new(**kwargs):
    model = make_model()
    inner = kwargs.pop("inner", None) or torch.optim.AdamW(model.parameters(), lr=1e-3)
    kwargs.setdefault("sync_every", 4)
    return FGDiLoCo(model, inner, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"sync_every": 0}, ValueError, r"sync_every must be an int >= 1"),
        ({"sync_every": -3}, ValueError, r"sync_every must be an int >= 1"),
        ({"sync_every": 2.5}, TypeError, r"sync_every must be an int"),
        ({"sync_every": True}, TypeError, r"sync_every must be an int"),
        ({"topology": "star"}, ValueError, r"topology must be one of 'allreduce', .* got 'star'"),
        ({"outer_lr": -0.1}, ValueError, r"outer_lr must be a number in \(0, inf\)"),
        ({"outer_lr": 0.0}, ValueError, r"outer_lr must be a number in \(0, inf\)"),
        ({"outer_lr": float("nan")}, ValueError, r"outer_lr"),
        ({"outer_momentum": 1.0}, ValueError, r"outer_momentum must be a number in \[0, 1\)"),
        ({"outer_momentum": -0.5}, ValueError, r"outer_momentum must be a number in \[0, 1\)"),
        ({"mix1_rounds": -1}, ValueError, r"mix1_rounds must be an int >= 0"),
        ({"mix2_rounds": -2}, ValueError, r"mix2_rounds must be an int >= 0"),
        ({"timeout": 0}, ValueError, r"timeout must be seconds > 0"),
        ({"codec": "gzip"}, ValueError, r"codec must be one of 'bf16', 'dense', 'int8', 'lowrank' .* got 'gzip'"),
        ({"mix1_codec": 3}, TypeError, r"mix1_codec must be one of .* or a fgdiloco.factor.Codec, got int"),
        ({"join_timeout": -1}, ValueError, r"join_timeout must be seconds > 0"),
        ({"liveness": 0.1}, ValueError, r"liveness must be seconds >= 1"),
        ({"sync_evry": 3}, TypeError, r"unknown FGDiLoCo setting\(s\) sync_evry; the settings are sync_every, "),
        ({"seed": "x"}, TypeError, r"seed must be an int"),
        ({"nesterov": "yes"}, TypeError, r"nesterov must be a bool"),
        ({"codec": (shared := BF16()), "mix1_codec": shared}, ValueError, r"must be different Codec instances"),
        ({"mix1_codec": "lowrank"}, ValueError, r"mix1_codec='lowrank' keeps per-worker state.*'bf16'.*'int8'"),
        ({"mix1_codec": LowRank(rank=2, error_feedback=False)}, ValueError, r"mix1_codec=.*not safe for parameters"),
        ({"mix_momentum": 1}, TypeError, r"mix_momentum must be a bool"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        _new(**kwargs)


def test_a_chosen_rank_that_factors_no_matrix_is_warned_about_and_the_default_rank_on_a_toy_model_is_not():
    # the model's matrices are 12 x 6 (factored while r < 72 / 18 = 4) and 1 x 12 (never)
    for chosen in ({"codec_rank": 4}, {"codec": LowRank(rank=8)}):
        with pytest.warns(UserWarning, match=r"none of the model's matrices \(2\) is factored.*at most 3$"):
            _new(**chosen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _new(codec_rank=3)
        _new()  # the default rank 4 factors nothing here either, but nobody chose it


def test_a_setting_is_read_as_an_attribute_and_assigning_it_is_refused():
    opt = _new(sync_every=3)
    assert opt.sync_every == 3 and opt.outer_lr == 0.7
    with pytest.raises(AttributeError, match="sync_every is a setting, fixed at construction"):
        opt.sync_every = 1  # it only shadowed the setting: the rounds stayed every 3 steps
    assert opt.sync_every == 3 and opt.config.sync_every == 3


def test_one_wrapper_per_inner_optimizer_and_none_steps_after_close():
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = FGDiLoCo(model, inner, sync_every=2)
    with pytest.raises(ValueError, match="inner_optimizer already drives another FGDiLoCo"):
        FGDiLoCo(model, inner, sync_every=3)  # both would count every step: rounds 3 and 2 from 6 steps
    first.close()
    with pytest.raises(RuntimeError, match="was closed"):
        first.step()
    second = FGDiLoCo(model, inner, sync_every=3)  # the closed one no longer drives it
    for step in range(6):
        loss_of(model, 0, step).backward()
        second.step()
        second.zero_grad()
    assert second.round == 2 and first.round == 0
    with pytest.raises(TypeError, match="transport must be a fgdiloco.gossip.Transport or None, got int"):
        FGDiLoCo(make_model(), torch.optim.SGD(model.parameters(), lr=0.1), transport=5)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup or None, got str"):
        FGDiLoCo(make_model(), torch.optim.SGD(model.parameters(), lr=0.1), process_group="world")


def test_inner_optimizer_must_hold_the_models_parameters():
    other = make_model()
    with pytest.raises(ValueError, match=r"inner_optimizer does not hold 4 of the model's trainable parameters"):
        _new(inner=torch.optim.AdamW(other.parameters(), lr=1e-3))
    model = make_model()
    partial = torch.optim.AdamW(list(model.parameters())[:2], lr=1e-3)
    with pytest.raises(ValueError, match=r"does not hold 2 of .*\(2\.weight, 2\.bias\)"):
        FGDiLoCo(model, partial, sync_every=2)
    with pytest.raises(TypeError, match="inner_optimizer must be a torch.optim.Optimizer"):
        FGDiLoCo(model, "adamw", sync_every=2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        FGDiLoCo("gpt", torch.optim.AdamW(model.parameters()), sync_every=2)


def _resume(rank: int, world: int, phase: str, rounds: int, ckpt: str) -> list[list[float]]:
    model = make_model(seed=0)
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=H, timeout=20.0,
                   topology="random", seed=7)
    start = 0
    if phase == "resume":
        state = torch.load(f"{ckpt}.{rank}", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = opt.round * H
    for step in range(start, rounds * H):
        loss_of(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    if phase == "save":
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{ckpt}.{rank}")
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_resume_in_new_processes_continues_the_same_trajectory(tmp_path):
    k, m = 2, 4
    ckpt = str(tmp_path / "ckpt")
    full = run_ranks(_resume, m, tmp_path, "full", k + 2, ckpt)
    run_ranks(_resume, m, tmp_path, "save", k, ckpt)
    resumed = run_ranks(_resume, m, tmp_path, "resume", k + 2, ckpt)
    for a, b in zip(full, resumed):
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=1e-6)


def test_load_state_dict_rejects_foreign_states():
    opt = _new(seed=1)
    state = opt.state_dict()
    with pytest.raises(ValueError, match="seed=1, this run uses seed=2"):
        _new(seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="not an FGDiLoCo state dict"):
        opt.load_state_dict({"version": 99})
    big = torch.nn.Linear(3, 3)
    other = FGDiLoCo(big, torch.optim.AdamW(big.parameters()), sync_every=2)
    with pytest.raises(ValueError, match="another model layout"):
        other.load_state_dict(state)


def test_consensus_distance_is_zero_for_identical_replicas_and_positive_otherwise():
    """Mix1 sends bf16: comparing one's own fp32 values with the peer's bf16 ones would report ‖θ − bf16(θ)‖
    for identical replicas. Both sides are compared as transmitted."""
    dists: dict[tuple[bool, int], float] = {}

    def run(same: bool) -> None:
        hub = LocalHub(2)
        # built here, not in the threads: make_model seeds torch's global RNG, which the threads would share
        models = [make_model(seed=0 if same else rank) for rank in range(2)]

        def worker(rank: int) -> None:
            model = models[rank]
            opt = FGDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.0), sync_every=1,
                           transport=hub.transport(rank), timeout=30.0)
            loss_of(model, rank, 0).backward()
            opt.step()
            dists[(same, rank)] = opt.last_round.consensus_distance

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    run(same=True)
    run(same=False)
    assert dists[(True, 0)] == 0.0 and dists[(True, 1)] == 0.0
    assert dists[(False, 0)] == dists[(False, 1)] > 0.1


def test_time_in_paused_is_left_out_of_the_round_clock():
    model = make_model()
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), sync_every=2)
    idle = threading.Event()  # never set: wait(t) stands in for t seconds of evaluation
    with opt.paused():  # before the first round's clock starts (an evaluation at round 0): nothing to leave out
        idle.wait(0.3)
    rounds = []
    for step in range(6):
        loss_of(model, 0, step).backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 1:
            rounds.append(opt.last_round)
        if step == 1:
            with opt.paused():
                idle.wait(0.3)
        if step == 3:
            idle.wait(0.3)  # the same work, not paused: it counts as the worker's own time
    first, after_paused, after_unpaused = rounds
    assert 0 < first.inner_seconds <= first.round_seconds < 0.2, first  # was -0.3 + its steps: the pause subtracted
    assert after_paused.round_seconds < 0.2 and after_paused.inner_seconds < 0.2
    assert after_unpaused.round_seconds >= 0.3 and after_unpaused.inner_seconds >= 0.3


def test_outer_state_is_fp32_for_a_bf16_model():
    """A bf16 model's round-start parameters and outer momentum are fp32 master copies: an outer update smaller
    than bf16's resolution is kept, not rounded away."""
    model = make_model().to(torch.bfloat16)
    opt = FGDiLoCo(model, torch.optim.SGD(model.parameters(), lr=1.0), sync_every=1, outer_lr=1e-4,
                   outer_momentum=0.0)
    before = [t.clone() for t in opt.outer.theta0]
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    ((model(x.bfloat16()) - y.bfloat16()) ** 2).mean().backward()
    opt.step()
    state = opt.state_dict()
    assert all(t.dtype == torch.float32 for t in state["anchor"] + state["momentum"])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    moved = [float((a - b).abs().max()) for a, b in zip(opt.outer.theta0, before)]
    assert max(moved) > 0  # the fp32 master moved by outer_lr·Δ, far below bf16's step at these magnitudes
    # ... and many of those moves are below bf16's resolution: a bf16 outer step would have lost them
    lost = sum(int(((a != b) & (a.bfloat16() == b.bfloat16())).sum()) for a, b in zip(opt.outer.theta0, before))
    assert lost > 0


def test_consensus_distance_is_the_rms_per_element_and_relative_to_the_parameters():
    """Two workers whose parameters differ by exactly c in every element: consensus_distance == c whatever the
    model size, consensus_relative == c·√numel / ‖θ‖."""
    hub = LocalHub(2)
    out: list = [None, None]
    c = 0.25

    def work(rank: int) -> None:
        model = make_model(seed=0)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.0 + c * rank)
        opt = FGDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.0), sync_every=1, mix1_codec="dense",
                       transport=hub.transport(rank), topology="random", timeout=10.0)
        loss_of(model, rank, 0).backward()
        opt.step()
        out[rank] = opt.last_round

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, s in enumerate(out):
        assert s.consensus_distance == pytest.approx(c, rel=1e-6)
        assert s.consensus_relative == pytest.approx(c / (1.0 + c * rank), rel=1e-6)
        assert s.momentum_distance == 0.0
