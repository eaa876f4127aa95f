"""The parts of ``benchmarks.wan --peers`` that need neither network namespaces nor torchft, which live in the package
(the tests never import the benchmarks): the peer options, the GPT's fragments, merging the ranks' rows, the
dead-worker cost and the comparison against a reference."""

from __future__ import annotations

import json
import math

import pytest

from fgdiloco.pretrain.comparison import (
    FAMILY,
    LABEL,
    METHODS,
    OUTER_GRID,
    OUTER_GRID_BASES,
    PEER_DEFAULTS,
    PEERS,
    base_method,
    check_peer,
    compare,
    dead_worker_cost,
    known_method,
    outer_variant,
    peer_targets,
    ratio_key,
    seed_summary,
)
from fgdiloco.pretrain.merge import merge_rank_rows, read_rank_rows, write_merged
from fgdiloco.pretrain.model import GPT, GPTConfig, fragments_of


# ---------------------------------------------------------------------------------------------------- options
def test_check_peer_fills_defaults_and_the_methods_are_valid():
    p = check_peer({}, sync_every=10, workers=4)
    assert p == PEER_DEFAULTS
    for name in PEERS:
        check_peer(METHODS[name]["peer"], sync_every=10, workers=4)
    assert METHODS["torchft-streaming"]["peer"]["fragment_sync_delay"] >= 1


@pytest.mark.parametrize("peer, match", [
    ({"bogus": 1}, "unknown peer option"),
    ({"backend": "nccl"}, "backend must be"),
    ({"fragments": 3}, "fragments must be an integer >= 1 dividing sync_every=10"),
    ({"fragments": 0}, "fragments must be"),
    ({"fragments": 2, "fragment_sync_delay": 5}, r"fragment_sync_delay must be an integer in \[0, 5\)"),
    ({"fragment_sync_delay": -1}, "fragment_sync_delay must be"),
    ({"fragment_update_alpha": 1.5}, "fragment_update_alpha must be in"),
    ({"die_rank": 0, "die_at_step": 5}, r"die_rank must be an integer in \[1, 4\)"),
    ({"die_rank": 4, "die_at_step": 5}, "die_rank must be"),
    ({"die_rank": 2}, "die_at_step must be an integer >= 1"),
])
def test_check_peer_rejects(peer, match):
    with pytest.raises(ValueError, match=match):
        check_peer(peer, sync_every=10, workers=4)


# ---------------------------------------------------------------------------------------------------- fragments
@pytest.mark.parametrize("n_layer, n", [(2, 1), (2, 2), (3, 2), (4, 3), (4, 4)])
def test_fragments_cover_every_parameter_once(n_layer, n):
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=n_layer, n_head=2, n_embd=16))
    frags = fragments_of(model, n)
    assert len(frags) == n
    seen = [id(p) for f in frags for p in f.parameters()]
    assert len(seen) == len(set(seen))  # no parameter in two fragments (the tied embedding / head included)
    assert set(seen) == {id(p) for p in model.parameters()}
    if n > 1:  # forward order: embeddings first, final LayerNorm last, blocks contiguous
        assert frags[0][0] is model.transformer.wte and frags[-1][-1] is model.transformer.ln_f
        blocks = [m for f in frags for m in f if m in list(model.transformer.h)]
        assert blocks == list(model.transformer.h)


def test_fragments_reject_more_than_the_blocks():
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match=r"fragments must be in \[1, n_layer=2\]"):
        fragments_of(model, 3)


# ---------------------------------------------------------------------------------------------------- merging
def _row(rank, step, loss, util, tx, **kw):
    return {"rank": rank, "step": step, "round": step // 10, "tokens": step * 100, "train_seconds": step * 0.1,
            "eval_loss": loss, "utilisation": util, "net_tx_bytes": tx, "net_rx_bytes": tx + 1, **kw}


