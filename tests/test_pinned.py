"""Pinned trajectories: tiny deterministic runs (tests/pinned.py) give, round by round, the held-out losses and
parameter checksums recorded in tests/fixtures/pinned/ before the code was restructured. A change that moves code
must not move these numbers; a change of behaviour rewrites them (``python -m tests.pinned``) and says why."""

from __future__ import annotations

import json

import pytest

from tests import pinned

# bit-for-bit reproducible on one machine (1 thread per rank), but not across CPUs: float32 kernels (AVX2 or
# AVX-512, fused or not) round differently, 1e-7 relative at the first round on another machine. A change of
# behaviour (an update order, a missed step, a codec's state) moves these numbers by 1e-3 or more.
RTOL = 1e-5


def _close(got: float | None, want: float | None) -> bool:
    if got is None or want is None:
        return got is want
    return abs(got - want) <= RTOL * max(1.0, abs(want))


def _compare(name: str, got: list) -> None:
    want = json.loads((pinned.FIXTURES / f"{name}.json").read_text())["workers"]
    assert len(got) == len(want), f"{name}: {len(got)} workers, pinned {len(want)}"
    for w, (g_rounds, w_rounds) in enumerate(zip(got, want)):
        assert len(g_rounds) == len(w_rounds), f"{name} worker {w}: {len(g_rounds)} rounds, pinned {len(w_rounds)}"
        for g, p in zip(g_rounds, w_rounds):
            assert g["round"] == p["round"], (name, w, g, p)
            where = f"{name} worker {w} round {p['round']}"
            assert _close(g["loss"], p["loss"]), f"{where}: loss {g['loss']} != {p['loss']}"
            for a, b in zip(g["params"], p["params"]):
                assert _close(a, b), f"{where}: params {g['params']} != {p['params']}"


@pytest.mark.parametrize("name", ["exact", "gossip_lowrank", "pipeline", "elastic"])
def test_trajectory_is_pinned(tmp_path, name):
    _compare(name, pinned.RUNS[name](str(tmp_path)))


@pytest.mark.slow
def test_lightning_trajectory_is_pinned(tmp_path):
    _compare("lightning", pinned.lightning(str(tmp_path)))


@pytest.mark.parametrize("name", ["pretrain_group", "pretrain_elastic"])
@pytest.mark.slow
def test_pretrain_trajectory_is_pinned(tmp_path, name):
    _compare(name, pinned.RUNS[name](str(tmp_path)))


@pytest.mark.parametrize("slow", [0, 3])
def test_a_first_worker_whose_set_up_ends_rounds_after_its_partners_does_not_move_the_elastic_trajectory(tmp_path,
                                                                                                          slow):
    """A first worker of an elastic job (it passed the start barrier) that starts its first round a second after its
    partners (a slower set-up on a loaded machine; rounds here take milliseconds) is waited for at every exchange,
    as at round 0: its peers do not skip it as a joining process, so the run is the pinned one."""
    from fgdiloco.testing import run_workers_on_store

    _compare("elastic", run_workers_on_store(pinned._elastic_worker, 4, str(tmp_path), slow, 1.0))
