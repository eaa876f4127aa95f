"""The ``fgdiloco`` console command.

``fgdiloco pretrain``: pretrain a small GPT on real text with Factored Gossip DiLoCo on local worker processes
(defaults: 4 workers on the bundled public-domain corpus, about 3 minutes on 2 CPU cores). Everything that can be
checked is checked before a worker starts (exit status 2, one line naming the option); a failed worker is reported
in one line (exit 1) with its traceback kept under ``--out/logs``; Ctrl-C stops the workers, summarises the rounds
done and exits with 130.

``fgdiloco simulate``: the analytic round model of :mod:`fgdiloco.pretrain.simulate`.

Each subcommand adds itself in its own ``add_<name>_parser`` function. The pretrain flags are generated from the
fields of :class:`~fgdiloco.pretrain.config.TrainConfig` (:func:`~fgdiloco.pretrain.config.add_train_arguments`),
the FG-DiLoCo settings among them from :class:`fgdiloco.FGDiLoCoConfig`'s (:func:`fgdiloco.config.add_arguments`),
so a new setting is a new flag with no change here. Every parser takes whole option names only (no prefixes: a
misspelt ``--worker`` is refused, not taken for ``--workers``) and reports a bad command line in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib.util
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["build_parser", "main"]

#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130

#: What ``fgdiloco pretrain`` and ``fgdiloco simulate`` need beyond the library (``pip install 'fgdiloco[pretrain]'``).
PRETRAIN_EXTRA = ("tokenizers", "matplotlib", "rich")


class _Parser(argparse.ArgumentParser):
    """An argument parser that refuses abbreviated options and reports an error in one line (no usage block)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def refuse_extra(self, extra: list[str]) -> NoReturn:
        """The error for arguments this parser does not know, with the closest option names."""
        known = [o for a in self._actions for o in a.option_strings]
        hints = sorted({m for x in extra if x.startswith("--")
                        for m in difflib.get_close_matches(x.split("=")[0], known, n=1, cutoff=0.75)})
        self.error(f"unrecognized arguments: {' '.join(extra)}"
                   + (f"; did you mean {' or '.join(hints)}?" if hints else ""))


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: ...)`` to an option's help unless the help already says what its default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_command(subparsers: Any, name: str, **kwargs: Any) -> _Parser:
    return subparsers.add_parser(name, allow_abbrev=False, formatter_class=_Defaults, **kwargs)


def _missing_extra(prog: str) -> int | None:
    """Exit status 1 after one line when the ``[pretrain]`` extra is not installed; None when it is."""
    missing = []
    for name in PRETRAIN_EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if not missing:
        return None
    print(f"{prog}: error: the example job needs {', '.join(missing)} (not installed): pip install "
          "'fgdiloco[pretrain]'", file=sys.stderr, flush=True)
    return 1