def test_merge_means_over_the_ranks_that_reached_each_step():
    per_rank = {
        0: [_row(0, 0, 7.0, None, 0), _row(0, 10, 6.0, 0.8, 100), _row(0, 20, 5.0, 0.9, 200)],
        1: [_row(1, 0, 7.0, None, 0), _row(1, 10, 6.5, 0.6, 300), _row(1, 20, 5.5, 0.7, 400)],
        2: [_row(2, 0, 7.0, None, 0), _row(2, 10, 7.0, 0.4, 500, train_seconds=1.5)],  # died after step 10
    }
    rows = merge_rank_rows(per_rank)
    # the job's clock is its slowest rank's: rank 2 reached step 10 at 1.5 s, ranks 0 and 1 at 1.0 s
    assert [r["train_seconds_slowest"] for r in rows] == [0.0, 1.5, 2.0] and rows[1]["train_seconds"] == 1.0
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert rows[0]["utilisation_mean"] is None
    assert math.isclose(rows[1]["eval_loss_mean"], 6.5) and math.isclose(rows[1]["utilisation_mean"], 0.6)
    assert rows[1]["net_tx_bytes_mean"] == 300 and rows[1]["net_rx_bytes_mean"] == 301 and rows[1]["ranks"] == 3
    assert math.isclose(rows[2]["eval_loss_mean"], 5.25) and rows[2]["net_tx_bytes_mean"] == 300
    assert rows[2]["ranks"] == 2 and rows[2]["eval_loss"] == 5.0  # rank 0's own value kept


def test_merge_needs_rank_zero():
    with pytest.raises(ValueError, match="rank 0 wrote no rows"):
        merge_rank_rows({1: [_row(1, 0, 7.0, None, 0)]})


def test_write_merged_reads_the_rank_files(tmp_path):
    for rank, tx in ((0, 100), (1, 300)):
        rows = [_row(rank, 0, 7.0, None, 0), _row(rank, 10, 6.0 + rank, 0.5 + 0.2 * rank, tx)]
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rank0.done.json").write_text(json.dumps({"steps": 10, "stopped_early": False, "config": {"a": 1},
                                                          "commits": 1}))
    assert sorted(read_rank_rows(tmp_path)) == [0, 1]
    rows = write_merged(tmp_path)
    on_disk = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == rows and math.isclose(rows[1]["eval_loss_mean"], 6.5)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["commits"] == 1 and math.isclose(summary["utilisation"], 0.6)


# ---------------------------------------------------------------------------------------------------- dead worker
def _rounds(blocked, round_seconds=1.0, commits=None, **extra):
    rows = [{"round": 0, "step": 0, "blocked_seconds": None, "round_seconds": None}]
    for k, b in enumerate(blocked, start=1):
        r = {"round": k, "step": 10 * k, "blocked_seconds": b, "round_seconds": round_seconds + b, **extra}
        if commits is not None:
            r["commits"] = commits[k - 1]
        rows.append(r)
    return rows


def test_dead_worker_cost_fgdiloco_stall_only():
    rows = _rounds([0.1, 0.3, 0.2, 5.2, 5.1, 0.2], failed_exchanges=1)
    c = dead_worker_cost(rows, die_at_step=35, sync_every=10)  # dies in round 4
    assert c["died_in_round"] == 4 and math.isclose(c["normal_blocked_seconds"], 0.2)
    assert math.isclose(c["stall_seconds"], 5.0 + 4.9 + 0.0)
    assert c["rounds_lost"] == 0 and c["discarded_seconds"] == 0 and math.isclose(c["seconds_lost"], 9.9)
    assert c["failed_exchanges"] == 3 and c["participants_after"] is None


def test_dead_worker_cost_counts_torchft_rounds_without_a_commit():
    # 2 fragment syncs per round; round 4's commits failed (discarded), round 5 committed again
    rows = _rounds([0.5, 0.5, 0.5, 4.5, 0.5, 0.5], round_seconds=2.0, commits=[2, 4, 6, 6, 8, 10],
                   participants=3)
    c = dead_worker_cost(rows, die_at_step=35, sync_every=10)
    assert c["lost_rounds"] == [4] and c["rounds_lost"] == 1
    assert math.isclose(c["discarded_seconds"], 2.0)  # round 4's inner compute: round seconds - blocked
    assert math.isclose(c["stall_seconds"], 4.0) and math.isclose(c["seconds_lost"], 6.0)
    assert c["participants_after"] == [3, 3, 3]
    half = _rounds([0.5, 0.5, 0.5, 0.5, 0.5], round_seconds=2.0, commits=[2, 4, 6, 7, 9])  # one fragment lost
    assert math.isclose(dead_worker_cost(half, 35, 10)["discarded_seconds"], 1.0)


def test_dead_worker_cost_needs_rounds_on_both_sides():
    with pytest.raises(ValueError, match="need rounds before and after"):
        dead_worker_cost(_rounds([0.1, 0.2]), die_at_step=5, sync_every=10)
    with pytest.raises(ValueError, match="need rounds before and after"):
        dead_worker_cost(_rounds([0.1, 0.2]), die_at_step=35, sync_every=10)


