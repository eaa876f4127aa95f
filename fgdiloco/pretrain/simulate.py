"""An analytic model of one outer round: utilisation and wall time of DDP, DiLoCo and FG-DiLoCo at any bandwidth,
latency and number of workers M, plus the consensus contraction of the gossip topologies.

Run it as ``fgdiloco simulate`` (writes ``simulate.json`` and ``simulate_*.png`` to a fresh ``runs/simulate``
folder, or ``--out DIR``, and prints the predictions as tables); ``python -m benchmarks.simulate`` in a source
checkout refreshes the committed ``benchmarks/results/``.

Inputs (all measured, none guessed):

* **bytes per mix** from the real codecs and wire frames (:func:`fgdiloco.factor.encode_frame`: 48-byte header +
  zstd body) on the real example GPT of ``benchmarks/wan.py`` (:data:`fgdiloco.pretrain.comparison.JOB`): its
  parameters (Mix1, bf16) and a real pseudo-gradient (``H`` AdamW steps on the bundled corpus; Mix2 with dense
  fp32, bf16, int8 and ``LowRank(rank=4, int8)`` after a few rounds of error feedback);
* **compute seconds per inner step** measured in the ``wan.py`` runs (``--wan``; default
  ``benchmarks/results/wan.json`` of the source checkout when there is one), else timed here on one thread;
* **link efficiency** (TCP/IP payload / wire rate) from the ``netns`` shaping check (0.956 at 1500-byte MTU).

The model of a round of H inner steps on M workers whose links each carry ``bw`` bytes/s each way, with a one-way
message latency ``a``:

* ring all-reduce of S bytes: ``2(M-1)/M · S/bw + 2(M-1)·a`` (reduce-scatter + all-gather, Gloo's ring);
* one pairwise gossip exchange of S bytes (both peers send at once, full duplex): ``S/bw + a + setup``
  (``setup``: fgdiloco builds a private 2-rank Gloo group per exchange, a few store round trips);
* **DDP**: every step blocks on a ring all-reduce of the fp32 gradient (4 bytes/param; overlap with the backward
  pass is ignored: the example model fits in one or two buckets);
* **DiLoCo** (= ``topology="allreduce"``, dense) and **post-local SGD** (``PeriodicModelAverager``): one blocking ring
  all-reduce of 4 bytes/param per round;
* **FG-DiLoCo**: Mix1 (``r1`` pairwise exchanges of the bf16 parameter frame) starts at the round start and hides
  behind the ``H·t`` seconds of compute; Mix2 (``r2`` pairwise exchanges of the codec's frame) blocks. The link is
  shared, so the blocking time is ``max(0, T1 − H·t) + T2``: it does **not** depend on M.

utilisation = ``H·t / (H·t + blocking)``. Not modelled: CPU contention between communication threads and compute,
TCP slow start, Gloo's per-message overheads beyond ``a``.

Consensus: for each pairwise topology (``random``, ``exponential``, ``ring``) the relative disagreement left after
k gossip rounds, ``‖(W_k⋯W_1 − J)x‖ / ‖(I − J)x‖`` averaged over random x, computed two ways: with the real
``mixing_matrix``es (M ≤ 256; also the exact worst case, the spectral norm of ``W_k⋯W_1 − J``) and, for every M up to
1024, by applying the real ``peer()`` schedule to vectors (pairwise averaging is a permutation average, O(M) per
round); both agree where both are computed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Count, Number
from .comparison import JOB

#: The committed results of a source checkout (``python -m benchmarks.simulate`` writes there).
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
DEFAULT_OUT = "runs/simulate"
OUTPUT_NAMES = ("simulate.json", "simulate_utilisation.png", "simulate_consensus.png")
DESCRIPTION = ("Predict compute utilisation and wall time per round of DDP, DiLoCo and FG-DiLoCo from measured codec "
               "bytes on the example GPT, compute time per step, bandwidth, latency and M (up to 1024); simulate "
               "the consensus contraction of the gossip topologies; validate against measured wan.py runs when "
               "given (--wan). Writes simulate.json and two PNGs to --out and prints the predictions as tables.")
LINK_EFFICIENCY = 0.956  # TCP payload / tbf rate at MTU 1500: 1448 / 1514 (netns check measured 0.956-0.960)
PAIR_SETUP_S = 0.003  # a private 2-rank Gloo group per exchange: set up in 1.6-3.4 ms on the 2-core CI machine
METHODS = ("ddp", "diloco", "localsgd", "fgdiloco")


# ---------------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Network:
    """A worker's link: ``bandwidth_mbit`` each way, one-way latency per message, payload efficiency."""

    bandwidth_mbit: float
    latency_s: float = 0.0
    efficiency: float = LINK_EFFICIENCY
    pair_setup_s: float = PAIR_SETUP_S

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes per second (``inf`` for an infinite link)."""
        return self.bandwidth_mbit * 1e6 / 8 * self.efficiency


def transfer_seconds(nbytes: float, net: Network) -> float:
    if math.isinf(net.bytes_per_s):
        return 0.0
    return nbytes / net.bytes_per_s


def ring_allreduce_seconds(nbytes: float, m: int, net: Network) -> float:
    """Ring all-reduce of ``nbytes`` over ``m`` workers: ``2(m-1)/m · nbytes/bw + 2(m-1) · latency``."""
    if m <= 1:
        return 0.0
    return 2 * (m - 1) / m * transfer_seconds(nbytes, net) + 2 * (m - 1) * net.latency_s


def halving_doubling_allreduce_seconds(nbytes: float, m: int, net: Network) -> float:
    """Rabenseifner's all-reduce (recursive halving reduce-scatter + doubling all-gather): the same bandwidth term
    as the ring, ``2·⌈log2 m⌉`` latencies instead of ``2(m-1)``: what large-M collectives use."""
    if m <= 1:
        return 0.0
    return 2 * (m - 1) / m * transfer_seconds(nbytes, net) + 2 * math.ceil(math.log2(m)) * net.latency_s


def allreduce_seconds(nbytes: float, m: int, net: Network, algorithm: str = "ring") -> float:
    if algorithm == "ring":
        return ring_allreduce_seconds(nbytes, m, net)
    if algorithm == "halving_doubling":
        return halving_doubling_allreduce_seconds(nbytes, m, net)
    raise ValueError(f"algorithm must be 'ring' or 'halving_doubling', got {algorithm!r}")


def ring_allreduce_bytes(nbytes: float, m: int) -> float:
    """Bytes each worker sends in a ring all-reduce of ``nbytes``."""
    return 2 * (m - 1) / m * nbytes if m > 1 else 0.0


def pair_exchange_seconds(nbytes: float, net: Network) -> float:
    """One pairwise gossip exchange of ``nbytes`` each way (full duplex), setup included."""
    return transfer_seconds(nbytes, net) + net.latency_s + net.pair_setup_s


@dataclass(frozen=True)
class Workload:
    """What one worker computes and sends.

    Attributes:
        params: trainable parameters N.
        step_seconds: compute seconds of one inner step (forward, backward, optimizer step).
        sync_every: H.
        mix1_bytes: frame bytes of one Mix1 exchange (bf16 parameters).
        mix2_bytes: frame bytes of one Mix2 exchange (the codec's pseudo-gradient frame).
        outer_seconds: the local outer step and bookkeeping per round (blocking, no communication).
        mix2_cpu_seconds: CPU seconds of one Mix2 exchange's codec work (encode own, frame, decode peer's):
            blocking, on the critical path.
    """

    params: int
    step_seconds: float
    sync_every: int
    mix1_bytes: float
    mix2_bytes: float
    outer_seconds: float = 0.0
    mix2_cpu_seconds: float = 0.0

    @property
    def fp32_bytes(self) -> float:
        return 4.0 * self.params


@dataclass(frozen=True)
class Prediction:
    method: str
    m: int
    bandwidth_mbit: float
    round_seconds: float  # wall seconds of H inner steps + synchronisation
    compute_seconds: float
    blocked_seconds: float
    utilisation: float
    bytes_sent_per_round: float  # payload bytes per worker per round
    mix1_hidden: bool | None = None


def predict(method: str, w: Workload, m: int, net: Network, *, mix1_rounds: int | None = None,
            mix2_rounds: int | None = None, allreduce: str = "ring") -> Prediction:
    """Predicted round of ``method`` (``"ddp"``, ``"diloco"``, ``"localsgd"`` or ``"fgdiloco"``); ``allreduce``:
    ``"ring"`` (Gloo's, what the measured runs use) or ``"halving_doubling"`` (log-latency); the gossip rounds
    default to :class:`~fgdiloco.FGDiLoCoConfig`'s."""
    from ..config import FGDiLoCoConfig

    mix1_rounds = FGDiLoCoConfig.mix1_rounds if mix1_rounds is None else mix1_rounds
    mix2_rounds = FGDiLoCoConfig.mix2_rounds if mix2_rounds is None else mix2_rounds
    compute = w.sync_every * w.step_seconds
    hidden = None
    if method == "ddp":
        blocked = w.sync_every * allreduce_seconds(w.fp32_bytes, m, net, allreduce)
        sent = w.sync_every * ring_allreduce_bytes(w.fp32_bytes, m)
    elif method in ("diloco", "localsgd"):
        blocked = allreduce_seconds(w.fp32_bytes, m, net, allreduce) + w.outer_seconds
        sent = ring_allreduce_bytes(w.fp32_bytes, m)
    elif method == "fgdiloco":
        if m <= 1:
            t1 = t2 = 0.0
        else:
            t1 = mix1_rounds * pair_exchange_seconds(w.mix1_bytes, net) if mix1_rounds else 0.0
            t2 = mix2_rounds * (pair_exchange_seconds(w.mix2_bytes, net) + w.mix2_cpu_seconds) if mix2_rounds else 0.0
        late = max(0.0, t1 - compute)
        hidden = late == 0.0
        blocked = late + t2 + w.outer_seconds
        sent = (mix1_rounds * w.mix1_bytes + mix2_rounds * w.mix2_bytes) if m > 1 else 0.0
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    total = compute + blocked
    util = compute / total if total > 0 else 1.0
    return Prediction(method, m, net.bandwidth_mbit, total, compute, blocked, util, sent, hidden)


# ---------------------------------------------------------------------------------------------------- consensus
def perm_for(topology: Any, rnd: int) -> np.ndarray:
    """The gossip round ``rnd`` of ``topology`` as an index array: worker i averages with ``perm[i]``."""
    m = topology.world_size
    perm = np.arange(m)
    for i in range(m):
        j = topology.peer(i, rnd)
        if j is not None:
            perm[i] = j
    return perm


def _period(topology: Any) -> int | None:
    """Rounds after which a deterministic schedule repeats (ring: 2, exponential: ⌈log2 M⌉), checked on the real
    ``peer()``; None for schedules that never repeat (random)."""
    name = getattr(topology, "name", "")
    period = {"ring": 2, "exponential": max(1, getattr(topology, "dims", 1))}.get(name)
    if period is None:
        return None
    for k in range(period):
        if not np.array_equal(perm_for(topology, k), perm_for(topology, k + period)):
            return None
    return period


def contraction_vectors(name: str, m: int, rounds: int, *, trials: int = 16, seed: int = 0,
                        stop_below: float = 0.0) -> list[float]:
    """``‖(W_k⋯W_1 − J)x‖ / ‖(I − J)x‖`` for k = 1..rounds, mean over ``trials`` random x, with the real
    ``peer()`` schedule applied as permutation averaging (O(M) per round: works for any M). Periodic schedules
    (ring, exponential) evaluate ``peer()`` for one period and reuse it. Once the value drops to ``stop_below`` (or
    to exactly 0) the rest of the curve is filled with that last value."""
    from fgdiloco.gossip.topology import make_topology

    topo = make_topology(name, m, seed)
    period = None if topo.exact else _period(topo)
    perms = [perm_for(topo, k) for k in range(period)] if period else None
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, trials))
    x -= x.mean(axis=0, keepdims=True)
    n0 = np.linalg.norm(x, axis=0)
    out = []
    for k in range(rounds):
        if topo.exact:
            x = np.zeros_like(x)
            out.append(0.0)
            continue
        x = 0.5 * (x + x[perms[k % period] if perms else perm_for(topo, k)])
        x_dev = x - x.mean(axis=0, keepdims=True)
        out.append(float(np.mean(np.linalg.norm(x_dev, axis=0) / n0)))
        if out[-1] == 0.0 or out[-1] < stop_below:  # exact average reached, or far below what is asked
            out.extend([out[-1]] * (rounds - k - 1))
            break
    return out


