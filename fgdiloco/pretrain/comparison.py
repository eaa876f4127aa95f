"""Side-by-side runs of the example job: what ``benchmarks/wan.py`` runs and how it compares the runs.

The runner (network namespaces, processes, torchft) lives in ``benchmarks/``; the definitions and the pure analysis
live here, so that the package's ``fgdiloco simulate`` and the tests use the same ones without importing the
benchmarks:

* :data:`JOB` (the job every method runs, also the "real GPT" whose codec bytes the simulator measures),
  :data:`METHODS` (method name -> :class:`~fgdiloco.pretrain.config.TrainConfig` overrides), :data:`PEERS`,
  :data:`LABEL`, :data:`FAMILY`;
* the peer runs' options (:data:`PEER_DEFAULTS`, :func:`check_peer`) for torchft's DiLoCo / Streaming DiLoCo and
  the dead-worker runs;
* :func:`crossing`, :func:`loss_at`, :func:`compare` (time and tokens to a reference method's final held-out loss,
  loss at equal tokens, ratios, :func:`ratio_key`), :func:`targets`, :func:`peer_targets`;
* :func:`dead_worker_cost`: what one dead worker cost a survivor, from its own rows.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

__all__ = ["DIED_EXIT_CODE", "FAMILY", "FG_GRID", "JOB", "LABEL", "LOOSE", "METHODS", "OUTER_GRID",
           "OUTER_GRID_BASES", "PEERS", "PEER_DEFAULTS", "STREAMING_GRID", "base_method", "check_peer", "compare",
           "crossing", "dead_worker_cost", "known_method", "loss_at", "outer_variant", "peer_targets", "ratio_key",
           "row_loss", "seed_summary", "targets"]

#: The job every method of ``benchmarks/wan.py`` runs (TrainConfig fields): also the "real GPT" whose codec bytes
#: ``fgdiloco simulate`` measures, and the run shape of the measured runs its model is validated against.
JOB: dict[str, Any] = {
    "workers": 4,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "vocab_size": 1024,
    "block_size": 64,
    "batch_size": 8,
    "lr": 3e-3,
    "warmup_steps": 20,
    "weight_decay": 0.1,
    "sync_every": 10,
    "steps": 300,
    "seed": 0,
    "eval_batches": 8,
}


#: FG-DiLoCo with LowRank r4 int8 and one Mix2 round on the random topology: what the FG-DiLoCo methods vary
_LOWRANK: dict[str, Any] = {"topology": "random", "codec": "lowrank", "codec_rank": 4, "mix2_rounds": 1}
#: ... with tau = 4 and Mix1 without the outer momentum: what the tau = 4 methods vary
_T4_NM: dict[str, Any] = {**_LOWRANK, "overlap_steps": 4, "mix_momentum": False}
_T4_NM_DENSE: dict[str, Any] = {**_T4_NM, "codec": "dense", "codec_rank": None}  # a dense codec has no rank

#: method name -> TrainConfig overrides
METHODS: dict[str, dict[str, Any]] = {
    "ddp": {"baseline": "ddp"},
    "diloco": {"topology": "allreduce", "codec": "dense", "mix2_rounds": 1},
    "localsgd": {"baseline": "localsgd"},
    "fg-dense-r2=0": {"topology": "random", "codec": "dense", "mix2_rounds": 0},
    "fg-dense-r2=1": {"topology": "random", "codec": "dense", "mix2_rounds": 1},
    "fg-lowrank-r2=0": {**_LOWRANK, "mix2_rounds": 0},
    "fg-lowrank-r2=1": dict(_LOWRANK),
    # the overlap without fragments: Mix2 starts tau = 2 inner steps before the outer step (F = 1)
    "fg-lowrank-t2": {**_LOWRANK, "overlap_steps": 2},
    # Mix1 without the outer momentum (mix_momentum=False): half of Mix1's bytes and CPU; each worker's momentum
    # follows its own mixed pseudo-gradients
    "fg-lowrank-nm": {**_LOWRANK, "mix_momentum": False},
    "fg-lowrank-t2-nm": {**_LOWRANK, "overlap_steps": 2, "mix_momentum": False},
    # a longer overlap (tau = 4 of H = 10): Mix2 hides a partner up to 4 steps behind, and carries 4 steps of delay
    "fg-lowrank-t4-nm": dict(_T4_NM),
    # spending some of the bytes saved on mixing: two Mix2 gossip rounds, or rank 8
    "fg-lowrank-t4-nm-m2": {**_T4_NM, "mix2_rounds": 2},
    "fg-lowrank-t4-nm-r8": {**_T4_NM, "codec_rank": 8},
    # the exponential graph (Ying et al. 2021): with M = 4 two consecutive gossip rounds reach every worker (the
    # exact average of uncompressed values; LowRank mixes each pair's agreed projection); a per-token screen at
    # tau = 4 (benchmarks/RESULTS.md, "Two Mix2 rounds on the exponential graph")
    "fg-lowrank-t4-nm-r8-exp": {**_T4_NM, "codec_rank": 8, "topology": "exponential"},
    "fg-lowrank-t4-nm-r8-m2-exp": {**_T4_NM, "codec_rank": 8, "topology": "exponential", "mix2_rounds": 2},
    "fg-lowrank-t4-nm-r8-m2-exp-m1x2": {**_T4_NM, "codec_rank": 8, "topology": "exponential", "mix2_rounds": 2,
                                        "mix1_rounds": 2},
    "fg-lowrank-t4-nm-r8-m3-exp": {**_T4_NM, "codec_rank": 8, "topology": "exponential", "mix2_rounds": 3},
    "fg-lowrank-t4-nm-r16-m2-exp": {**_T4_NM, "codec_rank": 16, "topology": "exponential", "mix2_rounds": 2},
    "fg-lowrank-t4-nm-r8-m2": {**_T4_NM, "codec_rank": 8, "mix2_rounds": 2},
    "fg-lowrank-t4-r8-m2-exp": {**_LOWRANK, "overlap_steps": 4, "codec_rank": 8, "topology": "exponential",
                                "mix2_rounds": 2},
    "fg-lowrank-t4-nm-r16": {**_T4_NM, "codec_rank": 16},
    # diagnostics of the per-token gap to torchft DiLoCo tau = 4: FG-DiLoCo's exact mode at tau = 4 (the all-reduce of
    # dense pseudo-gradients: torchft-diloco-t4's algorithm in this library), and the exponential two-round setting
    # with dense pseudo-gradients (the exact average of four workers' Mix2, Mix1 still gossiped)
    "fg-exact-t4": {"topology": "allreduce", "codec": "dense", "mix2_rounds": 1, "overlap_steps": 4},
    "fg-dense-t4-nm-m2-exp": {**_T4_NM_DENSE, "topology": "exponential", "mix2_rounds": 2},
    "fg-dense-t4-nm-m2-exp-m1fp32": {**_T4_NM_DENSE, "topology": "exponential", "mix2_rounds": 2,
                                     "mix1_codec": "dense"},
    # FG-DiLoCo with Streaming DiLoCo's fragments (F = 2), its overlap (tau = 2 inner steps) and its merge
    # (alpha = 0.5): the tuning grid of benchmarks.wan --peers (F = 4 does not divide H = 10)
    "fg-stream-f2": {**_LOWRANK, "fragments": 2},
    "fg-stream-f2-t2": {**_LOWRANK, "fragments": 2, "overlap_steps": 2},
    "fg-stream-f2-a0.5": {**_LOWRANK, "fragments": 2, "merge_alpha": 0.5},
    "fg-stream-f2-t2-a0.5": {**_LOWRANK, "fragments": 2, "overlap_steps": 2, "merge_alpha": 0.5},
    # the peers (benchmarks/peers.py; torchft from `pip install -e ".[bench]"`): torchft's DiLoCo, and its Streaming
    # DiLoCo with the model in 2 fragments (embeddings + block 0 | block 1 + final norm), one synchronised every
    # H / 2 steps, each all-reduce started 2 inner steps before it is needed and the result mixed half-half with
    # the local fragment (Streaming DiLoCo's tau and alpha). should_quantize stays off: torchft's quantised
    # all-reduce is Triton (GPU) code and without Triton torchft silently sends fp32 anyway.
    "torchft-diloco": {"peer": {"backend": "torchft", "fragments": 1}},
    # torchft DiLoCo with Streaming DiLoCo's overlap and no fragments: the all-reduce starts 2 steps early
    "torchft-diloco-t2": {"peer": {"backend": "torchft", "fragments": 1, "fragment_sync_delay": 2}},
    "torchft-diloco-t4": {"peer": {"backend": "torchft", "fragments": 1, "fragment_sync_delay": 4}},
    "torchft-streaming": {"peer": {"backend": "torchft", "fragments": 2, "fragment_sync_delay": 2,
                                   "fragment_update_alpha": 0.5}},
    # the same grid for Streaming DiLoCo (torchft-streaming above is its F = 2, tau = 2, alpha = 0.5 point)
    "torchft-streaming-f2": {"peer": {"backend": "torchft", "fragments": 2}},
    "torchft-streaming-f2-t2": {"peer": {"backend": "torchft", "fragments": 2, "fragment_sync_delay": 2}},
    "torchft-streaming-f2-a0.5": {"peer": {"backend": "torchft", "fragments": 2, "fragment_update_alpha": 0.5}},
}
#: the tuning grid, per side: the methods each side's best setting is chosen from (:func:`peer_targets`)
FG_GRID = ("fg-lowrank-r2=1", "fg-lowrank-t2", "fg-lowrank-nm", "fg-lowrank-t2-nm", "fg-lowrank-t4-nm",
           "fg-lowrank-t4-nm-r8", "fg-lowrank-t4-nm-r8-m2-exp", "fg-stream-f2", "fg-stream-f2-t2", "fg-stream-f2-a0.5",
           "fg-stream-f2-t2-a0.5")
STREAMING_GRID = ("torchft-streaming", "torchft-diloco-t2", "torchft-diloco-t4", "torchft-streaming-f2",
                  "torchft-streaming-f2-t2", "torchft-streaming-f2-a0.5")
#: the methods --peers adds to the default set
PEERS = ("torchft-diloco", "torchft-streaming")
#: --outer-grid: (outer lr, outer momentum) points run for each side's best setting of the F/tau/alpha grid (the
#: Nesterov SGD outer optimizer of both sides; the job's own setting is (0.7, 0.3))
OUTER_GRID = ((0.5, 0.3), (0.7, 0.3), (0.9, 0.3), (0.5, 0.6), (0.7, 0.6), (0.9, 0.6), (0.5, 0.9), (0.7, 0.9),
              (0.9, 0.9))
#: the settings whose outer optimizer --outer-grid varies (each side's best F/tau/alpha point of the --grid run)
OUTER_GRID_BASES = ("fg-stream-f2-t2", "torchft-streaming-f2-t2")
FAMILY = {"ddp": "ddp", "diloco": "diloco", "localsgd": "localsgd", "torchft-diloco": "torchft",
          **{m: "torchft" for m in STREAMING_GRID}}
LABEL = {"ddp": "DDP (per step)", "diloco": "DiLoCo", "localsgd": "post-local SGD (PyTorch)",
         "fg-dense-r2=0": "FG-DiLoCo dense, r2=0", "fg-dense-r2=1": "FG-DiLoCo dense, r2=1",
         "fg-lowrank-r2=0": "FG-DiLoCo LowRank r4 int8, r2=0", "fg-lowrank-r2=1": "FG-DiLoCo LowRank r4 int8, r2=1",
         "fg-lowrank-t2": "FG-DiLoCo LowRank r4, tau=2",
         "fg-lowrank-nm": "FG-DiLoCo LowRank r4, Mix1 without momentum",
         "fg-lowrank-t2-nm": "FG-DiLoCo LowRank r4, tau=2, Mix1 without momentum",
         "fg-lowrank-t4-nm": "FG-DiLoCo LowRank r4, tau=4, Mix1 without momentum",
         "fg-lowrank-t4-nm-m2": "FG-DiLoCo LowRank r4, tau=4, Mix1 without momentum, 2 Mix2 rounds",
         "fg-lowrank-t4-nm-r8": "FG-DiLoCo LowRank r8, tau=4, Mix1 without momentum",
         "fg-lowrank-t4-nm-r8-exp": "FG-DiLoCo LowRank r8, tau=4, Mix1 without momentum, exponential",
         "fg-lowrank-t4-nm-r8-m2-exp": "FG-DiLoCo LowRank r8, tau=4, Mix1 without momentum, exponential, 2 Mix2 rounds",
         "fg-lowrank-t4-nm-r8-m2-exp-m1x2": ("FG-DiLoCo LowRank r8, tau=4, Mix1 without momentum, exponential, "
                                             "2 Mix2 rounds, 2 Mix1 rounds"),
         "fg-lowrank-t4-nm-r8-m3-exp": "FG-DiLoCo LowRank r8, tau=4, Mix1 without momentum, exponential, 3 Mix2 rounds",
         "fg-lowrank-t4-nm-r16-m2-exp": ("FG-DiLoCo LowRank r16, tau=4, Mix1 without momentum, exponential, "
                                         "2 Mix2 rounds"),
         "fg-lowrank-t4-nm-r8-m2": "FG-DiLoCo LowRank r8, tau=4, Mix1 without momentum, 2 Mix2 rounds",
         "fg-lowrank-t4-r8-m2-exp": "FG-DiLoCo LowRank r8, tau=4, exponential, 2 Mix2 rounds",
         "fg-lowrank-t4-nm-r16": "FG-DiLoCo LowRank r16, tau=4, Mix1 without momentum",
         "fg-exact-t4": "FG-DiLoCo exact mode (all-reduce, dense), tau=4",
         "fg-dense-t4-nm-m2-exp": "FG-DiLoCo dense, tau=4, Mix1 without momentum, exponential, 2 Mix2 rounds",
         "fg-dense-t4-nm-m2-exp-m1fp32": ("FG-DiLoCo dense, tau=4, Mix1 fp32 without momentum, exponential, "
                                          "2 Mix2 rounds"),
         "fg-stream-f2": "FG-DiLoCo LowRank r4, F=2",
         "fg-stream-f2-t2": "FG-DiLoCo LowRank r4, F=2, tau=2",
         "fg-stream-f2-a0.5": "FG-DiLoCo LowRank r4, F=2, alpha=0.5",
         "fg-stream-f2-t2-a0.5": "FG-DiLoCo LowRank r4, F=2, tau=2, alpha=0.5",
         "torchft-diloco": "torchft DiLoCo", "torchft-diloco-t2": "torchft DiLoCo (tau=2)",
         "torchft-diloco-t4": "torchft DiLoCo (tau=4)",
         "torchft-streaming": "torchft Streaming DiLoCo (F=2, tau=2, alpha=0.5)",
         "torchft-streaming-f2": "torchft Streaming DiLoCo (F=2)",
         "torchft-streaming-f2-t2": "torchft Streaming DiLoCo (F=2, tau=2)",
         "torchft-streaming-f2-a0.5": "torchft Streaming DiLoCo (F=2, alpha=0.5)"}


def outer_variant(base: str, lr: float, momentum: float) -> str:
    """Register (in :data:`METHODS`, :data:`LABEL`, :data:`FAMILY`) the method ``base`` with the outer optimizer's
    learning rate ``lr`` and Nesterov momentum ``momentum``, named ``"<base>@olr<lr>-om<momentum>"``; returns the
    name. It belongs to the same side's grid as ``base`` (:func:`peer_targets`).

    Raises:
        KeyError: ``base`` is not a method.
    """
    name = f"{base}@olr{lr:g}-om{momentum:g}"
    METHODS[name] = {**METHODS[base], "outer_lr": lr, "outer_momentum": momentum}
    LABEL[name] = f"{LABEL[base]}, outer lr {lr:g}, momentum {momentum:g}"
    if base in FAMILY:
        FAMILY[name] = FAMILY[base]
    return name


def known_method(name: str) -> bool:
    """Whether ``name`` is a method; an outer-optimizer variant of a method (``"<base>@olr<lr>-om<momentum>"``, as
    :func:`outer_variant` names them) is registered on the way."""
    if name in METHODS:
        return True
    base, _, suffix = name.partition("@")
    point = re.fullmatch(r"olr(\d+(?:\.\d+)?)-om(\d+(?:\.\d+)?)", suffix)
    return base in METHODS and point is not None and outer_variant(base, float(point[1]), float(point[2])) == name


def base_method(name: str) -> str:
    """The F/tau/alpha setting a method is a variant of (``name`` less its ``@...`` outer-optimizer suffix)."""
    return name.split("@", 1)[0]


#: exit code of the worker killed on purpose (the orchestrator does not count it as a failure)
DIED_EXIT_CODE = 17

#: peer options and their defaults (the "peer" entry of a run's config)
PEER_DEFAULTS: dict[str, Any] = {
    "backend": "torchft",  # "torchft" or "fgdiloco"
    "fragments": 1,
    "fragment_sync_delay": 0,
    "fragment_update_alpha": 0.0,
    "should_quantize": False,
    "lighthouse": None,  # "http://<addr>:<port>" (torchft)
    "store_port": 29600,  # this replica's TCPStore, in its own namespace (torchft)
    "manager_port": 29610,  # this replica's ManagerServer (torchft)
    "min_replicas": None,  # torchft Manager.min_replica_size; None: workers - 1 (one failure tolerated)
    "die_rank": None,
    "die_at_step": None,
    "stop_flag": True,  # all-reduce the max_seconds stop flag over the world group each round
}


def check_peer(peer: dict[str, Any], sync_every: int, workers: int) -> dict[str, Any]:
    """``peer`` completed with :data:`PEER_DEFAULTS` and checked against the job.

    Raises:
        ValueError: an unknown key or backend, ``fragments`` not dividing ``sync_every``, ``fragment_sync_delay``
            not in ``[0, sync_every / fragments)``, ``fragment_update_alpha`` not in [0, 1], or a fault outside the
            job (``die_rank`` not in ``[1, workers)``: rank 0 hosts the store and the lighthouse).
    """
    unknown = sorted(set(peer) - set(PEER_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown peer option(s) {unknown}; allowed: {', '.join(PEER_DEFAULTS)}")
    p = {**PEER_DEFAULTS, **peer}
    if p["backend"] not in ("torchft", "fgdiloco"):
        raise ValueError(f"backend must be 'torchft' or 'fgdiloco', got {p['backend']!r}")
    f = p["fragments"]
    if not isinstance(f, int) or f < 1 or sync_every % f:
        raise ValueError(f"fragments must be an integer >= 1 dividing sync_every={sync_every}, got {f!r}")
    d = p["fragment_sync_delay"]
    if not isinstance(d, int) or not 0 <= d < sync_every // f:
        raise ValueError(f"fragment_sync_delay must be an integer in [0, {sync_every // f}) "
                         f"(sync_every / fragments), got {d!r}")
    if not 0.0 <= float(p["fragment_update_alpha"]) <= 1.0:
        raise ValueError(f"fragment_update_alpha must be in [0, 1], got {p['fragment_update_alpha']!r}")
    if p["die_rank"] is not None:
        if not isinstance(p["die_rank"], int) or not 1 <= p["die_rank"] < workers:
            raise ValueError(f"die_rank must be an integer in [1, {workers}) (rank 0 hosts the store and the "
                             f"lighthouse), got {p['die_rank']!r}")
        if not isinstance(p["die_at_step"], int) or p["die_at_step"] < 1:
            raise ValueError(f"die_at_step must be an integer >= 1 with die_rank, got {p['die_at_step']!r}")
    return p


def row_loss(row: dict[str, Any]) -> float:
    """A row's held-out loss: the mean over the replicas when the row has it, else rank 0's."""
    v = row.get("eval_loss_mean")
    return row["eval_loss"] if v is None else v


def crossing(rows: list[dict[str, Any]], key: str, target: float) -> float | None:
    """First value of ``key`` (linearly interpolated between evaluations) at which the loss reaches ``target``."""
    prev = None
    for r in rows:
        if row_loss(r) <= target:
            if prev is None:
                return float(r[key])
            l0, l1 = row_loss(prev), row_loss(r)
            f = (l0 - target) / (l0 - l1) if l0 != l1 else 1.0
            return float(prev[key] + f * (r[key] - prev[key]))
        prev = r
    return None


def loss_at(rows: list[dict[str, Any]], tokens: float) -> float | None:
    """Held-out loss at ``tokens`` (interpolated); None when the run did not get there."""
    prev = None
    for r in rows:
        if r["tokens"] >= tokens:
            if prev is None or r["tokens"] == tokens:
                return row_loss(r)
            f = (tokens - prev["tokens"]) / (r["tokens"] - prev["tokens"])
            return row_loss(prev) + f * (row_loss(r) - row_loss(prev))
        prev = r
    return None


def ratio_key(ref: str) -> str:
    """The key of the ratios to method ``ref`` in a :func:`compare` row (``ratio_to_diloco``,
    ``ratio_to_torchft_diloco``)."""
    return "ratio_to_" + ref.replace("-", "_")


def compare(runs: list[dict[str, Any]], bandwidths: list[float], ref_method: str = "diloco") -> dict[str, Any]:
    """Targets, time/tokens to target, loss at equal tokens and ratios to ``ref_method`` (its final held-out loss
    is the target, its tokens the equal-token point), per bandwidth."""
    table: dict[str, Any] = {}
    key = ratio_key(ref_method)
    for bw in bandwidths:
        here = [r for r in runs if r["bandwidth_mbit"] == bw and not r.get("error")]
        ref = next((r for r in here if r["method"] == ref_method), None)
        if ref is None:
            continue
        target = ref["final_loss"]
        loose = target * (1 + LOOSE)
        tokens_eq = ref["tokens"]
        rows = {}
        for r in here:
            t_time = crossing(_curve_rows(r), "train_seconds", target)
            t_tok = crossing(_curve_rows(r), "tokens", target)
            leq = loss_at(_curve_rows(r), tokens_eq)
            rows[r["method"]] = {
                "seconds_to_loose_target": crossing(_curve_rows(r), "train_seconds", loose),
                "tokens_to_loose_target": crossing(_curve_rows(r), "tokens", loose),
                "utilisation": r["utilisation"],
                "train_seconds": r["train_seconds"],
                "tokens": r["tokens"],
                "capped": r["capped"],
                "seconds_to_target": t_time,
                "tokens_to_target": t_tok,
                "loss_at_equal_tokens": leq,
                "final_loss": r["final_loss"],
                "wire_tx_bytes_per_worker": r["wire_tx_bytes_per_worker"],
            }
        base = rows[ref_method]
        for row in rows.values():
            row[key] = {
                "utilisation": _ratio(row["utilisation"], base["utilisation"]),
                "seconds_to_target": _ratio(row["seconds_to_target"], base["seconds_to_target"]),
                "seconds_to_loose_target": _ratio(row["seconds_to_loose_target"], base["seconds_to_loose_target"]),
                "tokens_to_target": _ratio(row["tokens_to_target"], base["tokens_to_target"]),
                "loss_at_equal_tokens": _ratio(row["loss_at_equal_tokens"], base["loss_at_equal_tokens"]),
                "wire_tx_bytes_per_worker": _ratio(row["wire_tx_bytes_per_worker"], base["wire_tx_bytes_per_worker"]),
                "train_seconds": _ratio(row["train_seconds"], base["train_seconds"]),
            }
        table[f"{bw:g}"] = {"reference": ref_method, "target_loss": target, "loose_target_loss": loose,
                            "equal_tokens": tokens_eq, "methods": rows}
    return table


LOOSE = 0.01  # the second target: within 1 % of DiLoCo's final loss


def _curve_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"tokens": c["tokens"], "train_seconds": c["train_seconds"], "eval_loss_mean": c["loss"],
             "eval_loss": c["loss"]} for c in r.get("curve", [])]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def targets(table: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets at 100 Mbit/s for FG-DiLoCo (LowRank, mix2_rounds=1)."""
    t = table.get("100")
    if not t or "fg-lowrank-r2=1" not in t["methods"]:
        return {"evaluated": False}
    fg, dl = t["methods"]["fg-lowrank-r2=1"], t["methods"]["diloco"]
    rel = (fg["loss_at_equal_tokens"] / dl["loss_at_equal_tokens"] - 1) if fg["loss_at_equal_tokens"] else None
    ratio = fg["ratio_to_diloco"]["seconds_to_target"]
    return {
        "evaluated": True,
        "fg_utilisation": fg["utilisation"],
        "fg_utilisation_ge_95pct": fg["utilisation"] is not None and fg["utilisation"] >= 0.95,
        "diloco_utilisation": dl["utilisation"],
        "diloco_utilisation_lower": dl["utilisation"] < fg["utilisation"],
        "fg_loss_rel_diff_at_equal_tokens": rel,
        "fg_loss_within_2pct": rel is not None and rel <= 0.02,
        "fg_seconds_to_diloco_final_loss_ratio": ratio,
        "fg_time_ratio_le_0.8": ratio is not None and ratio <= 0.8,
        "fg_seconds_to_within_1pct_of_diloco_final_loss_ratio": fg["ratio_to_diloco"]["seconds_to_loose_target"],
    }