# ---------------------------------------------------------------------------------------------------- comparison
def _run(method, losses, seconds, util=0.5, tx=1e6):
    curve = [{"tokens": 1000 * k, "train_seconds": s, "loss": v} for k, (v, s) in enumerate(zip(losses, seconds))]
    return {"method": method, "bandwidth_mbit": 100.0, "utilisation": util, "train_seconds": seconds[-1],
            "tokens": curve[-1]["tokens"], "capped": False, "final_loss": losses[-1],
            "wire_tx_bytes_per_worker": tx, "curve": curve}


def test_compare_against_torchft_and_the_targets():
    runs = [_run("torchft-diloco", [7, 6, 5, 4], [0, 10, 20, 30]),
            _run("torchft-streaming", [7, 6, 5, 4.5], [0, 8, 16, 24]),  # never reaches 4.0
            _run("fg-lowrank-r2=1", [7, 5.5, 4.5, 3.5], [0, 6, 12, 18], util=0.9, tx=2.5e5),
            _run("diloco", [7, 6, 5, 4], [0, 10, 20, 30])]
    t = compare(runs, [100.0], "torchft-diloco")["100"]
    assert t["reference"] == "torchft-diloco" and t["target_loss"] == 4
    fg = t["methods"]["fg-lowrank-r2=1"]
    assert math.isclose(fg["seconds_to_target"], 15.0)  # 4.5 at 12 s, 3.5 at 18 s: 4.0 at 15 s
    q = fg[ratio_key("torchft-diloco")]
    assert math.isclose(q["seconds_to_target"], 0.5) and math.isclose(q["wire_tx_bytes_per_worker"], 0.25)
    assert t["methods"]["torchft-streaming"]["seconds_to_target"] is None
    tg = peer_targets({"100": t})["100mbit"]
    assert tg["fg_best"] == "fg-lowrank-r2=1" and tg["streaming_best"] is None
    assert math.isclose(tg["fg_vs_torchft_diloco"], 0.5) and tg["fg_vs_torchft_diloco_le_0.6"]
    assert tg["fg_vs_streaming"] is None and tg["fg_vs_streaming_le_0.8"]  # Streaming never reaches the target
    assert not tg["fg_utilisation_ge_0.97"] and tg["fg_bytes_vs_streaming"] is None
    assert peer_targets({}) == {"evaluated": False}
    assert ratio_key("diloco") in compare(runs, [100.0])["100"]["methods"]["fg-lowrank-r2=1"]


def test_outer_optimizer_variants_are_named_registered_and_count_as_their_sides_setting():
    name = outer_variant("fg-stream-f2-t2", 0.5, 0.9)
    assert name == "fg-stream-f2-t2@olr0.5-om0.9" and base_method(name) == "fg-stream-f2-t2"
    assert METHODS[name] == {**METHODS["fg-stream-f2-t2"], "outer_lr": 0.5, "outer_momentum": 0.9}
    assert LABEL[name].endswith(", outer lr 0.5, momentum 0.9")
    assert known_method("torchft-streaming-f2-t2@olr0.9-om0.6")  # registered by its name (a reanalysed run)
    assert METHODS["torchft-streaming-f2-t2@olr0.9-om0.6"]["peer"] == METHODS["torchft-streaming-f2-t2"]["peer"]
    assert FAMILY["torchft-streaming-f2-t2@olr0.9-om0.6"] == "torchft"
    assert not known_method("nope@olr0.5-om0.9") and not known_method("fg-stream-f2-t2@lr0.5")
    assert {outer_variant(b, lr, m) for b in OUTER_GRID_BASES for lr, m in OUTER_GRID} <= set(METHODS)
    runs = [_run("torchft-diloco", [7, 6, 5, 4], [0, 10, 20, 30]),
            _run("torchft-streaming-f2-t2@olr0.7-om0.3", [7, 6, 5, 4], [0, 9, 18, 27]),
            _run("torchft-streaming-f2-t2@olr0.5-om0.6", [7, 5, 4, 3.9], [0, 8, 16, 24]),
            _run("fg-stream-f2-t2@olr0.7-om0.3", [7, 6, 5, 4], [0, 8, 16, 24], util=0.9),
            _run("fg-stream-f2-t2@olr0.9-om0.6", [7, 5, 4, 3.8], [0, 6, 12, 18], util=0.9)]
    tg = peer_targets(compare(runs, [100.0], "torchft-diloco"))["100mbit"]
    assert (tg["fg_best"], tg["streaming_best"]) == ("fg-stream-f2-t2@olr0.9-om0.6",
                                                     "torchft-streaming-f2-t2@olr0.5-om0.6")
    assert math.isclose(tg["fg_vs_streaming"], 12 / 16)