def contraction_matrices(name: str, m: int, rounds: int, *, trials: int = 16, seed: int = 0,
                         worst_at: set[int] | None = None) -> dict[str, list]:
    """Same as :func:`contraction_vectors` with the real ``mixing_matrix``es (``mean``), plus the worst case over
    all x: the spectral norm of ``W_k⋯W_1 − J`` (``worst``; only at the k in ``worst_at`` when given, None
    elsewhere). O(M³) per round: use for M ≤ ~256."""
    from fgdiloco.gossip.topology import make_topology

    topo = make_topology(name, m, seed)
    j = np.full((m, m), 1.0 / m)
    prod = np.eye(m)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, trials))
    x -= x.mean(axis=0, keepdims=True)
    n0 = np.linalg.norm(x, axis=0)
    mean, worst = [], []
    for k in range(rounds):
        w = topo.mixing_matrix(k).numpy()
        prod = w @ prod
        d = prod - j
        mean.append(float(np.mean(np.linalg.norm(d @ x, axis=0) / n0)))
        worst.append(float(np.linalg.norm(d, 2)) if worst_at is None or k + 1 in worst_at else None)
    return {"mean": mean, "worst": worst}


def rounds_to(curve: list[float], eps: float) -> int | None:
    """First k (1-based) with contraction ≤ eps, None if never within the curve."""
    for k, v in enumerate(curve, 1):
        if v <= eps:
            return k
    return None