def add_pretrain_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``pretrain`` to ``subparsers``: one flag per :class:`~fgdiloco.pretrain.config.TrainConfig` field,
    and ``--out``, ``--overwrite``, ``--resume``."""
    from .config import FGDiLoCoConfig
    from .pretrain.config import TrainConfig, add_train_arguments

    d, lib = TrainConfig(), FGDiLoCoConfig()
    p = _add_command(
        subparsers, "pretrain",
        help="pretrain a small GPT on text with Factored Gossip DiLoCo (local worker processes)",
        description="Pretrain a small nanoGPT-style model on real text with Factored Gossip DiLoCo: --workers local "
                    "processes (OMP_NUM_THREADS=1) each take --steps AdamW steps and gossip every --sync-every "
                    "steps. FG-DiLoCo runs on elastic workers: each worker (each pipeline replica with --stages > 1) "
                    "is its own torchrun job with --max-restarts, all meet on a gossip store this command serves "
                    "(restarted if it dies), a dead worker is restarted from its checkpoint and rejoins without "
                    "stopping the others. Baselines and --topology allreduce are not elastic (one torchelastic job: "
                    "one death ends the job). Writes run.json, "
                    "metrics.jsonl (one JSON row per evaluation), summary.json, loss.png and logs/ to --out; an "
                    "elastic run also config.json (what --resume continues), the workers' reports (workers/) and "
                    "checkpoints/. With no arguments it trains on the bundled public-domain corpus in about 3 "
                    "minutes on 2 CPU cores. The outer-loop, gossip and deadline options are the settings of "
                    "fgdiloco.FGDiLoCoConfig with the library's defaults, unless the option says why not: so this "
                    f"run uses the {lib.codec!r} codec over the {d.topology!r} topology unless told otherwise. "
                    "Needs the [pretrain] extra (pip install 'fgdiloco[pretrain]'). Exit status: 0 done, 1 a "
                    "worker failed (or the extra is missing), 2 bad arguments (checked before any worker starts), "
                    "130 interrupted (Ctrl-C).",
    )
    add_train_arguments(p)
    g = p.add_argument_group("where the results go")
    g.add_argument("--out", default=None, metavar="DIR",
                   help=f"output folder (default: {d.out}; when it holds an earlier run, a fresh {d.out}-2, "
                        f"{d.out}-3, ... is used and named)%(default).0s")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (without it, a folder holding another "
                        "run's results is refused)%(default).0s")
    g.add_argument("--resume", action="store_true",
                   help="continue the stopped (elastic) run in --out from every worker's newest checkpoint, with "
                        "its saved configuration (--out/config.json); --max-seconds (training time over all "
                        "launches), --max-restarts and --quiet are this command's%(default).0s")
    p.set_defaults(func=run_pretrain, subparser=p)
    return p


#: TrainConfig fields ``--resume`` takes from its own command line, not the saved run (they limit the run; they do
#: not change its trajectory). ``--max-seconds`` counts the run's training time over all its launches.
RESUMABLE = ("max_seconds", "max_restarts")


def _resume_config(args: argparse.Namespace) -> tuple[Any, Path]:
    """The saved configuration of the run in ``--out`` for ``--resume``, with :data:`RESUMABLE` from ``args``.

    Raises:
        PreflightError: no ``--out``, no saved run there, or an option that differs from the saved run's (a
            missing checkpoint is found by :func:`~fgdiloco.pretrain.launcher.launch_elastic`).
    """
    import json

    from .pretrain.config import LEGACY_NAMES, TrainConfig
    from .pretrain.launcher import PreflightError

    if args.out is None:
        raise PreflightError("--resume", "needs --out DIR: the folder of the run to continue")
    out = Path(args.out).expanduser()
    try:
        saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise PreflightError("--resume", f"found no run to continue in {str(out)!r} (no readable config.json; an "
                                         "elastic run writes it when it starts)") from None
    saved = {LEGACY_NAMES.get(k, k): v for k, v in saved.items()}
    # a worker without a checkpoint is refused by launch(resume=True) before anything is changed (PreflightError)
    d = TrainConfig()
    for name in sorted(set(TrainConfig.names()) - {"out", "quiet", "run_id", *RESUMABLE}):
        given = getattr(args, name, getattr(d, name))
        if given != getattr(d, name) and given != saved.get(name):
            raise PreflightError("--resume", f"continues the saved configuration, but --{name.replace('_', '-')} "
                                             f"{given!r} differs from the saved {saved.get(name)!r}")
    for name in RESUMABLE:  # this invocation's limits, not the stopped run's
        saved[name] = getattr(args, name)
    saved.update(out=str(out), quiet=args.quiet)
    return TrainConfig.from_dict(saved, strict=False), out


# ---------------------------------------------------------------------------------------------------- display
class _Display:
    """What the person at the terminal sees: rich spinners and a round bar on a terminal, plain lines otherwise
    (a pipe, a log file), nothing but warnings and the end with ``quiet``."""

    def __init__(self, quiet: bool, console: Any = None, err: Any = None):
        from rich.console import Console

        self.quiet = quiet
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.console.on_broken_pipe = self._closed  # type: ignore[method-assign]
        self.err = err or Console(stderr=True, highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal and not quiet
        self.progress: Any = None
        self.task: Any = None
        self.t_start = time.monotonic()
        self.rounds = self.steps = 0

    def say(self, text: str) -> None:
        if not self.quiet:
            (self.progress.console if self.progress is not None else self.console).print(
                f"[fgdiloco] {text}", markup=False, highlight=False)

    def _closed(self) -> None:
        """The standard output is a pipe whose reader has gone (``| head``): say so once on stderr, print nothing
        more there, and train on (rich's own handling exits with status 1, which stopped the workers)."""
        import os

        # later writes, and the flush at exit, go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.console.file.fileno())
        self.quiet = self.console.quiet = True
        self.err.print("[fgdiloco] the standard output was closed; training on (the results are written as always)",
                       markup=False)

    def warn(self, text: str) -> None:
        self.err.print(f"[fgdiloco] warning: {text}", markup=False)

    def status(self, text: str) -> Any:
        if self.quiet:
            return None
        if self.live:
            return self.console.status(text)
        self.say(text + " ...")
        return None

    def start_workers(self, workers: int, rounds: int, steps: int) -> None:
        self.rounds, self.steps = rounds, steps
        self.t_launch = time.monotonic()
        if self.quiet:
            return
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn("rounds"), TimeElapsedColumn(),
                                     TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
                                     transient=True)
            self.progress.start()
            self.task = self.progress.add_task(f"starting {_count(workers, 'worker')}", total=rounds)
        else:
            self.say(f"starting {_count(workers, 'worker')} (each imports torch and loads the cached tokens) ...")

    def row(self, row: dict[str, Any]) -> None:
        from .pretrain.results import format_round

        if row["round"] == 0:
            self.say(f"workers ready after {time.monotonic() - self.t_launch:.1f} s; training")
        self.say(format_round(row, self.rounds, self.steps))
        if self.progress is not None:
            self.progress.update(self.task, completed=row["round"], description="training")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def run_pretrain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    code = _missing_extra(parser.prog)
    if code is not None:
        return code
    display = _Display(args.quiet)
    prepared = _prepare_pretrain(args, parser.prog, display)
    if isinstance(prepared, int):
        return prepared
    cfg, out, found, note = prepared
    for w in found["warnings"]:
        display.warn(w)
    if note:
        display.warn(note)
    method = (f"{cfg.baseline} baseline" if cfg.baseline
              else f"Factored Gossip DiLoCo ({cfg.topology}, codec {cfg.codec})")
    shape = (f" ({cfg.replicas} replicas x {cfg.stages} stages, {cfg.microbatches} microbatches)"
             if cfg.stages > 1 else "")
    display.say(f"pretrain: {_count(cfg.workers, 'worker')}{shape} x {cfg.steps} steps "
                f"({_count(cfg.rounds, 'round')} of H = {cfg.sync_every}), "
                f"{method}; data: {cfg.data or 'bundled corpus'} ({found['tokens']:,} tokens, vocabulary "
                f"{found['vocab_size']}); out: {out}")
    return _launch_pretrain(cfg, out, args.resume, parser.prog, display)