def test_peer_targets_take_each_sides_best_setting():
    runs = [_run("torchft-diloco", [7, 6, 5, 4], [0, 10, 20, 30], tx=1e6),
            _run("torchft-streaming", [7, 6, 5, 4], [0, 9, 18, 27], tx=1e6),
            _run("torchft-streaming-f2", [7, 5, 4, 3.9], [0, 8, 16, 24], tx=1e6),  # streaming's best: 16 s
            _run("fg-lowrank-r2=1", [7, 6, 5, 4], [0, 8, 16, 24], util=0.9, tx=4e5),
            _run("fg-stream-f2", [7, 5, 4, 3.8], [0, 6, 12, 18], util=0.98, tx=4e5)]  # fg's best: 12 s
    tg = peer_targets(compare(runs, [100.0], "torchft-diloco"))["100mbit"]
    assert (tg["fg_best"], tg["streaming_best"]) == ("fg-stream-f2", "torchft-streaming-f2")
    assert math.isclose(tg["fg_vs_streaming"], 12 / 16) and tg["fg_vs_streaming_le_0.8"]
    assert math.isclose(tg["fg_vs_torchft_diloco"], 0.4) and tg["fg_vs_torchft_diloco_le_0.6"]
    assert tg["fg_utilisation_ge_0.97"] and math.isclose(tg["fg_bytes_vs_streaming"], 0.4) and tg["fg_bytes_le_0.5"]
    assert tg["fg_loss_at_equal_tokens_no_worse"]


def test_seed_summary_gives_each_seeds_value_the_mean_the_spread_and_the_paired_difference():
    def table(fg_loss, st_loss, fg_reaches=True):
        runs = [_run("torchft-diloco", [7, 6, 5, 4], [0, 10, 20, 30]),
                _run("torchft-streaming-f2-t2", [7, 6, 5, st_loss], [0, 8, 16, 24]),
                _run("fg-stream-f2-t2", [7, 6, 5, fg_loss if fg_reaches else 4.5], [0, 6, 12, 18], util=0.9)]
        return compare(runs, [100.0], "torchft-diloco")
    s = seed_summary({0: table(3.0, 3.2), 2: table(3.3, 3.0), 1: table(3.1, 3.2)})
    assert s["seeds"] == [0, 1, 2]
    fg = s["methods"]["fg-stream-f2-t2"]["loss_at_equal_tokens"]
    assert fg["per_seed"] == [3.0, 3.1, 3.3]
    assert math.isclose(fg["mean"], (3.0 + 3.1 + 3.3) / 3) and math.isclose(fg["spread"], 0.3)
    times = s["methods"]["fg-stream-f2-t2"]
    assert times["train_seconds"]["per_seed"] == [18, 18, 18] and times["train_seconds"]["spread"] == 0
    assert times["seconds_to_loose_target"]["mean"] is not None and times["utilisation"]["mean"] == 0.9
    pair = s["fg_vs_streaming"]["fg-stream-f2-t2 vs torchft-streaming-f2-t2"]
    assert [round(r, 6) for r in pair["relative_loss_difference_per_seed"]] == [round(3.0 / 3.2 - 1, 6),
                                                                               round(3.1 / 3.2 - 1, 6), 0.1]
    assert pair["fg_lower_in_seeds"] == 2
    assert math.isclose(pair["mean"], ((3.0 / 3.2 - 1) + (3.1 / 3.2 - 1) + 0.1) / 3)
    # a seed in which FG-DiLoCo never reaches the target: its seconds are None, so is their mean
    t = seed_summary({0: table(3.0, 3.2), 1: table(3.0, 3.2, fg_reaches=False)})
    sec = t["methods"]["fg-stream-f2-t2"]["seconds_to_target"]
    assert sec["per_seed"][1] is None and sec["mean"] is None and sec["spread"] is None
    with pytest.raises(ValueError, match="tables is empty"):
        seed_summary({})
    with pytest.raises(ValueError, match="no 10 Mbit/s part"):
        seed_summary({0: table(3.0, 3.2)}, bw="10")