def consensus_study(ms: list[int], topologies: tuple[str, ...] = ("random", "exponential", "ring"),
                    max_rounds: int = 200000, matrix_max_m: int = 256, eps: float = 0.01,
                    random_seeds: int = 5) -> dict[str, Any]:
    """Contraction against M for each topology (random: mean over ``random_seeds`` schedules), over at most
    ``max_rounds`` gossip rounds but at least log2 M. Ring rounds to ``eps`` beyond ``max_rounds`` are extrapolated
    with the power law through the two largest computed M."""
    out: dict[str, Any] = {"eps": eps, "max_rounds": max_rounds, "matrix_max_m": matrix_max_m,
                           "random_seeds": random_seeds, "by_topology": {}}
    for name in topologies:
        rows = []
        for m in ms:
            t0 = time.perf_counter()
            lg = max(1, math.ceil(math.log2(m)))
            # at least log2 M rounds, whatever max_rounds: the rows report the contraction after log2 M rounds
            kmax = max(lg, max_rounds if name == "ring" else min(max_rounds, 8 * lg + 16))
            seeds = range(random_seeds) if name == "random" else range(1)
            curves = [contraction_vectors(name, m, kmax, seed=sd, trials=8 if name == "ring" else 16,
                                          stop_below=eps * 1e-3) for sd in seeds]
            vec = [float(np.mean(col)) for col in zip(*curves)]
            hits = [rounds_to(c, eps) for c in curves]
            row: dict[str, Any] = {
                "m": m,
                "after_1": vec[0],
                "after_log2m": vec[lg - 1],
                "per_round_rate_log2m": vec[lg - 1] ** (1 / lg),
                "rounds_to_eps": (float(np.mean(hits)) if all(h is not None for h in hits) else None),
                "rounds_computed": kmax,
                "curve_head": vec[:16],
            }
            if m <= matrix_max_m:
                mat = contraction_matrices(name, m, min(kmax, 2 * lg + 2), worst_at={lg})
                row["matrix_after_1"] = mat["mean"][0]
                row["matrix_after_log2m"] = mat["mean"][lg - 1]
                row["worst_after_log2m"] = mat["worst"][lg - 1]
                ref = contraction_vectors(name, m, min(kmax, 2 * lg + 2))
                row["max_abs_diff_matrix_vs_peer"] = float(max(abs(a - b) for a, b in zip(mat["mean"], ref)))
            row["seconds"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
        if name == "ring":
            pts = [(r["m"], r["rounds_to_eps"]) for r in rows if r["rounds_to_eps"]]
            if len(pts) >= 2 and any(r["rounds_to_eps"] is None for r in rows):
                (m1, k1), (m2, k2) = pts[-2], pts[-1]
                a = math.log(k2 / k1) / math.log(m2 / m1)
                out["ring_fit"] = {"exponent": a, "through": [[m1, k1], [m2, k2]]}
                for r in rows:
                    if r["rounds_to_eps"] is None:
                        r["rounds_to_eps_extrapolated"] = k2 * (r["m"] / m2) ** a
        out["by_topology"][name] = rows
    return out


# ---------------------------------------------------------------------------------------------------- measured inputs
def _job() -> dict[str, Any]:
    return dict(JOB)


def measure_codec_bytes(job: dict[str, Any], ef_rounds: int = 3) -> dict[str, Any]:
    """Frame bytes of every codec on the real GPT of ``job`` (``benchmarks/wan.py``'s JOB): Mix1 = bf16 frame of
    the parameters, Mix2 = each codec's frame of real pseudo-gradients (``H`` AdamW steps on the bundled corpus per
    round, ``ef_rounds`` rounds so error feedback and warm starts are in their steady state; the last round's
    frame is reported, the mean too)."""
    import torch

    from fgdiloco.factor import BF16, Dense, Int8, LowRank, decode_frame, encode_frame, layout_fingerprint
    from fgdiloco.pretrain.data import build_tokenizer, cache_dir_for, encode_corpus, load_text, sample_batch
    from fgdiloco.pretrain.model import GPT, GPTConfig

    torch.set_num_threads(1)
    text = load_text(None)
    cache = cache_dir_for(None)
    tok = build_tokenizer(text, "bpe", job["vocab_size"], cache_dir=cache)
    tokens = encode_corpus(text, tok, cache_dir=cache)
    torch.manual_seed(job.get("seed", 0))
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=job["block_size"], n_layer=job["n_layer"],
                          n_head=job["n_head"], n_embd=job["n_embd"]))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    fp = layout_fingerprint((n, p.shape, p.dtype) for n, p in named)
    opt = torch.optim.AdamW(params, lr=job["lr"], betas=(0.9, 0.95), weight_decay=job.get("weight_decay", 0.1))
    gen = torch.Generator().manual_seed(1)
    codecs = {"dense": Dense(), "bf16": BF16(), "int8": Int8(), "lowrank_r4_int8": LowRank(rank=4)}
    sizes: dict[str, list[int]] = {k: [] for k in codecs}
    cpu: dict[str, list[float]] = {k: [] for k in codecs}
    mix1: list[int] = []
    raw: dict[str, int] = {}
    step_times = []
    for r in range(ef_rounds):
        anchor = [p.detach().clone() for p in params]
        for _ in range(job["sync_every"]):
            x, y = sample_batch(tokens, job["batch_size"], job["block_size"], gen)
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - t0)
        delta = [a - p.detach() for a, p in zip(anchor, params)]
        for name, c in codecs.items():
            t0 = time.perf_counter()
            body, _ = c.encode(delta, stateful=True)
            frame = encode_frame(c, body, sender=0, round=r, fingerprint=fp, shuffle=c.shuffle)
            decode_frame(frame, c, delta, fingerprint=fp, sender=0, round=r)
            cpu[name].append(time.perf_counter() - t0)
            sizes[name].append(len(frame))
            raw[name] = len(body)
        bf = BF16()
        body, _ = bf.encode([a.detach() for a in anchor])
        mix1.append(len(encode_frame(bf, body, sender=0, round=r, fingerprint=fp, shuffle=bf.shuffle)))
    n = sum(p.numel() for p in params)
    return {
        "params": n,
        "vocab_size": tok.vocab_size,
        "fp32_bytes": 4 * n,
        "mix1_bf16_frame_bytes": mix1[-1],
        "mix1_bf16_frame_bytes_mean": statistics.mean(mix1),
        "mix2_frame_bytes": {k: v[-1] for k, v in sizes.items()},
        "mix2_frame_bytes_mean": {k: statistics.mean(v) for k, v in sizes.items()},
        "mix2_body_bytes": raw,
        "compression_vs_fp32": {k: round(4 * n / v[-1], 2) for k, v in sizes.items()},
        "mix2_cpu_seconds_1thread": {k: statistics.median(v) for k, v in cpu.items()},
        "ef_rounds": ef_rounds,
        "step_seconds_1thread_median": statistics.median(step_times),
    }