def _prepare_pretrain(args: argparse.Namespace, prog: str, display: _Display) -> Any:
    """The run's configuration, folder, preflight findings and a note on the folder; or the exit status after one
    line saying why not (2: a bad option, 130: interrupted)."""
    from .pretrain.config import TrainConfig
    from .pretrain.launcher import PreflightError, choose_output, clear_outputs, preflight

    try:
        if args.resume:
            if args.overwrite:
                raise PreflightError("--resume", "continues the run in --out; --overwrite would replace it: give one "
                                                 "of the two")
            cfg, out = _resume_config(args)
            note = None
            done = _finished(out, cfg)
            if done is not None:  # said even with --quiet: it is the run's end
                display.console.print(f"[fgdiloco] {done}", markup=False, highlight=False)
                return 0
            if not cfg.elastic:
                raise PreflightError("--resume", "needs an elastic run (FG-DiLoCo with a gossip topology); "
                                                 f"the run in {out} has no checkpoints")
        else:
            asked = args.out if args.out is not None else TrainConfig().out
            cfg = TrainConfig.from_arguments(args, out=str(asked))
            with contextlib.suppress(FileNotFoundError):  # preflight says it, naming --data
                cfg.validate()  # a bad option is said before a taken folder
            unused = cfg.unused()  # an option that would pass without effect
            if unused:
                name, why = unused[0]
                raise PreflightError(_flag(name), f"has no effect in this run: {why}")
            out, note = choose_output(asked, explicit=args.out is not None, overwrite=args.overwrite)
            cfg = dataclasses.replace(cfg, out=str(out))
        found = preflight(cfg, status=display.status)
    except PreflightError as e:
        return _refuse(prog, str(e))
    except (TypeError, ValueError) as e:  # a TrainConfig check: name the option
        return _refuse(prog, _as_option(str(e)))
    except KeyboardInterrupt:
        display.err.print("[fgdiloco] interrupted before any worker started; nothing written", markup=False)
        return EXIT_INTERRUPTED
    if args.overwrite and not args.resume:
        clear_outputs(out)
    return cfg, out, found, note