def _best(methods: dict[str, Any], grid: tuple[str, ...]) -> str | None:
    """The method of ``grid`` (or an outer-optimizer variant of one, :func:`outer_variant`) soonest to the target
    (wall seconds); None when none of them ran or reached it."""
    ran = [m for m in methods if base_method(m) in grid and methods[m]["seconds_to_target"] is not None]
    return min(ran, key=lambda m: methods[m]["seconds_to_target"]) if ran else None


def peer_targets(peers_table: dict[str, Any]) -> dict[str, Any]:
    """The targets against torchft: each side's best setting of its grid (:data:`FG_GRID`, :data:`STREAMING_GRID`:
    the soonest to torchft DiLoCo's final held-out loss). At 100 Mbit/s FG-DiLoCo's best reaches that loss in
    <= 0.8x the seconds of Streaming DiLoCo's best and <= 0.6x torchft DiLoCo's, with a loss at equal tokens no
    worse than Streaming DiLoCo's best, utilisation >= 97 % and <= 0.5x its bytes per worker; at 10 Mbit/s in
    <= 0.4x Streaming DiLoCo's best seconds. A side that never reaches the target has no best; Streaming DiLoCo
    having none counts as met when FG-DiLoCo has one."""
    out: dict[str, Any] = {"evaluated": False}
    for bw, limit in (("100", 0.8), ("10", 0.4)):
        t = peers_table.get(bw)
        if not t or "torchft-diloco" not in t["methods"]:
            continue
        ms = t["methods"]
        fg, st = _best(ms, FG_GRID), _best(ms, STREAMING_GRID)
        if fg is None and not any(base_method(m) in FG_GRID for m in ms):
            continue
        f = ms[fg] if fg else None
        s = ms[st] if st else None
        vs_st = _ratio(f and f["seconds_to_target"], s and s["seconds_to_target"])
        vs_tf = _ratio(f and f["seconds_to_target"], ms["torchft-diloco"]["seconds_to_target"])
        row: dict[str, Any] = {
            "target_loss": t["target_loss"], "fg_best": fg, "streaming_best": st,
            "fg_seconds_to_target": f and f["seconds_to_target"],
            "streaming_seconds_to_target": s and s["seconds_to_target"],
            "torchft_diloco_seconds_to_target": ms["torchft-diloco"]["seconds_to_target"],
            "fg_vs_streaming": vs_st,
            f"fg_vs_streaming_le_{limit:g}": (vs_st is not None and vs_st <= limit) or (f is not None and s is None),
            "fg_vs_torchft_diloco": vs_tf,
        }
        if bw == "100":
            leq_f = f and f["loss_at_equal_tokens"]
            leq_s = s and s["loss_at_equal_tokens"]
            bytes_ratio = _ratio(f and f["wire_tx_bytes_per_worker"], s and s["wire_tx_bytes_per_worker"])
            row.update({
                "fg_vs_torchft_diloco_le_0.6": vs_tf is not None and vs_tf <= 0.6,
                "fg_loss_at_equal_tokens": leq_f, "streaming_loss_at_equal_tokens": leq_s,
                "fg_loss_at_equal_tokens_no_worse": leq_f is not None and (leq_s is None or leq_f <= leq_s),
                "fg_utilisation": f and f["utilisation"],
                "fg_utilisation_ge_0.97": f is not None and f["utilisation"] is not None
                and f["utilisation"] >= 0.97,
                "fg_bytes_vs_streaming": bytes_ratio,
                "fg_bytes_le_0.5": bytes_ratio is not None and bytes_ratio <= 0.5,
                "utilisation": {m: ms[m]["utilisation"] for m in ms
                                if base_method(m) in FG_GRID + STREAMING_GRID + ("torchft-diloco",)},
            })
        out[f"{bw}mbit"] = row
        out["evaluated"] = True
    return out