def load_wan(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def codec_key(codec: str) -> str:
    """simulate.py's name of a wan.py run's Mix2 codec."""
    return "lowrank_r4_int8" if codec.startswith("lowrank") else codec


def workload_for(cb: dict[str, Any], codec: str, step_seconds: float, sync_every: int,
                 outer_seconds: float = 0.0) -> Workload:
    """The Workload of the measured GPT with Mix2 codec ``codec``. The codec's CPU seconds (timed on one thread)
    are scaled by the same slow-down as the compute (``step_seconds`` / one-thread step time): both run on the
    same oversubscribed cores."""
    key = codec_key(codec)
    slowdown = step_seconds / cb["step_seconds_1thread_median"]
    return Workload(params=cb["params"], step_seconds=step_seconds, sync_every=sync_every,
                    mix1_bytes=cb["mix1_bf16_frame_bytes"], mix2_bytes=cb["mix2_frame_bytes"][key],
                    outer_seconds=outer_seconds, mix2_cpu_seconds=cb["mix2_cpu_seconds_1thread"][key] * slowdown)


def validate(wan: dict[str, Any], codec_bytes: dict[str, Any], latency_s: float) -> list[dict[str, Any]]:
    """Predict every measured wan.py run from its own measured compute per step and the codec bytes; return the
    errors (percentage points of utilisation; relative error of round seconds and bytes)."""
    out = []
    for run in wan.get("runs", []):
        if run.get("error") or not run.get("step_seconds_compute"):
            continue
        fam = run["family"]
        w = workload_for(codec_bytes, run.get("codec", "dense"), run["step_seconds_compute"], run["sync_every"],
                         run.get("outer_seconds") or 0.0)
        net = Network(run["bandwidth_mbit"], latency_s=latency_s)
        p = predict(fam, w, wan["workers"], net, mix1_rounds=run.get("mix1_rounds", 1),
                    mix2_rounds=run.get("mix2_rounds", 1))
        meas_util = run["utilisation"]
        meas_round = run["round_seconds"]
        meas_bytes = run.get("wire_tx_bytes_per_round")
        pred_wire = p.bytes_sent_per_round / LINK_EFFICIENCY
        out.append({
            "method": run["method"],
            "bandwidth_mbit": run["bandwidth_mbit"],
            "predicted_utilisation": round(p.utilisation, 4),
            "measured_utilisation": round(meas_util, 4),
            "utilisation_error_pp": round(100 * (p.utilisation - meas_util), 2),
            "predicted_round_seconds": round(p.round_seconds, 4),
            "measured_round_seconds": round(meas_round, 4),
            "round_seconds_rel_error": round(p.round_seconds / meas_round - 1, 4),
            "predicted_wire_bytes_per_round": round(pred_wire),
            "measured_wire_bytes_per_round": meas_bytes,
            "bytes_rel_error": round(pred_wire / meas_bytes - 1, 4) if meas_bytes else None,
            "_blocked": (p.round_seconds - p.compute_seconds, meas_round * (1 - meas_util), p.compute_seconds,
                         _syncs_per_round(run)),
        })
    return _calibrate(out)


def _syncs_per_round(run: dict[str, Any]) -> int:
    """Blocking synchronisation points per round: DDP one per step, DiLoCo / local SGD one, FG-DiLoCo one per
    Mix2 round (none with mix2_rounds=0)."""
    if run["family"] == "ddp":
        return run["sync_every"]
    if run["family"] == "fgdiloco":
        return run.get("mix2_rounds", 1)
    return 1


def _calibrate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Second prediction with one measured constant per method: the blocking seconds per synchronisation point
    that the link model does not explain (arrival skew of workers sharing 2 cores, thread hand-offs, group
    set-up), fitted on the method's run at the highest bandwidth (where transfers are negligible) and applied to
    the other bandwidths. Rows at the fitting bandwidth are marked ``calibration_run``."""
    top = max((r["bandwidth_mbit"] for r in rows), default=None)
    fitted = {}
    for r in rows:
        pred_b, meas_b, _, n = r["_blocked"]
        if r["bandwidth_mbit"] == top and n:
            fitted[r["method"]] = max(meas_b - pred_b, 0.0) / n
    for r in rows:
        pred_b, meas_b, compute, n = r.pop("_blocked")
        extra = fitted.get(r["method"], 0.0) * n
        util = compute / (compute + pred_b + extra)
        r["sync_overhead_fitted_s"] = round(fitted.get(r["method"], 0.0), 4)
        r["calibration_run"] = r["bandwidth_mbit"] == top
        r["calibrated_utilisation"] = round(util, 4)
        r["calibrated_utilisation_error_pp"] = round(100 * (util - r["measured_utilisation"]), 2)
        r["calibrated_round_seconds"] = round(compute + pred_b + extra, 4)
        r["calibrated_round_seconds_rel_error"] = round((compute + pred_b + extra) / r["measured_round_seconds"] - 1, 4)
    return rows


# ---------------------------------------------------------------------------------------------------- charts
FG_VARIANTS = {
    "FG-DiLoCo LowRank r2=1": ("fgdiloco", 1, 1, "lowrank_r4_int8"),
    "FG-DiLoCo dense r2=1": ("fgdiloco", 1, 1, "dense"),
    "FG-DiLoCo r2=0": ("fgdiloco", 1, 0, "dense"),
}


def sweep(workload: Workload, codec_bytes: dict[str, Any], *, bandwidths: list[float], ms: list[int],
          m_fixed: int, bw_fixed: float, latency_s: float) -> dict[str, Any]:
    def lines(m: int, bw: float) -> dict[str, Prediction]:
        net = Network(bw, latency_s=latency_s)
        res = {"DDP": predict("ddp", workload, m, net), "DiLoCo": predict("diloco", workload, m, net),
               "DiLoCo (halving-doubling)": predict("diloco", workload, m, net, allreduce="halving_doubling")}
        for label, (fam, r1, r2, codec) in FG_VARIANTS.items():
            w = workload_for(codec_bytes, codec, workload.step_seconds, workload.sync_every, workload.outer_seconds)
            res[label] = predict(fam, w, m, net, mix1_rounds=r1, mix2_rounds=r2)
        return res

    by_bw = {bw: lines(m_fixed, bw) for bw in bandwidths}
    by_m = {m: lines(m, bw_fixed) for m in ms}
    labels = list(next(iter(by_bw.values())))
    return {
        "m_fixed": m_fixed,
        "bandwidth_fixed_mbit": bw_fixed,
        "latency_s": latency_s,
        "utilisation_vs_bandwidth": {lab: [[bw, by_bw[bw][lab].utilisation] for bw in bandwidths] for lab in labels},
        "utilisation_vs_m": {lab: [[m, by_m[m][lab].utilisation] for m in ms] for lab in labels},
        "blocked_seconds_vs_m": {lab: [[m, by_m[m][lab].blocked_seconds] for m in ms] for lab in labels},
        "round_seconds_vs_bandwidth": {lab: [[bw, by_bw[bw][lab].round_seconds] for bw in bandwidths]
                                       for lab in labels},
    }


def plot(sw: dict[str, Any], cons: dict[str, Any], measured: list[dict[str, Any]] | None, out: Path) -> list[str]:
    """``simulate_utilisation.png`` (utilisation against bandwidth and against M, measured runs as dots) and
    ``simulate_consensus.png`` (the topologies' contraction) in ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    _plot_utilisation(axes, sw, measured)
    fig.tight_layout()
    paths = [str(out / "simulate_utilisation.png")]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    _plot_consensus(axes, cons)
    fig.tight_layout()
    paths.append(str(out / "simulate_consensus.png"))
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


_STYLES = {"DDP": ("C3", "-"), "DiLoCo": ("C0", "-"), "DiLoCo (halving-doubling)": ("C0", "-."),
           "FG-DiLoCo LowRank r2=1": ("C2", "-"), "FG-DiLoCo dense r2=1": ("C1", "--"),
           "FG-DiLoCo r2=0": ("C4", ":")}


def _plot_utilisation(axes: Any, sw: dict[str, Any], measured: list[dict[str, Any]] | None) -> None:
    ax = axes[0]
    for lab, pts in sw["utilisation_vs_bandwidth"].items():
        c, ls = _STYLES.get(lab, ("k", "-"))
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], ls, color=c, label=lab)
    _plot_measured(ax, measured or [])
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth per worker (Mbit/s)")
    ax.set_ylabel("compute utilisation (%)")
    ax.set_title(f"M = {sw['m_fixed']} (lines: model; dots: wan.py, measured)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    for lab, pts in sw["utilisation_vs_m"].items():
        c, ls = _STYLES.get(lab, ("k", "-"))
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], ls, color=c, label=lab)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers M")
    ax.set_ylabel("compute utilisation (%)")
    ax.set_title(f"{sw['bandwidth_fixed_mbit']:g} Mbit/s, latency {1e3 * sw['latency_s']:g} ms per message",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _plot_measured(ax: Any, measured: list[dict[str, Any]]) -> None:
    mk = {"ddp": ("DDP", "C3"), "diloco": ("DiLoCo", "C0"), "localsgd": ("local SGD", "C5")}
    seen = set()
    for r in measured:
        fam = r["family"]
        if fam == "fgdiloco":
            lab = ("FG LowRank" if r["codec"].startswith("lowrank") else "FG dense") + f" r2={r['mix2_rounds']}"
            col = {"FG LowRank r2=1": "C2", "FG dense r2=1": "C1"}.get(lab, "C4")
        else:
            lab, col = mk[fam]
        ax.scatter([r["bandwidth_mbit"]], [100 * r["utilisation"]], color=col, marker="o", s=22,
                   edgecolor="k", lw=0.5, zorder=5, label=None if lab in seen else f"measured: {lab}")
        seen.add(lab)


def _plot_consensus(axes: Any, cons: dict[str, Any]) -> None:
    cols = {"random": "C0", "exponential": "C2", "ring": "C3"}
    for name, rows in cons["by_topology"].items():
        ms = [r["m"] for r in rows]
        axes[0].plot(ms, [r["per_round_rate_log2m"] for r in rows], "o-", ms=3, color=cols[name], label=name)
        axes[1].plot(ms, [r["rounds_to_eps"] or float("nan") for r in rows], "o-", ms=3, color=cols[name],
                     label=name)
        ext = [(r["m"], r["rounds_to_eps_extrapolated"]) for r in rows if r.get("rounds_to_eps_extrapolated")]
        if ext:
            axes[1].plot([e[0] for e in ext], [e[1] for e in ext], "x--", ms=5, color=cols[name],
                         label=f"{name}: extrapolated ∝ M^{cons.get('ring_fit', {}).get('exponent', 0):.2f}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("workers M")
    axes[0].set_ylabel("per-round contraction over ⌈log2 M⌉ rounds")
    axes[0].set_title("(‖(W_k…W_1 − J)x‖/‖(I−J)x‖)^(1/k), k = ⌈log2 M⌉ (0 = exact average)", fontsize=9)
    axes[0].grid(alpha=0.3)
    axes[0].legend()
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("workers M")
    axes[1].set_ylabel(f"gossip rounds to {cons['eps']:g} relative disagreement")
    axes[1].set_title(f"computed up to {cons['max_rounds']} rounds (random: mean of {cons['random_seeds']} schedules)",
                      fontsize=9)
    axes[1].grid(alpha=0.3)
    axes[1].legend()


# ---------------------------------------------------------------------------------------------------- main
def summarise_validation(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {}
    util = [abs(r["utilisation_error_pp"]) for r in rows]
    rnd = [abs(r["round_seconds_rel_error"]) for r in rows]
    byt = [abs(r["bytes_rel_error"]) for r in rows if r["bytes_rel_error"] is not None]
    held = [r for r in rows if not r["calibration_run"]]
    cal = {}
    if held:
        cu = [abs(r["calibrated_utilisation_error_pp"]) for r in held]
        cr = [abs(r["calibrated_round_seconds_rel_error"]) for r in held]
        cal = {"calibrated_runs_validated": len(held),
               "calibrated_utilisation_abs_error_pp_mean": round(statistics.mean(cu), 2),
               "calibrated_utilisation_abs_error_pp_max": round(max(cu), 2),
               "calibrated_round_seconds_abs_rel_error_mean": round(statistics.mean(cr), 4),
               "calibrated_round_seconds_abs_rel_error_max": round(max(cr), 4)}
    return {**cal, "runs": len(rows), "utilisation_abs_error_pp_mean": round(statistics.mean(util), 2),
            "utilisation_abs_error_pp_max": round(max(util), 2),
            "round_seconds_abs_rel_error_mean": round(statistics.mean(rnd), 4),
            "round_seconds_abs_rel_error_max": round(max(rnd), 4),
            "bytes_abs_rel_error_mean": round(statistics.mean(byt), 4) if byt else None,
            "bytes_abs_rel_error_max": round(max(byt), 4) if byt else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    job = _job()
    print("[simulate] measuring codec frame bytes on the real GPT ...", flush=True)
    cb = measure_codec_bytes(job)
    print(f"[simulate] {cb['params']} params; Mix1 bf16 frame {cb['mix1_bf16_frame_bytes']} B; Mix2 frames "
          + ", ".join(f"{k} {v} B" for k, v in cb["mix2_frame_bytes"].items()), flush=True)
    out = Path(args.out)
    wan_path = Path(args.wan) if args.wan else RESULTS / "wan.json"
    wan = load_wan(wan_path)
    measured_runs = [r for r in (wan or {}).get("runs", []) if not r.get("error") and r.get("step_seconds_compute")]
    if measured_runs:
        step = statistics.median(r["step_seconds_compute"] for r in measured_runs)
        outer = statistics.median(r.get("outer_seconds") or 0.0 for r in measured_runs
                                  if r["family"] == "fgdiloco") if any(
            r["family"] == "fgdiloco" for r in measured_runs) else 0.0
        step_src = f"median compute seconds per step of the {len(measured_runs)} wan.py runs ({wan_path.name})"
    else:
        step = cb["step_seconds_1thread_median"] * args.oversubscription
        outer = 0.0
        step_src = (f"timed here on one thread x {args.oversubscription} (oversubscription of 4 workers on 2 cores); "
                    "no wan.json yet")
    w = workload_for(cb, "lowrank", step, job["sync_every"], outer)
    bandwidths = [float(x) for x in np.geomspace(1, 10000, 41)]
    ms = [2 ** k for k in range(1, 11)]
    sw = sweep(w, cb, bandwidths=bandwidths, ms=ms, m_fixed=job.get("workers", 4), bw_fixed=args.bandwidth,
               latency_s=args.latency_ms / 1e3)
    print("[simulate] consensus contraction of the topologies ...", flush=True)
    cons_ms = [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    if args.quick:
        cons_ms = [2, 4, 8, 16, 32, 64, 128, 256, 1024]
    cons = consensus_study(cons_ms, max_rounds=args.max_rounds)
    validation = validate(wan, cb, latency_s=args.validate_latency_ms / 1e3) if wan else []
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(sw, cons, measured_runs, out)
    table = {}
    for bw in (10.0, 100.0, 1000.0):
        net = Network(bw, latency_s=args.latency_ms / 1e3)
        for m in (4, 64, 1024):
            for lab, (fam, r1, r2, codec) in {"DDP": ("ddp", 1, 1, "dense"), "DiLoCo": ("diloco", 1, 1, "dense"),
                                              **FG_VARIANTS}.items():
                wl = workload_for(cb, codec, w.step_seconds, w.sync_every, w.outer_seconds)
                p = predict(fam, wl, m, net, mix1_rounds=r1, mix2_rounds=r2)
                table[f"{lab} | {bw:g} Mbit/s | M={m}"] = {"utilisation": round(p.utilisation, 4),
                                                           "round_seconds": round(p.round_seconds, 4),
                                                           "blocked_seconds": round(p.blocked_seconds, 4)}
    result = {
        "benchmark": "simulate",
        "command": "fgdiloco simulate" + (" --quick" if args.quick else "") + f" --out {out}",
        "model": ("ring all-reduce 2(M-1)/M*S/bw + 2(M-1)*latency; pair exchange S/bw + latency + setup; "
                  "FG blocking = max(0, T_mix1 - H*t) + T_mix2 (independent of M); utilisation = H*t/(H*t+blocking)"),
        "job": job,
        "codec_bytes": cb,
        "workload": asdict(w),
        "step_seconds_source": step_src,
        "link_efficiency": LINK_EFFICIENCY,
        "pair_setup_s": PAIR_SETUP_S,
        "latency_ms_for_charts": args.latency_ms,
        "latency_ms_for_validation": args.validate_latency_ms,
        "sweep": sw,
        "table": table,
        "consensus": cons,
        "validation": validation,
        "validation_summary": summarise_validation(validation),
        "validation_source": str(wan_path) if wan else None,
        "plots": pngs,
        "seconds": round(time.perf_counter() - t0, 1),
        "platform": {"python": platform.python_version(), "machine": platform.machine(),
                     "cpus": os.cpu_count()},
    }
    result["json"] = str(out / "simulate.json")
    (out / "simulate.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_report(res: dict[str, Any]) -> None:
    """The predictions as tables (rich): utilisation per method, bandwidth and M; gossip rounds to consensus;
    the validation against measured runs when there were any."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    w = res["workload"]
    console.print(f"[simulate] compute per step {w['step_seconds'] * 1e3:.1f} ms ({res['step_seconds_source']}), "
                  f"H = {w['sync_every']}, {w['params']:,} parameters", markup=False)
    methods = list(dict.fromkeys(k.split(" | ")[0] for k in res["table"]))
    cols = list(dict.fromkeys(tuple(k.split(" | ")[1:]) for k in res["table"]))
    t = Table(title=f"predicted compute utilisation (%), latency {res['latency_ms_for_charts']:g} ms per message",
              title_justify="left")
    t.add_column("method")
    for bw, m in cols:
        t.add_column(f"{bw}\n{m}", justify="right")
    for lab in methods:
        t.add_row(lab, *(f"{100 * res['table'][f'{lab} | {bw} | {m}']['utilisation']:.1f}" for bw, m in cols))
    console.print(t)
    cons = res["consensus"]
    ms = [8, 64, 256, 1024]
    t = Table(title=f"gossip rounds to {cons['eps']:g} relative disagreement", caption="~: extrapolated",
              title_justify="left", caption_justify="left")
    t.add_column("topology")
    for m in ms:
        t.add_column(f"M = {m}", justify="right")
    for name, rows in cons["by_topology"].items():
        by_m = {r["m"]: r for r in rows}
        cells = []
        for m in ms:
            r = by_m.get(m)
            if r is None:
                cells.append("-")
            elif r["rounds_to_eps"]:
                cells.append(f"{r['rounds_to_eps']:g}")
            else:
                cells.append(f"~{r.get('rounds_to_eps_extrapolated') or float('nan'):.0f}")
        t.add_row(name, *cells)
    console.print(t)
    if res["validation"]:
        t = Table(title=f"validation against measured runs ({res['validation_source']})", title_justify="left")
        for c in ("method", "Mbit/s", "util pred %", "util meas %", "err pp", "round pred s", "round meas s"):
            t.add_column(c, justify="left" if c == "method" else "right")
        for r in res["validation"]:
            t.add_row(r["method"], f"{r['bandwidth_mbit']:g}", f"{100 * r['predicted_utilisation']:.1f}",
                      f"{100 * r['measured_utilisation']:.1f}", f"{r['utilisation_error_pp']:+.1f}",
                      f"{r['predicted_round_seconds']:.2f}", f"{r['measured_round_seconds']:.2f}")
        console.print(t)
    else:
        console.print("[simulate] no measured runs to validate against (--wan PATH: a wan.json of "
                      "python -m benchmarks.wan)", markup=False)
    console.print(f"[simulate] wrote {res['json']} and {', '.join(res['plots'])}", markup=False)


def add_arguments(p: argparse.ArgumentParser, default_out: str | None = None) -> None:
    """The options of ``fgdiloco simulate`` (``default_out`` None: a fresh ``runs/simulate`` folder)."""
    p.add_argument("--quick", action="store_true", help="fewer M in the consensus study%(default).0s")
    positive, at_least_0 = Number(0.0).parse_in_range, Number(0.0, low_ok=True).parse_in_range
    p.add_argument("--bandwidth", type=positive, default=100.0, help="Mbit/s for the utilisation-vs-M chart")
    p.add_argument("--latency-ms", type=at_least_0, default=1.0, help="one-way latency per message for the charts")
    p.add_argument("--validate-latency-ms", type=at_least_0, default=0.05,
                   help="latency used to predict the wan.py runs (namespaces on one machine: ~0.02 ms measured)")
    p.add_argument("--oversubscription", type=positive, default=2.0,
                   help="compute slow-down factor applied to the one-thread step time when no wan.json exists")
    p.add_argument("--max-rounds", type=Count(1).parse_in_range, default=200000,
                   help="gossip rounds simulated for the ring (the other topologies: at most this many; "
                        "every topology: at least log2 M, the rounds the tables report)")
    p.add_argument("--wan", default=None, metavar="PATH",
                   help="measured runs to validate against (default: benchmarks/results/wan.json of a source "
                        "checkout, when there is one)%(default).0s")
    fresh = f"{DEFAULT_OUT}, or a fresh {DEFAULT_OUT}-2, ... when it holds earlier results"
    p.add_argument("--out", default=default_out, metavar="DIR",
                   help=f"output folder (default: {default_out or fresh})%(default).0s")
    p.add_argument("--overwrite", action="store_true", help="replace earlier results in --out%(default).0s")
