"""The example job's settings: :class:`TrainConfig`, its command-line flags and where it departs from the library.

A :class:`TrainConfig` holds the job's own settings (workers, pipeline stages, steps, the inner optimiser, the
model, the data, the outputs; each field written once below with its default, its check and its help) **and every
setting of** :class:`fgdiloco.FGDiLoCoConfig` **as a field of the same name** (``sync_every``, ``topology``,
``codec``, ``codec_rank``, ``join_timeout``, ...), generated from ``FGDiLoCoConfig``'s fields when this module is
imported. So a setting added to ``FGDiLoCoConfig`` is a ``TrainConfig`` field, a key of the run's ``config.json``
and a ``fgdiloco pretrain`` flag without a change here; its check and help are ``FGDiLoCoConfig``'s.

Why flat field names rather than one nested ``FGDiLoCoConfig`` field: the run's ``config.json`` (which ``--resume``
reads back, and which the benchmarks and ``summary.json`` quote as ``config``) keeps the flat shape of earlier runs;
``TrainConfig(sync_every=10, codec="lowrank", timeout=30)`` and ``dataclasses.replace(cfg, codec=...)`` work for
every setting alike; the command line has one namespace (``--sync-every``, not ``--fgdiloco-sync-every``). Nothing
is re-listed: :meth:`TrainConfig.fgdiloco_config` builds the ``FGDiLoCoConfig`` the workers use, validated by its
own checks.

:data:`DEPARTURES` lists where the job's default differs from the library's, with the reason ``--help`` shows.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ..config import TIMEOUT_FIELDS, Check, Choice, Count, FGDiLoCoConfig, Flag, Number, Seconds, fragment_count
from ..config import add_arguments as add_fgdiloco_arguments
from ..factor import LowRank
from .device import DEVICES

__all__ = ["DEPARTURES", "LEGACY_NAMES", "Departure", "TrainConfig", "add_train_arguments"]


class Departure(NamedTuple):
    """The example job's default for an ``FGDiLoCoConfig`` setting, and why it is not the library's."""

    default: Any
    reason: str


#: Where :class:`TrainConfig` departs from ``FGDiLoCoConfig``'s defaults, and why (``fgdiloco pretrain --help``
#: shows it beside the flag).
DEPARTURES: dict[str, Departure] = {
    "sync_every": Departure(20, "the default job is 240 steps, about 3 minutes on 2 CPU cores: H = 20 gives it 12 "
                                "outer rounds (H = 50 would give 5)"),
    "outer_momentum": Departure(0.3, "that is DiLoCo's setting for hundreds of rounds; in the 12 rounds of the "
                                     "default job it overshoots (held-out loss 5.67 with 0.9, 5.02 with 0.3 with "
                                     "the dense codec, measured)"),
}

#: Names that earlier versions of the job used for a setting (``config.json`` of older runs, old scripts).
LEGACY_NAMES: dict[str, str] = {"rank": "codec_rank"}


class _Choices(Check):
    """One of a fixed set of names (the job's own choices; the registries' are ``FGDiLoCoConfig``'s)."""

    def __init__(self, *names: str):
        self.choices = names
        self.allowed = "one of " + ", ".join(repr(n) for n in names)

    def __call__(self, name: str, value: Any) -> Any:
        if value not in self.choices:
            raise ValueError(f"{name} must be {self.allowed}, got {value!r}")
        return value


def _job(default: Any, check: Check | None, help: str, group: str, *, flag: str | None = "",
         metavar: str | None = None) -> Any:
    """A field of the job's own: default, check (None: any value), help and flag group, written once.

    ``flag``: ``""`` for ``--<name-with-dashes>``, another option string for a ``store_true`` / ``store_false``
    switch (``"--quiet"``, ``"--no-error-feedback"``), None for no flag (set by the command or the benchmarks).
    """
    return field(default=default, metadata={"check": check, "help": help, "group": group, "flag": flag,
                                            "metavar": metavar})


def _with_fgdiloco_settings(cls: type) -> type:
    """Add every ``FGDiLoCoConfig`` field to ``cls`` (before ``@dataclass`` makes it a dataclass): same name, type,
    check and help; default the library's unless :data:`DEPARTURES` says otherwise."""
    annotations = cls.__dict__.get("__annotations__", {})
    for f in dataclasses.fields(FGDiLoCoConfig):
        if f.name in annotations:
            raise TypeError(f"TrainConfig.{f.name} would hide FGDiLoCoConfig's setting of that name")
        default = DEPARTURES[f.name].default if f.name in DEPARTURES else f.default
        annotations[f.name] = f.type
        setattr(cls, f.name, field(default=default, metadata={**f.metadata, "fgdiloco": True}))
    cls.__annotations__ = annotations
    return cls


_RUN = "workers and pipeline"
_ELASTIC = "elastic workers (FG-DiLoCo with a gossip topology)"
_INNER = "inner optimizer and batches"
_MODEL = "model"
_DATA = "data"
_OUT = "output and evaluation"
#: The flag groups of the job's own fields, in ``--help`` order; the settings' groups follow the first.
JOB_GROUPS = (_RUN, _ELASTIC, _INNER, _MODEL, _DATA, _OUT)


@dataclass
@_with_fgdiloco_settings
class TrainConfig:
    """Everything a pretraining run needs. The defaults finish in about 3 minutes on 2 CPU cores.

    Run shape: ``workers`` replicas each take ``steps`` inner AdamW steps; every ``sync_every`` of them end an
    outer round (gossip). Tokens seen in total = ``workers * steps * batch_size * block_size``.

    Besides the fields below, every setting of :class:`fgdiloco.FGDiLoCoConfig` is a field of the same name
    (generated: see the module docstring), with the library's default except for :data:`DEPARTURES`. ``timeout``
    is the shorthand of ``FGDiLoCoConfig(timeout=...)``: when given it sets the deadlines of
    :data:`fgdiloco.config.TIMEOUT_FIELDS` left at the library's default. Build one from a saved ``config.json``
    with :meth:`from_dict` (it also reads older runs' names, :data:`LEGACY_NAMES`).
    """

    # workers and the pipeline (workers = replicas x stages)
    workers: int = _job(4, Count(1), "worker processes M = replicas x stages", _RUN)
    stages: int = _job(1, Count(1), "pipeline stages S per replica (must divide --workers, at most --n-layer): "
                       "each replica is S workers holding GPT.split(S), run with the 1F1B schedule; gossip mixes "
                       "the same stage of the replicas. Each replica is its own torchrun job of S processes: a dead "
                       "stage restarts its replica, the others train on", _RUN)
    microbatches: int = _job(4, Count(1), "microbatches per batch with --stages > 1 (must divide --batch-size, at "
                             "least --stages)", _RUN)
    steps: int = _job(240, Count(1), "inner optimizer steps per worker", _RUN)
    baseline: str | None = _job(None, _Choices("ddp", "localsgd"), "train a comparison instead: 'ddp' "
                                "(DistributedDataParallel, gradients all-reduced every step) or 'localsgd' "
                                "(PyTorch's PeriodicModelAverager every --sync-every steps). Not elastic: one "
                                "torchelastic job, one death ends the job", _RUN)
    device: str = _job("auto", _Choices(*DEVICES), "where each worker computes: 'auto' (CUDA when available, "
                       "else the CPU), 'cpu' or 'cuda'. Worker k takes GPU k %% (GPUs on the host): one GPU per "
                       "worker when there are enough, else workers share GPUs; bf16 autocast for the inner steps "
                       "where the GPU supports it. Gossip always goes over Gloo through host buffers (docs/gpu.md)",
                       _RUN)
    timeout: float | None = _job(None, Seconds(), "", _RUN, flag=None)  # its flag comes with the settings' flags
    error_feedback: bool = _job(True, Flag(), "the lowrank codec without error feedback (an ablation; it is on by "
                                "default). Only the exact path (--topology allreduce) keeps a residual: pairwise "
                                "gossip exchanges never use one, so elsewhere it is refused",
                                "gossip", flag="--no-error-feedback")
    # elastic workers: torchrun restarts of each worker before it is given up, and outer rounds between a worker's
    # checkpoints (<out>/checkpoints/worker<k>.pt, from which a restarted worker continues)
    max_restarts: int = _job(3, Count(0), "torchrun restarts of each worker before it is given up (each worker is "
                             "its own torchrun job: a dead worker is restarted, continues from its checkpoint and "
                             "rejoins at the live round; the others never stop)", _ELASTIC)
    checkpoint_every: int = _job(5, Count(1), "outer rounds between each worker's checkpoints "
                                 "(--out/checkpoints/worker<k>.pt, atomic; also after the last round)", _ELASTIC,
                                 metavar="R")
    # inner optimiser (AdamW, linear warm-up then cosine decay to min_lr_ratio * lr, gradient clipping; 0: off)
    lr: float = _job(3e-3, Number(0.0), "AdamW peak learning rate", _INNER)
    warmup_steps: int = _job(20, Count(0), "linear warm-up steps", _INNER)
    min_lr_ratio: float = _job(0.1, Number(0.0, 1.0, low_ok=True, high_ok=True),
                               "the cosine decay ends at this fraction of --lr", _INNER)
    weight_decay: float = _job(0.1, Number(0.0, low_ok=True), "AdamW weight decay (matrices only)", _INNER)
    grad_clip: float = _job(1.0, Number(0.0, low_ok=True), "gradient-norm clipping (0: off)", _INNER)
    batch_size: int = _job(16, Count(1), "sequences per step per worker", _INNER)
    block_size: int = _job(128, Count(2), "tokens per sequence", _INNER)
    # model; subspace_rank: GPT(subspace_rank=k), Ramasinghe et al.
    n_layer: int = _job(4, Count(1), "transformer blocks", _MODEL)
    n_head: int = _job(4, Count(1), "attention heads", _MODEL)
    n_embd: int = _job(128, Count(1), "model width", _MODEL)
    dropout: float = _job(0.0, Number(0.0, 1.0, low_ok=True), "dropout probability", _MODEL)
    subspace_rank: int | None = _job(None, Count(1), "GPT(subspace_rank=K): residual-stream writes through a fixed "
                                     "n_embd x K basis (Subspace Networks); with --stages > 1 each stage boundary "
                                     "sends K numbers per token instead of n_embd (default: the plain model)",
                                     _MODEL, metavar="K")
    stage_embeddings: bool = _job(True, Flag(), "with --subspace-rank and --stages > 1: no stage embeddings, so every "
                                  "stage reads the frozen E_fix plus K trained dimensions of the token embedding "
                                  "(GPT(stage_embeddings=False); by default every stage re-embeds the token ids "
                                  "with its own trainable embedding, which never crosses a boundary)", _MODEL,
                                  flag="--no-stage-embeddings")
    # data
    data: str | None = _job(None, None, "UTF-8 text file or folder of .txt files (default: the bundled "
                            "public-domain corpus)", _DATA, metavar="PATH")
    tokenizer: str = _job("bpe", _Choices("bpe", "bytes"), "byte-level BPE (trained on the data, cached) or raw "
                          "UTF-8 bytes", _DATA)
    vocab_size: int = _job(2048, Count(1), "BPE vocabulary size (257 to 65535)", _DATA)
    val_fraction: float = _job(0.05, Number(0.0, 1.0), "held-out tail of the tokens", _DATA)
    cache_dir: str | None = _job(None, None, "where to cache the tokenizer and token ids (default: "
                                 "$XDG_CACHE_HOME/fgdiloco, i.e. ~/.cache/fgdiloco, for the bundled corpus; "
                                 ".fgdiloco-cache/ beside other data when writable)", _DATA, metavar="DIR")
    # output and evaluation (run_id: written into run.json and summary.json; None: the launcher makes one)
    out: str = _job("runs/pretrain", None, "output folder", _OUT, flag=None)
    run_id: str | None = _job(None, None, "the run's id", _OUT, flag=None)
    eval_every: int = _job(1, Count(1), "outer rounds between evaluations", _OUT)
    eval_batches: int = _job(4, Count(1), "held-out batches per evaluation", _OUT)
    max_seconds: float | None = _job(None, Seconds(), "stop once a worker's training time (evaluation excluded) "
                                     "passes S seconds: at that evaluation point, or, for an elastic run's "
                                     "workers, all at the next one (default: no limit)", _OUT,
                                     metavar="S")
    quiet: bool = _job(False, Flag(), "print only warnings, errors and the final summary (metrics.jsonl is written "
                       "as always)", _OUT, flag="--quiet")
    # benchmarks (benchmarks/wan.py): record the byte counters of the interface named by $GLOO_SOCKET_IFNAME in
    # metrics.jsonl; eval_deferred: keep a copy of the weights at each evaluation point and evaluate them after
    # training, so no evaluation runs between rounds (where background gossip would progress during time that is
    # not counted)
    net_counters: bool = _job(False, Flag(), "record the network interface's byte counters", _OUT, flag=None)
    eval_deferred: bool = _job(False, Flag(), "evaluate the kept weights after training", _OUT, flag=None)

    def __post_init__(self) -> None:
        if self.timeout is not None and not isinstance(self.timeout, bool):  # the shorthand; checked by validate()
            for name in TIMEOUT_FIELDS:
                if getattr(self, name) == getattr(FGDiLoCoConfig, name):
                    setattr(self, name, self.timeout)

    # ------------------------------------------------------------------ building
    @classmethod
    def names(cls) -> list[str]:
        """Every field's name: the job's own and ``FGDiLoCoConfig``'s."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, strict: bool = True) -> TrainConfig:
        """The configuration of a saved ``config.json`` (or ``summary.json``'s ``config``): flat names, older runs'
        names too (:data:`LEGACY_NAMES`; a config without ``stage_embeddings`` is an older run's: False).
        ``strict=False`` ignores keys that are not fields (another version's).

        Raises:
            TypeError: an unknown key with ``strict``.
        """
        values = {LEGACY_NAMES.get(k, k): v for k, v in values.items()}
        # a run saved before stage embeddings existed built its split subspace model without them: it resumes so
        values.setdefault("stage_embeddings", False)
        known = set(cls.names())
        unknown = sorted(set(values) - known)
        if unknown and strict:
            raise TypeError(f"unknown TrainConfig field(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_arguments(cls, args: argparse.Namespace, **fixed: Any) -> TrainConfig:
        """The configuration of ``fgdiloco pretrain``'s parsed flags (:func:`add_train_arguments`), then ``fixed``."""
        given = {k: v for k, v in vars(args).items() if k in set(cls.names())}
        return cls(**{**given, **fixed})

    def as_dict(self) -> dict[str, Any]:
        """The flat ``{field: value}`` that ``config.json`` holds (a codec or topology instance by its name)."""
        return {n: getattr(getattr(self, n), "name", getattr(self, n)) if n in _SETTINGS else getattr(self, n)
                for n in self.names()}

    def fgdiloco_config(self) -> FGDiLoCoConfig:
        """The ``FGDiLoCoConfig`` of this run's FG-DiLoCo settings (a fresh codec instance when the job's codec
        options need one: ``error_feedback=False``).

        Raises:
            TypeError, ValueError: a setting of the wrong type or out of range (``FGDiLoCoConfig``'s checks).
        """
        settings = {n: getattr(self, n) for n in _SETTINGS}
        if not self.error_feedback and isinstance(self.codec, str) and self.codec.lower() == "lowrank":
            rank = {} if self.codec_rank is None else {"rank": self.codec_rank}
            settings["codec"] = LowRank(**rank, error_feedback=False)
            settings["codec_rank"] = None  # given to the instance
        return FGDiLoCoConfig(**settings)

    # ------------------------------------------------------------------ checks
    def validate(self) -> TrainConfig:
        """Check every field; returns ``self``.

        Raises:
            ValueError: a field out of range, unknown or of the wrong type (the message names it and what is
                allowed), or fields that do not fit together.
            FileNotFoundError: ``data`` does not exist.
        """
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            value = getattr(self, f.name)
            if f.metadata.get("fgdiloco") or check is None or (value is None and f.default is None):
                continue
            try:
                check(f.name, value)
            except TypeError as e:
                raise ValueError(str(e)) from None
        try:
            self.fgdiloco_config()
        except TypeError as e:  # one kind of error for a bad setting, whichever checks it
            raise ValueError(str(e)) from None
        self._check_model_and_data()
        self._check_stages()
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device 'cuda': no CUDA device is available (torch.cuda.is_available() is False); "
                                 "use --device auto or cpu")
        return self

    def _check_model_and_data(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be an int >= 0 (the model's and the batches' seed), got {self.seed}")
        if self.tokenizer == "bpe" and not 257 <= self.vocab_size <= 65535:
            raise ValueError(f"vocab_size must be an int in [257, 65535] for the bpe tokenizer, got {self.vocab_size}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.subspace_rank is not None and self.subspace_rank > self.n_embd:
            raise ValueError(f"subspace_rank must be None or an integer in [1, n_embd={self.n_embd}], got "
                             f"{self.subspace_rank!r}")
        if self.data is not None and not Path(self.data).expanduser().exists():
            raise FileNotFoundError(f"--data {self.data!r} does not exist (give a UTF-8 text file or a folder of "
                                    ".txt files)")

    def _check_stages(self) -> None:
        if self.workers % self.stages:
            raise ValueError(f"stages must divide workers (workers = replicas x stages), got stages={self.stages} "
                             f"for workers={self.workers}")
        if self.stages > self.n_layer:
            raise ValueError(f"stages must be <= n_layer={self.n_layer} (every stage holds at least one block), "
                             f"got {self.stages}")
        if self.stages == 1:
            return
        if self.baseline is not None:
            raise ValueError(f"baseline {self.baseline!r} trains one whole model per worker; it cannot be "
                             f"combined with stages={self.stages} (pipeline stages need FG-DiLoCo)")
        if self.batch_size % self.microbatches:
            raise ValueError(f"microbatches must divide batch_size={self.batch_size} (every microbatch holds "
                             f"the same number of sequences), got {self.microbatches}")
        if self.microbatches < self.stages:
            raise ValueError(f"microbatches must be >= stages={self.stages} for the 1F1B schedule, got "
                             f"{self.microbatches}")

    def unused(self) -> list[tuple[str, str]]:
        """The fields set away from the job's default that this run never reads, each with why: ``[(name, why)]``,
        empty when every given option acts. ``fgdiloco pretrain`` refuses such a command line, so an option never
        passes silently without effect. A timeout that the ``timeout`` shorthand set counts as ``timeout``.

        * a ``baseline``: every FG-DiLoCo setting but ``sync_every`` and ``seed``, ``timeout``, and the elastic
          workers' ``max_restarts`` and ``checkpoint_every`` (one torchelastic job, no checkpoints);
        * ``topology="allreduce"``: ``max_restarts`` and ``checkpoint_every`` (one torchelastic job);
        * ``error_feedback=False``: needs the lowrank codec and the exact topology (gossip keeps no residual);
        * ``stage_embeddings=False``: needs ``subspace_rank`` and ``stages > 1``; ``microbatches``: ``stages > 1``;
        * ``vocab_size``: the bpe tokenizer (bytes have 256 symbols).
        """
        d = TrainConfig()
        given = {n for n in self.names() if n not in ("out", "run_id") and getattr(self, n) != getattr(d, n)}
        if self.timeout is not None:
            given -= {n for n in TIMEOUT_FIELDS if getattr(self, n) == self.timeout}
        why: dict[str, str] = {}
        if self.baseline is not None:
            reason = f"the {self.baseline} baseline does not run FG-DiLoCo"
            why.update((n, reason) for n in (*_SETTINGS, "timeout", "error_feedback")
                       if n not in ("sync_every", "seed"))
        if not self.elastic:
            why.update((n, "only elastic runs (FG-DiLoCo with a gossip topology) restart workers and keep "
                           "checkpoints") for n in ("max_restarts", "checkpoint_every"))
        if self.baseline is None and not (self.topology == "allreduce" and str(self.codec).lower() == "lowrank"):
            why["error_feedback"] = ("only the lowrank codec on the exact topology (allreduce) keeps an error-feedback "
                                     "residual; pairwise gossip exchanges never use one")
        if self.stages == 1 or self.subspace_rank is None:
            why["stage_embeddings"] = "stage embeddings exist only with --subspace-rank and --stages > 1"
        if self.stages == 1:
            why["microbatches"] = "microbatches split a batch between pipeline stages (--stages > 1)"
        if self.tokenizer == "bytes":
            why["vocab_size"] = "the bytes tokenizer has 256 symbols (--vocab-size is the bpe tokenizer's)"
        return [(n, why[n]) for n in self.names() if n in given and n in why]

    # ------------------------------------------------------------------ derived
    @property
    def replicas(self) -> int:
        """Model replicas R = ``workers / stages`` (each one pipeline of ``stages`` workers)."""
        return self.workers // self.stages

    @property
    def elastic(self) -> bool:
        """Whether ``fgdiloco pretrain`` runs this configuration on elastic workers (each replica its own
        ``torchrun`` job with restarts, :mod:`fgdiloco.elastic`; a pipeline replica's ``stages`` processes fail and
        restart together): FG-DiLoCo with a gossip topology. Baselines and the exact ``"allreduce"`` topology need
        one process group: one torchelastic job, where one death ends the job."""
        return self.baseline is None and self.topology != "allreduce"

    @property
    def round_steps(self) -> int:
        """Inner steps per outer round of the run's rows and checkpoints: ``sync_every``, or ``sync_every /
        fragments`` with fragments (every fragment's sync is one outer round of the wrapper,
        ``FGDiLoCo.steps_per_round``)."""
        return self.sync_every if self.baseline is not None else self.sync_every // fragment_count(self.fragments)

    @property
    def rounds(self) -> int:
        """Outer rounds per run (the last one may be shorter than :attr:`round_steps`)."""
        return -(-self.steps // self.round_steps)


_SETTINGS = tuple(FGDiLoCoConfig.names())


# ---------------------------------------------------------------------------------------------------- flags
def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`TrainConfig` field to ``parser`` (``fgdiloco pretrain``'s): the job's own fields
    by their groups, and every ``FGDiLoCoConfig`` setting through :func:`fgdiloco.config.add_arguments` (with the
    job's defaults, :data:`DEPARTURES` noted in the help). Each flag's ``dest`` is the field name; fields without
    a flag (``out``, ``run_id``, the benchmarks' switches) keep their defaults."""
    groups = {JOB_GROUPS[0]: parser.add_argument_group(JOB_GROUPS[0])}
    _add_job_flags(groups, JOB_GROUPS[:1])
    notes = {name: f"differs from FGDiLoCo's default {getattr(FGDiLoCoConfig, name)!r}: {d.reason}"
             for name, d in DEPARTURES.items()}
    notes["seed"] = "here also the seed of the model's initialisation and of the batches"
    notes["codec_rank"] = f"the lowrank codec's own is {LowRank().rank}; --rank is its older name"
    groups.update(add_fgdiloco_arguments(parser, defaults={n: d.default for n, d in DEPARTURES.items()},
                                         notes=notes, aliases={"codec_rank": ("--rank",)}))
    groups.update({name: parser.add_argument_group(name) for name in JOB_GROUPS[1:]})
    _add_job_flags(groups, ("gossip", *JOB_GROUPS[1:]))


def _add_job_flags(groups: dict[str, Any], which: tuple[str, ...]) -> None:
    for f in dataclasses.fields(TrainConfig):
        m = f.metadata
        if m.get("fgdiloco") or m["flag"] is None or m["group"] not in which:
            continue
        g = groups[m["group"]]
        help_text = m["help"] + ("%(default).0s" if f.default is None or isinstance(f.default, bool) else "")
        if m["flag"]:  # a switch: --quiet, --no-error-feedback
            g.add_argument(m["flag"], dest=f.name, action="store_false" if f.default else "store_true",
                           default=f.default, help=help_text)
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text}
        check = m["check"]
        if isinstance(check, (_Choices, Choice)):
            kw["choices"] = list(check.choices if isinstance(check, _Choices) else check.names())
        elif check is not None:
            kw["type"] = check.parse
        if m["metavar"]:
            kw["metavar"] = m["metavar"]
        g.add_argument("--" + f.name.replace("_", "-"), **kw)