def _flag(name: str) -> str:
    """The ``fgdiloco pretrain`` option of the TrainConfig field ``name`` (a switch's own flag from the field's
    metadata, e.g. ``--no-error-feedback``; else the field's name)."""
    from .pretrain.config import TrainConfig

    meta = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}.get(name, {})
    return meta.get("flag") or "--" + name.replace("_", "-")


def _finished(out: Path, cfg: Any) -> str | None:
    """What to say when ``--resume`` finds the run in ``out`` finished (every planned round, neither interrupted nor
    stopped by --max-seconds): there is nothing to continue. None otherwise."""
    import json

    try:
        s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if s.get("run_id") != cfg.run_id or s.get("interrupted") or s.get("stopped_early") \
            or s.get("rounds") != cfg.rounds:
        return None
    return (f"the run in {out} already finished its {_count(cfg.rounds, 'round')} (held-out loss "
            f"{s['final_eval_loss']:.3f}); nothing to continue")


def _refuse(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return 2


def _launch_pretrain(cfg: Any, out: Path, resume: bool, prog: str, display: _Display) -> int:
    """Run the workers; the exit status (0 done, 1 failed, 2 refused, 128 + the signal when stopped)."""
    from .pretrain.launcher import PreflightError, WorkerFailed, finish_interrupted, launch

    try:
        summary = launch(cfg, on_row=display.row, resume=resume,
                         on_start=lambda: display.start_workers(cfg.workers, cfg.rounds, cfg.steps))
    except PreflightError as e:
        display.close()
        return _refuse(prog, str(e))
    except WorkerFailed as e:
        display.close()
        display.err.print(f"[fgdiloco] pretrain failed: {e}", markup=False)
        return 1
    except BaseException as e:  # noqa: BLE001 - Ctrl-C arrives as KeyboardInterrupt or torchelastic's SignalException
        display.close()
        if not (isinstance(e, KeyboardInterrupt) or type(e).__name__ == "SignalException"):
            raise
        # 128 + the signal, as shells report it: 130 for Ctrl-C (SIGINT), 143 for SIGTERM
        code = 128 + int(getattr(e, "sigval", 0) or 0) if not isinstance(e, KeyboardInterrupt) else EXIT_INTERRUPTED
        return _interrupted(out, display, finish_interrupted, code)
    display.close()
    for lost in summary.get("workers_lost") or []:
        display.warn(f"worker {lost['worker']} failed for good (after --max-restarts {cfg.max_restarts}): "
                     f"{lost['reason']} (its log: {lost['log']}); the others finished")
    display.console.print(_summary_text(summary, out, time.monotonic() - display.t_start), markup=False,
                          highlight=False)
    return 0


def _as_option(message: str) -> str:
    """A TrainConfig or FGDiLoCoConfig check's message in the command's terms: ``"sync_every must be ..."`` ->
    ``"--sync-every must be ..."``, ``"fragments=3 must divide sync_every=20"`` -> ``"--fragments 3 must divide
    --sync-every 20"``. Setting names are rewritten where they cannot be prose: the first word, ``name=value``, and
    names with an underscore."""
    from .pretrain.config import TrainConfig

    names = set(TrainConfig.names())

    def flag(m: re.Match) -> str:
        name, eq = m.group(1), m.group(2)
        if name not in names or not (m.start() == 0 or eq or "_" in name):
            return m.group(0)
        return "--" + name.replace("_", "-") + (" " if eq else "")

    return re.sub(r"(?<![\w.'\"-])([a-z][a-z0-9_]*)(=?)", flag, message)


def _interrupted(out: Path, display: _Display, finish: Any, code: int = EXIT_INTERRUPTED) -> int:
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the summary short
    try:
        summary = finish(out)
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if summary is None:
        display.err.print(f"[fgdiloco] interrupted: stopped the workers before training started (nothing was "
                          f"trained); their logs are in {out / 'logs'}; to start again in {out}, add --overwrite",
                          markup=False)
        return code
    rows = summary["rounds"]
    kept = ["summary.json (marked interrupted)" if summary["interrupted"] else "summary.json"]
    kept += [name for name in _outputs(out) if name != "summary.json"]
    loss = summary.get("final_eval_loss")
    display.err.print(f"[fgdiloco] interrupted after round {rows}/{summary['rounds_planned']} (step {summary['steps']}/"
                      f"{summary['steps_planned']}"
                      + (f", held-out loss {loss:.3f}" if loss is not None else "")
                      + f"): stopped the workers; kept in {out}: {', '.join(kept)}", markup=False)
    return code


def _summary_text(s: dict[str, Any], out: Path, elapsed: float) -> str:
    """The closing lines; ``elapsed``: seconds since the command started (checks and worker start included)."""
    from .pretrain.results import fmt_bytes, fmt_duration

    util = "-" if s.get("utilisation") is None else f"{100 * s['utilisation']:.1f}%"
    head = f"[fgdiloco] done in {fmt_duration(elapsed)}:"
    if s.get("stopped_early"):  # --max-seconds: a run that can go on, not a finished one
        head = (f"[fgdiloco] stopped at --max-seconds after round {s['rounds']}/{s['rounds_planned']} (step "
                f"{s['steps']}/{s['steps_planned']}) in {fmt_duration(elapsed)}; the same command with --resume "
                "continues it:")
    lines = [
        head,
        f"  held-out loss   {s['initial_eval_loss']:.3f} -> {s['final_eval_loss']:.3f} nats/token "
        f"(mean over replicas {s['final_eval_loss_mean']:.3f}; unigram baseline {s['unigram_loss']:.3f})",
        f"  tokens          {_tokens(s['tokens'])} in {s['train_seconds']:.1f} s of training: "
        f"{s['tokens_per_second']:,.0f} tokens/s, all workers, evaluation excluded "
        f"(set-up {s['setup_seconds']:.1f} s)",
        f"  utilisation     {util} of round time computing   sent {fmt_bytes(s['bytes_sent_per_worker'])} per "
        f"worker ({fmt_bytes(s['bytes_sent_all_workers'])} all workers)   failed exchanges {s['failed_exchanges']}"
        + (f" (skipped {s['skipped_exchanges']})" if s.get("skipped_exchanges") else ""),
    ]
    if s.get("stages", 1) > 1:
        lines.append(f"  pipeline        {s['replicas']} replicas x {s['stages']} stages: activations sent "
                     f"{fmt_bytes(s['activation_bytes_sent'])} per worker, bubble "
                     f"{100 * (s['pipeline_bubble'] or 0.0):.1f}% of a step")
    if s.get("restarts") or s.get("rejoins"):
        lines.append(f"  elastic         {s['restarts']} worker restart(s), {s['rejoins']} rejoin(s) (marked in "
                     "loss.png)")
    lines.append(f"  outputs         {out}/: {', '.join(_outputs(out))}")
    return "\n".join(lines)


def _outputs(out: Path) -> list[str]:
    """What the run left in ``out``, in the order the docs describe it (folders with a slash)."""
    order = ("summary.json", "metrics.jsonl", "loss.png", "run.json", "config.json", "logs", "workers",
             "checkpoints")
    return [name + ("/" if (out / name).is_dir() else "") for name in order if (out / name).exists()]


# ---------------------------------------------------------------------------------------------------- simulate
def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to ``subparsers`` (the model is :mod:`fgdiloco.pretrain.simulate`)."""
    from .pretrain import simulate

    p = _add_command(
        subparsers, "simulate",
        help="analytic model of a round: utilisation of DDP, DiLoCo and FG-DiLoCo vs bandwidth and workers",
        description=simulate.DESCRIPTION + " Needs the [pretrain] extra (pip install 'fgdiloco[pretrain]').",
    )
    simulate.add_arguments(p, default_out=None)
    p.set_defaults(func=run_simulate, subparser=p)
    return p


def run_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .pretrain import simulate
    from .pretrain.launcher import PreflightError, choose_output, clear_outputs

    code = _missing_extra(parser.prog)
    if code is not None:
        return code
    if args.wan is not None and not Path(args.wan).is_file():  # named: not found is an error, not "nothing to
        print(f"{parser.prog}: error: --wan {args.wan}: no such file", file=sys.stderr)  # validate against"
        return 2
    try:
        out, note = choose_output(args.out if args.out is not None else simulate.DEFAULT_OUT,
                                  explicit=args.out is not None, overwrite=args.overwrite,
                                  names=simulate.OUTPUT_NAMES)
    except PreflightError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if note:
        print(f"[simulate] {note}", file=sys.stderr)
    if args.overwrite:
        clear_outputs(out, simulate.OUTPUT_NAMES)
    args.out = str(out)
    with contextlib.suppress(KeyboardInterrupt):
        simulate.print_report(simulate.run(args))
        return 0
    print("[simulate] interrupted; nothing written", file=sys.stderr)
    return EXIT_INTERRUPTED


# ---------------------------------------------------------------------------------------------------- elastic jobs
def add_elastic_parsers(subparsers: Any) -> None:
    """Add ``store`` and ``launch`` (the elastic job's gossip store and its launcher, :mod:`fgdiloco.elastic`).
    A non-number is worded as the settings' options word it (``Count.parse``); ranges are checked where used."""
    from .config import Count, Integer

    p = _add_command(
        subparsers, "store", help="serve an elastic job's gossip store (a TCPStore no worker hosts) until stopped",
        description="Serve the gossip store of an elastic job: workers anywhere reach it with "
                    "FGDILOCO_STORE=HOST:PORT. The store runs in a child process that is restarted on the same port "
                    "when it dies (the workers reconnect and re-publish their state). Stop it with Ctrl-C.")
    p.add_argument("--host", default="0.0.0.0", help="interface to listen on (0.0.0.0: every one)")
    p.add_argument("--port", type=Integer("a TCP port in [0, 65536)").parse, default=29400,
                   help="TCP port (0: one the OS picks)")
    p.set_defaults(func=run_store, subparser=p)

    p = _add_command(
        subparsers, "launch",
        help="run a training script as an elastic job: one torchrun job per worker, with restarts",
        description="Run SCRIPT as an elastic FG-DiLoCo job: every worker is its own single-process torchrun job "
                    "with --max-restarts, and all meet on a gossip store this command serves (or --store). A "
                    "worker's death, hang or restart never stops another. The script builds "
                    "FGDiLoCo(..., elastic=True).")
    p.add_argument("--workers", type=Count(1).parse, default=2, help="workers to start here")
    p.add_argument("--max-restarts", type=Count(0).parse, default=3,
                   help="restarts of each worker before it is given up")
    p.add_argument("--store", default=None, help="HOST:PORT of a running gossip store (default: serve one here)")
    p.add_argument("--slots", type=Count(1).parse, default=None,
                   help="the job's worker slots (default: first-worker + workers; more leaves room to join)")
    p.add_argument("--first-worker", type=Count(0).parse, default=0,
                   help="slot of the first worker started here")
    p.add_argument("--job", default=None,
                   help="the job's name on the store (several jobs may share one; a new job on a store that served "
                        "one needs a name of its own) (default: 'default', or $FGDILOCO_JOB)")
    p.add_argument("--log-dir", default=None, help="write worker k's output to LOG_DIR/worker<k>.log")
    p.add_argument("--resume", action="store_true",
                   help="set FGDILOCO_RESUME=1 for the workers: a script that keeps checkpoints continues from them "
                        "(e.g. after the workers stopped because the gossip store was out of reach)")
    p.add_argument("--stages", type=Count(1).parse, default=1,
                   help="processes per worker: the stages of an elastic pipeline replica, one torchrun job that "
                        "fails and restarts together (the script calls fgdiloco.elastic.init_replica_group)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="train.py [ARGS] or -m MODULE [ARGS]")
    p.set_defaults(func=run_launch, subparser=p)


def run_store(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import signal
    import threading

    from .elastic import SupervisedStore

    store = None
    try:
        store = SupervisedStore(args.host, args.port)
        store.ready()
    except ValueError as e:
        print(f"{parser.prog}: error: --{e}", file=sys.stderr)
        return 2
    except (RuntimeError, KeyboardInterrupt) as e:  # the port is taken, the child could not serve; Ctrl-C
        if store is not None:
            store.close()
        if isinstance(e, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"[fgdiloco] gossip store on {args.host}:{store.port}: set FGDILOCO_STORE=<this host>:{store.port} "
          "for the workers; Ctrl-C stops it", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    store.close()
    return 0


def run_launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from .elastic import launch

    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    try:
        failed = launch(script, args.workers, max_restarts=args.max_restarts, store=args.store, slots=args.slots,
                        first_worker=args.first_worker, job=args.job, log_dir=args.log_dir, resume=args.resume,
                        stages=args.stages)
    except ValueError as e:
        print(f"{parser.prog}: error: {_as_flag(str(e))}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the gossip store served here could not start
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[fgdiloco] launch interrupted: stopped the workers", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SignalException as e:  # SIGTERM: launch() sent it on to every agent and waited for them
        print(f"[fgdiloco] launch stopped by {e.sigval.name}: stopped the workers", file=sys.stderr)
        return 128 + int(e.sigval)
    return 1 if failed else 0  # launch() said which


def _count(n: int, noun: str) -> str:
    """``"1 worker"``, ``"4 workers"``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _tokens(n: float) -> str:
    """A token count for the summary: ``"1.97M"``, or the count itself below 100,000 (``"3,072"``)."""
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,.0f}"


def _as_flag(message: str) -> str:
    """``"max_restarts must be ..."`` -> ``"--max-restarts must be ..."`` (for ``fgdiloco launch``'s options)."""
    head, _, rest = message.partition(" ")
    flags = {"workers", "max_restarts", "store", "slots", "first_worker", "job", "stages", "log_dir"}
    rest = rest.replace("first_worker + workers", "--first-worker + --workers")
    return f"--{head.replace('_', '-')} {rest}" if head in flags else message


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="fgdiloco", description="Factored Gossip DiLoCo for PyTorch.")
    parser.add_argument("--version", action="version", version=f"fgdiloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_pretrain_parser(sub)
    add_simulate_parser(sub)
    add_elastic_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fgdiloco`` console script; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = getattr(args, "subparser", None)
    if extra:  # the command's own error (its usage), not the top-level one
        (command if command is not None else parser).refuse_extra(extra)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args, command) or 0)


if __name__ == "__main__":
    sys.exit(main())
