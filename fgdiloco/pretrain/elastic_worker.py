"""One worker of an elastic ``fgdiloco pretrain`` job: its own single-process ``torchrun`` job (docs/faults.md).

    python -m torch.distributed.run --standalone --nproc-per-node=1 --max-restarts=N \\
        -m fgdiloco.pretrain.elastic_worker OUT/config.json

:func:`fgdiloco.pretrain.launcher.launch` starts one per worker slot, with the gossip store's address and the slot
in the environment (:mod:`fgdiloco.elastic`). The worker runs no collective over all workers: it loads the
token ids from the cache the launcher's preflight filled, trains with ``FGDiLoCo(..., elastic=True)``, and writes
what it measures to its own file, ``<out>/workers/worker<k>.jsonl`` (one JSON object a line, :data:`EVENTS`); the
launcher merges the workers' files into ``metrics.jsonl``, ``summary.json`` and ``loss.png``.

Restarts: every ``checkpoint_every`` rounds (and after the last) the worker saves ``<out>/checkpoints/worker<k>.pt``
atomically (temporary file, then ``os.replace``: a worker killed mid-write keeps its previous one): the wrapper's
state dict (parameters, outer momentum, inner AdamW state, round), the batch generator and its clocks. A restarted
worker (torchrun's ``TORCHELASTIC_RESTART_COUNT`` > 0, or ``fgdiloco pretrain --resume``) loads it, or starts from
the seeded initial model when it has none, and rejoins the job (:meth:`fgdiloco.FGDiLoCo.rejoin`);
its step and learning rate follow the round it is in (``round * sync_every`` + steps done in the round). A restart
costs no one a gossip deadline: exchange keys name each side's incarnation, and an exchange whose peer has already
started a later round is skipped at once (:mod:`fgdiloco.elastic`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .data import sample_batch, split_tokens, unigram_loss
from .model import GPT, GPTConfig
from .recipe import clip_gradients, held_out_loss, inner_optimizer, net_bytes, next_batch, peak_rss_bytes
from .worker import TrainConfig, batch_seed, load_tokens, make_codec, run_info

__all__ = ["CHECKPOINT_FORMAT", "EVENTS", "checkpoint_path", "main", "rows_path", "stop_path", "train_elastic"]

#: The round every worker of a resumed job starts at (the newest of their checkpoints; set by the launcher):
#: workers whose checkpoints are of different rounds would otherwise each wait a whole timeout for the others.
START_ROUND_ENV = "FGDILOCO_PRETRAIN_START_ROUND"

#: Version of the checkpoint files this module writes.
CHECKPOINT_FORMAT = 1

#: The lines of ``<out>/workers/worker<k>.jsonl``, by their ``"event"`` field.
EVENTS: dict[str, str] = {
    "start": "a process took the slot: worker, life (torchrun's restart count), pid, time (unix s), info (what "
             "run.json holds), resumed_round (the round of the checkpoint it loaded; None: the seeded init)",
    "row": "an evaluation point: round, step, eval_loss, train_loss, utilisation, bytes_sent, failed_exchanges, "
           "skipped_exchanges, consensus_distance, mix timings, rejoins (this worker's, all lives), "
           "peak_rss_bytes, wall_seconds and train_seconds (the worker's clocks, continued from its checkpoint), "
           "time (unix s)",
    "rejoin": "the worker joined the job's live round: round (joined), from_round (where it was), step, life, "
              "time (unix s)",
    "end": "the worker finished (or stopped at --max-seconds): round, step, clocks, peak_rss_bytes, rejoins",
}


def rows_path(out: str | os.PathLike[str], worker: int) -> Path:
    """``<out>/workers/worker<k>.jsonl``: what worker ``k`` reports (every life appends)."""
    return Path(out) / "workers" / f"worker{worker}.jsonl"


def checkpoint_path(out: str | os.PathLike[str], worker: int) -> Path:
    """``<out>/checkpoints/worker<k>.pt``: worker ``k``'s newest complete checkpoint."""
    return Path(out) / "checkpoints" / f"worker{worker}.pt"


def stop_path(out: str | os.PathLike[str]) -> Path:
    """``<out>/workers/stop``: written by the first worker past ``max_seconds``; every worker stops at its next
    evaluation point once it is there (the workers share no collective to agree on it)."""
    return Path(out) / "workers" / "stop"


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a worker killed mid-write keeps its previous checkpoint


