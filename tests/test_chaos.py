"""The chaos benchmark's schedule and summary helpers (the benchmark itself is too slow for the test gate)."""

from benchmarks.chaos import KINDS, _full_waits, _lost, _others_lost, _per_kind, make_schedule, targets


def test_the_schedule_is_seeded_increasing_and_drawn_from_the_kinds():
    a = make_schedule(50, 2.0, 7, list(KINDS), [3, 2, 1, 1, 2, 1], (5.0, 20.0))
    assert a == make_schedule(50, 2.0, 7, list(KINDS), [3, 2, 1, 1, 2, 1], (5.0, 20.0))
    assert a != make_schedule(50, 2.0, 8, list(KINDS), [3, 2, 1, 1, 2, 1], (5.0, 20.0))
    assert len(a) == 50 and all(x["at"] < y["at"] for x, y in zip(a, a[1:]))
    assert all(1.0 <= y["at"] - x["at"] <= 3.0 for x, y in zip(a, a[1:]))
    assert {f["kind"] for f in a} <= set(KINDS) and all(5.0 <= f["seconds"] <= 20.0 for f in a)
    assert all(sorted(f["fallback"]) == sorted(KINDS) and 0 <= f["pick"] < 1 for f in a)


def test_rounds_lost_and_seconds_lost_are_counted_from_the_round_log():
    rounds = [(0, 10.0), (1, 11.0), (2, 12.0), (6, 20.0), (7, 21.0)]  # away from 12.5 to 19: rounds 3-5 lost
    assert _lost(rounds, 12.5, 19.0) == (3, 7.5)
    hung = [(0, 10.0), (1, 11.0), (2, 19.5), (9, 20.0), (10, 21.0)]  # finishes round 2 after a hang, then jumps
    assert _lost(hung, 11.5, 19.0) == (6, 8.0)
    assert _lost(rounds, 21.5, 21.5) == (None, None)  # never trained again
    rounds_of = {0: [(r, 10.0 + r) for r in range(10)], 1: [(0, 10.0), (1, 12.0), (2, 15.0)]}
    f = {"at": 10.5, "up": [0, 1, 2], "victim": 2}
    # worker 0 trained 4 rounds of 1 s in the 4 s window (lost 0), worker 1 one (lost 3)
    assert _others_lost(f, 14.5, rounds_of, 1.0) == 1.5


def test_per_kind_summary_and_hangs(tmp_path):
    per = [{"kind": "kill", "victim_rounds_lost": 2, "victim_back_s": 8.0, "others_lost_s": 1.0},
           {"kind": "kill", "victim_rounds_lost": 4, "victim_back_s": 10.0, "others_lost_s": 0.0},
           {"kind": "store", "victim_rounds_lost": 0, "others_lost_s": -0.5}]
    k = _per_kind(per)
    assert k["kill"]["count"] == 2 and k["kill"]["victim_rounds_lost_mean"] == 3
    assert k["kill"]["victim_rounds_lost_max"] == 4
    assert k["store"]["others_lost_s_mean"] == -0.5 and "stop" not in k
    log = tmp_path / "worker0.log"
    log.write_text("x mix2 exchange mix2/0/3 with rank 4 timed out after 30.1 s; keeping own value\n"
                   "worker 0 round   3  train 1.0  failed 1  rejoins 0  at 1.000\n"
                   "x mix2 exchange mix2/0/4 with rank 4 timed out after 29.9 s; keeping own value\n"
                   "x mix1 exchange mix1/0/5 with rank 1 timed out after 2.0 s; keeping own value\n")
    waits, hangs, _ = _full_waits([log], 30.0)
    assert len(waits) == 2 and len(hangs) == 1 and hangs[0]["peer"] == 4
    row = {"faults": 100, "loss_vs_clean": 1.01, "time_vs_clean": 1.2, "hangs": 0, "workers_lost": 0,
           "files_missing": 0}
    assert targets(row, 100) == {"faults >= 100": True, "loss within 2 % of clean": True, "time <= 1.15x clean": False,
                                 "zero hangs": True, "zero workers lost": True, "zero files missing": True}