def seed_summary(tables: dict[int, dict[str, Any]], bw: str = "100") -> dict[str, Any]:
    """The same methods under several seeds (``benchmarks.wan --peers --seeds``): ``tables`` maps a seed to its
    :func:`compare` table against torchft DiLoCo (whose final loss is that seed's target). Per method and per
    measure (held-out loss at equal tokens, seconds to the target and to the loose target (+1 %), training seconds
    for the whole token budget, utilisation): the value of each seed, their mean
    and spread (max - min; None where a seed has no value), and, per pair of an FG-DiLoCo and a Streaming DiLoCo
    setting (:data:`FG_GRID`, :data:`STREAMING_GRID`), the loss difference of each seed (FG minus Streaming,
    relative) and its mean: a difference smaller than the spread is not a difference this job can show.

    Raises:
        ValueError: ``tables`` is empty, or a seed's table has no ``bw`` Mbit/s part.
    """
    if not tables:
        raise ValueError("seed_summary: tables is empty; pass {seed: compare(runs, ..., 'torchft-diloco')}")
    missing = [seed for seed, t in tables.items() if bw not in t]
    if missing:
        raise ValueError(f"seed_summary: the tables of seeds {missing} have no {bw} Mbit/s part")
    seeds = sorted(tables)
    methods = [m for m in tables[seeds[0]][bw]["methods"] if all(m in tables[s][bw]["methods"] for s in seeds)]
    out: dict[str, Any] = {"seeds": seeds, "bandwidth_mbit": bw, "methods": {}, "fg_vs_streaming": {}}
    for m in methods:
        row: dict[str, Any] = {}
        for key in ("loss_at_equal_tokens", "seconds_to_target", "seconds_to_loose_target", "train_seconds",
                    "utilisation"):
            vals = [tables[s][bw]["methods"][m][key] for s in seeds]
            known = [v for v in vals if v is not None]
            full = len(known) == len(vals)
            row[key] = {"per_seed": vals, "mean": statistics.fmean(known) if full else None,
                        "spread": max(known) - min(known) if full else None}
        out["methods"][m] = row
    for f in (m for m in methods if base_method(m) in FG_GRID):
        for st in (m for m in methods if base_method(m) in STREAMING_GRID):
            fl = out["methods"][f]["loss_at_equal_tokens"]["per_seed"]
            sl = out["methods"][st]["loss_at_equal_tokens"]["per_seed"]
            rel = [None if a is None or b is None else a / b - 1 for a, b in zip(fl, sl)]
            out["fg_vs_streaming"][f"{f} vs {st}"] = {
                "relative_loss_difference_per_seed": rel,
                "mean": statistics.fmean(rel) if None not in rel else None,
                "fg_lower_in_seeds": sum(1 for r in rel if r is not None and r <= 0)}
    return out