def train_elastic(cfg: TrainConfig) -> dict[str, Any]:
    """Run this process's worker slot of the elastic job described by ``cfg`` (slot, store and slots from the
    environment: :func:`fgdiloco.elastic.settings`); returns the worker's ``end`` event.

    Raises:
        ValueError: ``cfg`` is not an elastic configuration (:attr:`TrainConfig.elastic`) or is invalid.
    """
    from ..elastic import WORKER_ENV, settings
    from ..outer import FGDiLoCo

    cfg.validate()
    if not cfg.elastic:
        raise ValueError("train_elastic runs FG-DiLoCo with stages=1 and a gossip topology only "
                         f"(baseline={cfg.baseline!r}, stages={cfg.stages}, topology={cfg.topology!r})")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    t_setup = time.perf_counter()
    slot = int(settings()["worker"]) if os.environ.get(WORKER_ENV) is not None else 0
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(cfg.out)
    rows_file = rows_path(out, slot)
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    sink = open(rows_file, "a", encoding="utf-8")  # noqa: SIM115 - closed in the finally below

    def emit(event: str, **fields: Any) -> dict[str, Any]:
        line = {"event": event, "worker": slot, "life": life, "time": time.time(), **fields}
        sink.write(json.dumps(line) + "\n")
        sink.flush()
        return line

    try:
        tokens, vocab, found = load_tokens(cfg)
        train, val = split_tokens(tokens, cfg.val_fraction)
        unigram = unigram_loss(train, val, vocab)
        torch.manual_seed(cfg.seed)  # the same initial model on every worker: an elastic job has no broadcast
        model = GPT(GPTConfig(vocab_size=vocab, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                              n_embd=cfg.n_embd, dropout=cfg.dropout), subspace_rank=cfg.subspace_rank)
        n_params = model.num_parameters(non_embedding=False)
        inner = inner_optimizer(model, cfg)
        eval_gen = torch.Generator().manual_seed(cfg.seed + 7919)
        eval_set = [sample_batch(val, cfg.batch_size, cfg.block_size, eval_gen) for _ in range(cfg.eval_batches)]
        batch_gen = torch.Generator().manual_seed(batch_seed(cfg, slot))
        opt = FGDiLoCo(model, inner, sync_every=cfg.sync_every, outer_lr=cfg.outer_lr,
                       outer_momentum=cfg.outer_momentum, topology=cfg.topology, mix1_rounds=cfg.mix1_rounds,
                       mix2_rounds=cfg.mix2_rounds, codec=make_codec(cfg), timeout=cfg.timeout, seed=cfg.seed,
                       elastic=True)
        world = opt.world_size
        # the worker's clocks (wall and evaluation seconds since training started) and its rejoins, over all lives
        base_wall = base_eval = 0.0
        rejoins_total = 0
        resumed_round = None
        ckpt = checkpoint_path(out, slot)
        if ckpt.is_file():
            state = torch.load(ckpt, map_location="cpu", weights_only=False)
            if state.get("run_id") != cfg.run_id or state.get("worker") != slot:
                raise ValueError(f"{ckpt} belongs to run {state.get('run_id')!r} worker {state.get('worker')!r}, "
                                 f"not run {cfg.run_id!r} worker {slot}")
            saved = state["fgdiloco"]
            start = int(os.environ.get(START_ROUND_ENV, "0") or 0)
            if life == 0 and start > saved["round"]:  # a resumed job: where the newest checkpoint is
                saved = {**saved, "round": start}  # a round boundary: parameters are the anchor (as rejoin does)
            opt.load_state_dict(saved)
            batch_gen.set_state(state["batches"])
            base_wall, base_eval = float(state["wall_seconds"]), float(state["eval_seconds"])
            rejoins_total = int(state["rejoins"])
            resumed_round = int(state["round"])
            print(f"[fgdiloco] worker {slot} (life {life}): continuing from {ckpt} of round {resumed_round}",
                  flush=True)
        info = run_info(
            cfg, method="fgdiloco", elastic=True, workers=world, replicas=world,
            tokens_per_step=cfg.batch_size * cfg.block_size * world, params=n_params, vocab_size=vocab, train=train,
            val=val, unigram=unigram, cache_dir=found["cache_dir"], setup_seconds=time.perf_counter() - t_setup,
            title=(f"Factored Gossip DiLoCo (elastic): {world} workers, {cfg.steps} steps, H={cfg.sync_every}, "
                   f"{cfg.topology}, codec {cfg.codec}, {n_params / 1e6:.2f}M params"))
        emit("start", pid=os.getpid(), info=info, resumed_round=resumed_round)

        def rejoined(frm: int) -> None:
            nonlocal rejoins_total
            rejoins_total += 1
            emit("rejoin", round=opt.round, from_round=frm, step=min(opt.round * cfg.sync_every, cfg.steps))
            print(f"[fgdiloco] worker {slot} (life {life}): rejoined the job at round {opt.round} (was at round "
                  f"{frm})", flush=True)

        frm = resumed_round if resumed_round is not None else opt.round
        opt.rejoin()  # a restarted or resumed worker joins the job's live round (at the start: nobody is ahead)
        if opt.round != frm:
            rejoined(frm)
        t_life = time.perf_counter()
        eval_life = 0.0
        net0 = net_bytes() if cfg.net_counters else (0.0, 0.0)
        stop = False
        stop_file = stop_path(out)

        def clocks() -> tuple[float, float]:
            wall = base_wall + time.perf_counter() - t_life
            return wall, wall - base_eval - eval_life

        def record(step: int, rnd: int, train_loss: float | None, stats: dict[str, Any] | None) -> None:
            nonlocal eval_life, stop
            with opt.paused():  # evaluation is not training time
                t0 = time.perf_counter()
                wall, train_s = clocks()
                over = cfg.max_seconds is not None and train_s >= cfg.max_seconds
                loss = held_out_loss(model, eval_set)
                net = net_bytes() if cfg.net_counters else (0.0, 0.0)
                row = {
                    "round": rnd, "step": step, "wall_seconds": wall, "train_seconds": train_s,
                    "eval_loss": loss, "train_loss": train_loss,
                    "rejoins": rejoins_total, "peak_rss_bytes": peak_rss_bytes(), "over_max_seconds": over,
                }
                for key in ("utilisation", "bytes_sent", "mix2_seconds", "mix1_wait_seconds", "mix1_seconds",
                            "round_seconds", "consensus_distance", "failed_exchanges", "skipped_exchanges"):
                    row[key] = stats[key] if stats else None
                if cfg.net_counters:
                    row.update(net_tx_bytes=net[0] - net0[0], net_rx_bytes=net[1] - net0[1])
                emit("row", **row)
                if over and not stop_file.exists():
                    with contextlib.suppress(OSError):
                        stop_file.write_text(json.dumps({"worker": slot, "round": rnd}) + "\n")
                stop = over or stop_file.exists()
                eval_life += time.perf_counter() - t0

        def checkpoint() -> None:
            nonlocal eval_life
            with opt.paused():
                t0 = time.perf_counter()
                wall, _ = clocks()
                _save_checkpoint(ckpt, {
                    "format": CHECKPOINT_FORMAT, "run_id": cfg.run_id, "worker": slot, "round": opt.round,
                    "step": min(opt.round * cfg.sync_every, cfg.steps), "fgdiloco": opt.state_dict(),
                    "batches": batch_gen.get_state(), "wall_seconds": wall, "eval_seconds": base_eval + eval_life,
                    "rejoins": rejoins_total, "time": time.time()})
                eval_life += time.perf_counter() - t0  # not training time either

        try:
            if opt.round == 0 and resumed_round is None:
                record(0, 0, None, None)
            H, rounds = cfg.sync_every, cfg.rounds
            in_round = 0  # inner steps done in the current round (checkpoints and rejoins are at round starts)
            round_losses: list[float] = []
            while opt.round < rounds and not stop:
                step = opt.round * H + in_round
                x, y = next_batch(inner, cfg, step, train, batch_gen)
                _, loss = model(x, y)
                loss.backward()
                clip_gradients(model.parameters(), cfg)
                before, seen, rejoins_before = opt.round, opt.last_round, opt.rejoins
                opt.step()
                opt.zero_grad(set_to_none=True)
                round_losses.append(loss.item())
                in_round += 1
                if opt.round == before and step + 1 >= cfg.steps:
                    opt.sync()  # end the last, shorter round
                if opt.last_round is seen:  # the round goes on (or the first step joined a later round)
                    if opt.rejoins != rejoins_before:
                        rejoined(before)
                        in_round, round_losses = 0, []
                    continue
                done = opt.last_round.round + 1
                stats = opt.last_round.as_dict()
                train_loss = sum(round_losses) / len(round_losses)
                in_round, round_losses = 0, []
                if done % cfg.eval_every == 0 or done >= rounds:
                    record(min(done * H, cfg.steps), done, train_loss, stats)
                if opt.rejoins != rejoins_before:  # fell behind: sync() moved on to the live round
                    rejoined(done)
                if opt.round % cfg.checkpoint_every == 0 or opt.round >= rounds or stop:
                    checkpoint()
        finally:
            opt.close()
        wall, train_s = clocks()
        return emit("end", round=opt.round, step=min(opt.round * cfg.sync_every, cfg.steps), wall_seconds=wall,
                    train_seconds=train_s, eval_seconds=base_eval + eval_life, peak_rss_bytes=peak_rss_bytes(),
                    rejoins=rejoins_total, stopped=stop)
    finally:
        sink.close()


def _interrupt_once(signum: int, frame: Any) -> None:
    """The first SIGINT (Ctrl-C reaches the whole process group) stops training with KeyboardInterrupt; later
    ones are ignored (the worker is already stopping)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """``python -m fgdiloco.pretrain.elastic_worker CONFIG_JSON``: the :class:`TrainConfig` the launcher wrote
    (``<out>/config.json``). Exit status 0 when the worker finished, 130 when interrupted."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fgdiloco.pretrain.elastic_worker CONFIG_JSON", file=sys.stderr)
        return 2
    raw = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    cfg = TrainConfig(**raw)
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        train_elastic(cfg)
    except KeyboardInterrupt:
        print("[fgdiloco] worker interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
