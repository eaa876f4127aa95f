"""The analytic round model of fgdiloco.pretrain.simulate and its consensus study (fast: no training, no network)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fgdiloco.gossip.topology import make_topology
from fgdiloco.pretrain.simulate import (
    Network,
    Workload,
    contraction_matrices,
    contraction_vectors,
    perm_for,
    predict,
    ring_allreduce_bytes,
    ring_allreduce_seconds,
    rounds_to,
)

W = Workload(params=500_000, step_seconds=0.05, sync_every=20, mix1_bytes=700_000, mix2_bytes=25_000,
             outer_seconds=0.002)
METHODS = ("ddp", "diloco", "localsgd", "fgdiloco")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bw", [0.1, 1.0, 10.0, 100.0, 1000.0, 1e5])
@pytest.mark.parametrize("m", [1, 2, 4, 64, 1024])
def test_utilisation_in_unit_interval(method, bw, m):
    for r2 in (0, 1, 3):
        p = predict(method, W, m, Network(bw, latency_s=0.001), mix2_rounds=r2)
        assert 0.0 <= p.utilisation <= 1.0
        assert p.round_seconds >= p.compute_seconds > 0
        assert math.isclose(p.utilisation, p.compute_seconds / p.round_seconds)


@pytest.mark.parametrize("method", METHODS)
def test_infinite_bandwidth_gives_full_utilisation(method):
    w = Workload(W.params, W.step_seconds, W.sync_every, W.mix1_bytes, W.mix2_bytes, outer_seconds=0.0)
    net = Network(math.inf, latency_s=0.0, pair_setup_s=0.0)
    for m in (2, 4, 1024):
        assert predict(method, w, m, net).utilisation == 1.0


def test_utilisation_grows_with_bandwidth():
    for method in METHODS:
        us = [predict(method, W, 8, Network(bw)).utilisation for bw in (1, 10, 100, 1000, 10000)]
        assert us == sorted(us)


def test_fgdiloco_blocking_is_independent_of_m_and_diloco_grows():
    net = Network(100.0, latency_s=0.001)
    fg = [predict("fgdiloco", W, m, net).blocked_seconds for m in (2, 4, 16, 256, 1024)]
    assert max(fg) - min(fg) < 1e-12
    dl = [predict("diloco", W, m, net).blocked_seconds for m in (2, 4, 16, 256, 1024)]
    assert all(b > a for a, b in zip(dl, dl[1:]))
    # as modelled: bandwidth term 2(M-1)/M * S/bw, latency term 2(M-1) * a
    s, m = 4.0 * W.params, 64
    expect = 2 * (m - 1) / m * s / net.bytes_per_s + 2 * (m - 1) * net.latency_s + W.outer_seconds
    assert math.isclose(predict("diloco", W, m, net).blocked_seconds, expect)
    # without latency the all-reduce tends to 2 S / bw: bounded in M
    net0 = Network(100.0, latency_s=0.0)
    big = ring_allreduce_seconds(s, 1024, net0)
    assert big < 2 * s / net0.bytes_per_s
    assert math.isclose(big, (2 * 1023 / 1024) * s / net0.bytes_per_s)
    assert ring_allreduce_bytes(s, 4) == 1.5 * s


def test_mix1_hides_until_it_is_longer_than_the_inner_steps():
    net = Network(100.0, latency_s=0.0, pair_setup_s=0.0)
    compute = W.sync_every * W.step_seconds
    t1 = W.mix1_bytes / net.bytes_per_s
    assert t1 < compute
    p = predict("fgdiloco", W, 4, net, mix2_rounds=0)
    assert p.mix1_hidden and math.isclose(p.blocked_seconds, W.outer_seconds)
    slow = Network(1.0, latency_s=0.0, pair_setup_s=0.0)
    p = predict("fgdiloco", W, 4, slow, mix2_rounds=0)
    assert not p.mix1_hidden
    assert math.isclose(p.blocked_seconds, W.mix1_bytes / slow.bytes_per_s - compute + W.outer_seconds)


def test_ddp_pays_every_step():
    net = Network(100.0)
    d = predict("ddp", W, 4, net)
    dl = predict("diloco", W, 4, net)
    assert math.isclose(d.blocked_seconds, W.sync_every * (dl.blocked_seconds - W.outer_seconds))
    assert d.utilisation < dl.utilisation


def test_exponential_m8_is_exact_after_3_rounds():
    mat = contraction_matrices("exponential", 8, 3)
    assert mat["worst"][2] == 0.0
    assert mat["mean"][2] == 0.0
    assert mat["worst"][1] > 0.0
    vec = contraction_vectors("exponential", 8, 3)
    assert vec[2] < 1e-15
    assert rounds_to(vec, 1e-12) == 3
    topo = make_topology("exponential", 8)
    prod = np.eye(8)
    for k in range(3):
        prod = topo.mixing_matrix(k).numpy() @ prod
    assert np.array_equal(prod, np.full((8, 8), 1 / 8))


@pytest.mark.parametrize("name", ["random", "exponential", "ring"])
def test_peer_vectors_match_mixing_matrices(name):
    for m in (5, 16, 33):
        vec = contraction_vectors(name, m, 10)
        mat = contraction_matrices(name, m, 10)
        assert np.allclose(vec, mat["mean"], atol=1e-12)
        assert all(v <= w + 1e-12 for v, w in zip(mat["mean"], mat["worst"]))
        topo = make_topology(name, m)
        perm = perm_for(topo, 3)
        assert np.array_equal(perm[perm], np.arange(m))  # a matching: peer of peer is self


def test_contraction_is_monotone_and_ring_is_slowest():
    ring = contraction_vectors("ring", 64, 64)
    rnd = contraction_vectors("random", 64, 64)
    assert all(b <= a + 1e-12 for a, b in zip(ring, ring[1:]))
    assert rnd[-1] < ring[-1]
    assert contraction_vectors("allreduce", 16, 1)[0] < 1e-15


def test_the_consensus_study_computes_log2_m_rounds_whatever_max_rounds():
    """``fgdiloco simulate --max-rounds 5`` crashed (IndexError) where log2 M > 5: the rows report the contraction
    after log2 M rounds."""
    from fgdiloco.pretrain.simulate import consensus_study

    out = consensus_study([64], topologies=("ring", "exponential"), max_rounds=1, matrix_max_m=64, random_seeds=1)
    ring, exp = out["by_topology"]["ring"][0], out["by_topology"]["exponential"][0]
    for row in (ring, exp):
        assert row["rounds_computed"] == 6 and 0 <= row["after_log2m"] <= row["after_1"] <= 1
    assert exp["after_log2m"] < 1e-12  # the exponential graph is exact after log2 M rounds


def test_halving_doubling_latency_grows_with_log_m():
    from fgdiloco.pretrain.simulate import allreduce_seconds

    net = Network(math.inf, latency_s=0.001)
    assert math.isclose(allreduce_seconds(1e6, 1024, net, "halving_doubling"), 2 * 10 * 0.001)
    assert math.isclose(allreduce_seconds(1e6, 1024, net, "ring"), 2 * 1023 * 0.001)
    with pytest.raises(ValueError):
        allreduce_seconds(1e6, 4, net, "tree")


def test_the_simulated_job_is_the_wan_benchmarks_job():
    from fgdiloco.pretrain.comparison import JOB as WAN_JOB
    from fgdiloco.pretrain.simulate import JOB, _job

    assert JOB is WAN_JOB and _job() == WAN_JOB  # benchmarks/wan.py runs this JOB too


def test_fgdiloco_simulate_re_exports_the_package_model():
    import fgdiloco.pretrain.simulate as pkg
    import fgdiloco.simulate as old

    assert old.predict is pkg.predict and old.consensus_study is pkg.consensus_study and old.JOB is pkg.JOB


@pytest.mark.slow
def test_fgdiloco_simulate_writes_a_fresh_folder_and_prints_tables(tmp_path):
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "runs" / "simulate").mkdir(parents=True)
    (tmp_path / "runs" / "simulate" / "simulate.json").write_text("{}")  # an earlier result: kept
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="160")
    (tmp_path / "no-runs.json").write_text('{"runs": []}')  # nothing measured to validate against
    proc = subprocess.run([sys.executable, "-m", "fgdiloco", "simulate", "--quick", "--max-rounds", "300",
                           "--wan", str(tmp_path / "no-runs.json")], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fresh = tmp_path / "runs" / "simulate-2"
    assert "writing this one to runs/simulate-2" in proc.stderr
    assert (tmp_path / "runs" / "simulate" / "simulate.json").read_text() == "{}"
    res = json.loads((fresh / "simulate.json").read_text())
    assert res["plots"] == ["runs/simulate-2/simulate_utilisation.png", "runs/simulate-2/simulate_consensus.png"]
    assert all((tmp_path / p).is_file() for p in res["plots"])
    assert "predicted compute utilisation (%)" in proc.stdout and "gossip rounds to 0.01" in proc.stdout
    table = proc.stdout[proc.stdout.index("predicted compute utilisation"):]
    for label in ("DDP", "DiLoCo", "FG-DiLoCo LowRank r2=1"):
        row = next(line for line in table.splitlines() if line.strip("│┃ ").startswith(label + " "))
        cells = [c.strip() for c in row.strip("│┃ ").split("│")[1:]]
        expect = [100 * res["table"][k]["utilisation"] for k in res["table"] if k.startswith(label + " |")]
        assert [float(c) for c in cells] == pytest.approx(expect, abs=0.051)
    assert "{" not in proc.stdout  # no raw dict


def test_fgdiloco_simulate_refuses_options_out_of_range_in_one_line(tmp_path, capsys):
    from fgdiloco.cli import main

    # they crashed (ZeroDivisionError, IndexError) or were taken as given (a negative bandwidth, a nan)
    for argv, text in ((["--bandwidth", "0"], "--bandwidth: expected a number in (0, inf), got '0'"),
                       (["--bandwidth", "nan"], "--bandwidth: expected a number in (0, inf), got 'nan'"),
                       (["--latency-ms", "-1"], "--latency-ms: expected a number in [0, inf), got '-1'"),
                       (["--oversubscription", "0"], "--oversubscription: expected a number in (0, inf)"),
                       (["--max-rounds", "0"], "--max-rounds: expected an int >= 1, got '0'")):
        with pytest.raises(SystemExit) as exit_:
            main(["simulate", *argv, "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2
        assert text in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["simulate", "--wan", str(tmp_path / "none.json"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"fgdiloco simulate: error: --wan {tmp_path / 'none.json'}: no such file"
    assert not (tmp_path / "out").exists()  # refused before anything was written