def dead_worker_cost(rows: list[dict[str, Any]], die_at_step: int, sync_every: int) -> dict[str, Any]:
    """What one dead worker cost a survivor, from that survivor's own rows (one per outer round).

    * ``stall_seconds``: the blocked seconds above normal, summed over the round the worker died in and the
      rounds after it: ``sum(max(0, blocked_k - median(blocked before the death)))``;
    * ``rounds_lost``: outer updates that did not happen (torchft: rounds whose commit failed, so their inner steps
      were discarded and the parameters reset to the round start; FG-DiLoCo never discards a round: 0), and
      ``discarded_seconds``: the inner-compute seconds of those rounds;
    * ``seconds_lost`` = stall + discarded seconds: what the survivors would have gained had the worker left
      cleanly;
    * ``failed_exchanges`` (FG-DiLoCo) and ``participants_after`` (torchft) for the record.

    Raises:
        ValueError: no round before the death (nothing to call normal), or no round after it.
    """
    died_round = -(-die_at_step // sync_every)
    train = [r for r in rows if r["round"] > 0]
    before = [r["blocked_seconds"] for r in train if r["round"] < died_round]
    after = [r for r in train if r["round"] >= died_round]
    if not before or not after:
        raise ValueError(f"need rounds before and after the death (round {died_round}); got rounds "
                         f"{[r['round'] for r in train]}")
    normal = statistics.median(before)
    stall = sum(max(0.0, r["blocked_seconds"] - normal) for r in after)
    lost_rounds: list[int] = []
    discarded = 0.0
    if any("commits" in r for r in train):
        last_normal = max((r for r in train if r["round"] < died_round), key=lambda r: r["round"])
        per_round = max(round(last_normal["commits"] / last_normal["round"]), 1)  # fragment syncs per round
        prev = last_normal["commits"]
        for r in after:
            got = r["commits"] - prev
            if got < per_round:
                lost_rounds.append(r["round"])
                discarded += (per_round - got) / per_round * (r["round_seconds"] - r["blocked_seconds"])
            prev = r["commits"]
    return {
        "died_at_step": die_at_step,
        "died_in_round": died_round,
        "normal_blocked_seconds": normal,
        "stall_seconds": stall,
        "rounds_lost": len(lost_rounds),
        "lost_rounds": lost_rounds,
        "discarded_seconds": discarded,
        "seconds_lost": stall + discarded,
        "blocked_seconds_by_round": {r["round"]: r["blocked_seconds"] for r in train},
        "failed_exchanges": sum(r.get("failed_exchanges") or 0 for r in after),
        "participants_after": [r.get("participants") for r in after] if any("participants" in r for r in after)
        else None,
    }
