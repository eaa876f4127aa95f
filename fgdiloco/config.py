"""The settings of Factored Gossip DiLoCo, in one place: :class:`FGDiLoCoConfig`.

Every setting is one field of a frozen dataclass, with its default, its unit, its check and its help written once,
here. ``FGDiLoCo(model, inner, config=None, **overrides)``, the Lightning strategy, the example job
(``TrainConfig``), the ``fgdiloco pretrain`` flags and the benchmarks all take this object (or its field names as
keywords), so a setting is added, documented and validated in exactly one place.

Validation runs from the field definitions (:class:`Check`: "an int >= k", "seconds > 0", "a number in [a, b)", "a
name from a registry"): a wrong value raises ``TypeError`` / ``ValueError`` naming the field and what is allowed,
before anything is built.

Deadlines are named for what they bound (seconds):

* ``join_timeout``: a peer's arrival for an exchange, up to its first payload (also the wait for the gossip store
  and for a live peer's state when joining a running job);
* ``exchange_timeout``: the rest of a started exchange (the adaptive deadline of :class:`fgdiloco.gossip.Mixer`
  never exceeds it);
* ``liveness``: heartbeat silence after which a peer is taken for dead or hung (its partner stops waiting);
* ``collective_timeout``: one collective of the exact (``"allreduce"``) topology;
* ``stage_timeout``: one stage-to-stage transfer of a pipeline (:class:`fgdiloco.ReplicaMesh`);
* ``store_timeout``: how long a worker trains on without gossip while its job's store is out of reach; then it
  stops with :class:`fgdiloco.elastic.StoreUnreachable`. An elastic worker reconnects meanwhile (a restarted
  store); in a fixed ``torch.distributed`` group the store died with the process that served it (rank 0, or the
  launcher), so the survivors stop instead of outliving their job.

``timeout=`` is a shorthand: it sets ``join_timeout``, ``exchange_timeout``, ``collective_timeout`` and
``stage_timeout`` (each one not given explicitly), which is what the single ``timeout`` of earlier versions bounded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

__all__ = ["FGDiLoCoConfig", "fragment_count", "Check", "Count", "Number", "Seconds", "Flag", "Choice", "Integer",
           "settings_table", "add_arguments", "from_arguments"]


# ---------------------------------------------------------------------------------------------------- checks
class Check:
    """How one setting is validated and normalised: ``check(name, value) -> value``; raises ``TypeError`` (wrong
    type) or ``ValueError`` (out of range) naming ``name`` and what is allowed (:attr:`allowed`)."""

    allowed: str = "any value"

    def __call__(self, name: str, value: Any) -> Any:
        return value

    def parse(self, text: str) -> Any:
        """The value of a command-line string (argparse ``type``)."""
        return text

    def parse_in_range(self, text: str) -> Any:
        """:meth:`parse`, then the range check, both as argparse's one-line error (``argument --bandwidth:
        expected a number in (0, inf), got '0'``): for options that are not settings (those are checked by
        ``validate``)."""
        try:
            return self("value", self.parse(text))
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {self.allowed}, got {text!r}") from None


class Count(Check):
    """An int >= ``minimum`` (bools are refused)."""

    def __init__(self, minimum: int, what: str = ""):
        self.minimum = minimum
        self.allowed = f"an int >= {minimum}" + (f" ({what})" if what else "")

    def __call__(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be {self.allowed}, got {type(value).__name__}")
        if value < self.minimum:
            raise ValueError(f"{name} must be {self.allowed}, got {value}")
        return value

    def parse(self, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.allowed}, got {text!r}") from None


class Integer(Check):
    """Any int (bools refused)."""

    def __init__(self, what: str = ""):
        self.allowed = "an int" + (f" ({what})" if what else "")

    def __call__(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be {self.allowed}, got {type(value).__name__}")
        return value

    def parse(self, text: str) -> int:
        return Count.parse(self, text)  # type: ignore[arg-type]


class Number(Check):
    """A finite real number in a range: ``(low, high)`` with each end open or closed."""

    def __init__(self, low: float, high: float | None = None, *, low_ok: bool = False, high_ok: bool = False,
                 allowed: str | None = None):
        self.low, self.high, self.low_ok, self.high_ok = low, high, low_ok, high_ok
        if allowed is None:
            left = "[" if low_ok else "("
            right = ("]" if high_ok else ")") if high is not None else ")"
            allowed = f"a number in {left}{low:g}, {'inf' if high is None else f'{high:g}'}{right}"
        self.allowed = allowed

    def __call__(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be {self.allowed}, got {type(value).__name__}")
        ok = math.isfinite(value) and (value >= self.low if self.low_ok else value > self.low)
        if self.high is not None:
            ok = ok and (value <= self.high if self.high_ok else value < self.high)
        if not ok:
            raise ValueError(f"{name} must be {self.allowed}, got {value!r}")
        return float(value)

    def parse(self, text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.allowed}, got {text!r}") from None


class Seconds(Number):
    """A finite number of seconds > 0 (at least ``minimum`` when given)."""

    def __init__(self, minimum: float = 0.0):
        super().__init__(minimum, low_ok=minimum > 0,
                         allowed=f"seconds {'>=' if minimum > 0 else '>'} {minimum:g} (a finite number)")


class Flag(Check):
    """A bool."""

    allowed = "a bool"

    def __call__(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        return value

    def parse(self, text: str) -> bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class Choice(Check):
    """A name from a registry (``names()``, looked up when checked, so registered extensions count), or an
    instance of ``kind`` (e.g. a :class:`~fgdiloco.factor.Codec` or :class:`~fgdiloco.gossip.Topology`)."""

    def __init__(self, names: Callable[[], list[str]], kind: Callable[[], type] | None = None, what: str = ""):
        self.names = names
        self.kind = kind
        self.what = what

    @property
    def allowed(self) -> str:  # type: ignore[override]
        extra = f" or a {self.what}" if self.what else ""
        return f"one of {', '.join(repr(n) for n in self.names())}{extra}"

    def __call__(self, name: str, value: Any) -> Any:
        if self.kind is not None and isinstance(value, self.kind()):
            return value
        if not isinstance(value, str):
            raise TypeError(f"{name} must be {self.allowed}, got {type(value).__name__}")
        if value.lower() not in self.names():
            raise ValueError(f"{name} must be {self.allowed}, got {value!r}")
        return value.lower()


class Fragments(Check):
    """An int >= 1, or a non-empty list of fragments (modules or lists of parameters)."""

    allowed = "an int >= 1 or a list of nn.Modules / parameter lists"

    def __call__(self, name: str, value: Any) -> Any:
        if isinstance(value, bool):
            raise TypeError(f"{name} must be {self.allowed}, got bool")
        if isinstance(value, int):
            return Count(1)(name, value)
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"{name} must be {self.allowed}; got an empty {type(value).__name__} (a list needs at "
                                 "least one fragment)")
            return tuple(value)
        raise TypeError(f"{name} must be {self.allowed}, got {type(value).__name__}")

    def parse(self, text: str) -> int:
        return Count(1).parse(text)


#: Outer optimizers by name (``outer_optimizer="adam"``): built with ``outer_lr`` and ``outer_momentum`` (Adam's
#: first beta; the second is 0.999); ``"nesterov"`` is the default SGD with Nesterov momentum.
OUTER_OPTIMIZERS = ("nesterov", "sgd", "adam", "adamw")
#: ``outer_lr`` from which an Adam-type outer optimizer by name is warned about (:meth:`FGDiLoCoConfig.outer_lr_note`)
ADAM_OUTER_LR_WARN = 0.1


class OuterOptimizerCheck(Check):
    """None (Nesterov SGD), a name from :data:`OUTER_OPTIMIZERS`, or a callable ``params -> torch.optim.Optimizer``."""

    allowed = f"None, one of {', '.join(repr(n) for n in OUTER_OPTIMIZERS)}, or a callable params -> Optimizer"

    def __call__(self, name: str, value: Any) -> Any:
        if value is None or callable(value):
            return value
        if isinstance(value, str):
            if value.lower() not in OUTER_OPTIMIZERS:
                raise ValueError(f"{name} must be {self.allowed}, got {value!r}")
            return None if value.lower() == "nesterov" else value.lower()
        raise TypeError(f"{name} must be {self.allowed}, got {type(value).__name__}")

    def names(self) -> list[str]:
        return list(OUTER_OPTIMIZERS)


def _codec_names() -> list[str]:
    from .factor import codec_names  # the package registers every built-in codec

    return codec_names()


def _codec_kind() -> type:
    from .factor.codec import Codec

    return Codec


def _topology_names() -> list[str]:
    from .gossip.topology import TOPOLOGIES

    return sorted(TOPOLOGIES)


def _topology_kind() -> type:
    from .gossip.topology import Topology

    return Topology


def setting(default: Any, check: Check, help: str, *, unit: str = "", group: str = "outer loop",
            flag_help: str | None = None) -> Any:
    """A field of :class:`FGDiLoCoConfig`: its default, check, help text, unit and group, written once;
    ``flag_help``: the help of its command-line flag where that takes less than the library (names, not objects)."""
    return field(default=default, metadata={"check": check, "help": help, "unit": unit, "group": group,
                                            "flag_help": flag_help or help})


#: The deadlines ``timeout=`` sets (see the module docstring).
TIMEOUT_FIELDS = ("join_timeout", "exchange_timeout", "collective_timeout", "stage_timeout")
#: The heartbeat's period (seconds): a peer counts as gone after ``liveness`` without a beat, so liveness must span
#: several beats.
HEARTBEAT_SECONDS = 0.25


def fragment_count(fragments: Any) -> int:
    """F for the ``fragments`` setting: the int itself, or the length of the list of fragments."""
    return fragments if isinstance(fragments, int) else len(fragments)


@dataclass(frozen=True)
class FGDiLoCoConfig:
    """The settings of :class:`fgdiloco.FGDiLoCo` (Hewa Koneputugodage et al., "Factored Gossip DiLoCo", ICML 2026,
    arXiv 2606.22768). Frozen and validated at construction; ``dataclasses.replace(config, **changes)`` or
    :meth:`replace` gives a changed copy. Field by field (defaults in brackets):

    Outer loop:
        sync_every: H, inner steps per outer round [50].
        outer_lr: outer learning rate η [0.7] (DiLoCo's).
        outer_momentum: outer momentum μ in [0, 1) [0.9] (DiLoCo's, for hundreds of rounds; with a few dozen rounds
            0.3 overshoots less).
        nesterov: Nesterov momentum for the outer step [True] (ignored when ``outer_momentum`` is 0).
        fragments: F, fragments of the model, each with its own staggered outer round (Streaming DiLoCo, Douillard
            et al., arXiv 2501.18512): an int (contiguous runs of the parameters of about equal size) or a list of
            modules or parameter lists [1]. Must divide ``sync_every``.
        overlap_steps: τ, Streaming DiLoCo's ``fragment_sync_delay``: a fragment's Mix2 starts τ inner steps before
            its outer step and runs behind them [0: Mix2 blocks]; Mix2 then carries τ steps of delay (Mix1 stays
            staleness-free). Must be < ``sync_every / fragments``.
        merge_alpha: α, Streaming DiLoCo's ``fragment_update_alpha``: the fragment's parameters become
            ``α·θ_local + (1 − α)·θ_outer`` after its outer step (its next round still starts from ``θ_outer``) [0].
        outer_optimizer: None (SGD with Nesterov momentum, ``outer_lr``, ``outer_momentum``), ``"sgd"``,
            ``"adam"``, ``"adamw"`` (built with ``outer_lr`` and ``outer_momentum`` as the first beta) or a callable
            ``params -> torch.optim.Optimizer`` over the fp32 round-start parameters [None].

    Gossip:
        topology: ``"random"`` matching per gossip round, ``"exponential"``, ``"ring"`` or ``"allreduce"`` (exact
            average: DiLoCo), or a :class:`~fgdiloco.gossip.Topology` ["random"].
        mix1_rounds: gossip rounds of Mix1 (the non-blocking parameter mix) per outer round [1].
        mix2_rounds: gossip rounds of Mix2 (the blocking pseudo-gradient mix) per outer round [1]; 0 makes the
            synchronisation fully non-blocking.
        codec: Mix2's codec: a registered name (``"lowrank"``: factored low-rank pseudo-gradients, the point of this
            library; ``"dense"``, ``"bf16"``, ``"int8"``) or a :class:`~fgdiloco.factor.Codec` instance (used by one
            wrapper only: codecs keep per-tensor state) ["lowrank"]; ``"dense"`` is the better choice on fast links
            with few workers (``docs/settings.md``).
        codec_rank: rank of a ``"lowrank"`` codec given by name [None: the codec's own default, 4].
        mix1_codec: Mix1's codec, a stateless value codec (``"dense"``, ``"bf16"``, ``"int8"``) ["bf16"].
        mix_momentum: Mix1 also carries the outer momentum buffers (twice Mix1's bytes, still hidden behind the
            inner steps) [True].
        seed: seed of the random gossip schedules (equal on every worker) [0].

    Deadlines (seconds; see the module docstring): ``join_timeout`` [60], ``exchange_timeout`` [60], ``liveness``
    [2], ``collective_timeout`` [60], ``stage_timeout`` [60], ``store_timeout`` [60]; ``timeout=`` sets
    ``join_timeout``, ``exchange_timeout``, ``collective_timeout`` and ``stage_timeout`` at once (those not given by
    name).

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range; the message names the field and what is
            allowed.
    """

    # outer loop
    sync_every: int = setting(50, Count(1, "inner steps H per outer round"), "H: inner steps per outer round",
                              unit="steps")
    outer_lr: float = setting(0.7, Number(0.0), "outer learning rate")
    outer_momentum: float = setting(0.9, Number(0.0, 1.0, low_ok=True),
                                    "outer momentum (Nesterov)")
    nesterov: bool = setting(True, Flag(), "Nesterov momentum for the outer step (ignored without momentum)")
    # gossip
    topology: Any = setting("random", Choice(_topology_names, _topology_kind, "fgdiloco.gossip.Topology"),
                            "gossip topology (allreduce: the exact average, i.e. DiLoCo)", group="gossip")
    mix1_rounds: int = setting(1, Count(0, "gossip rounds of Mix1"),
                               "gossip rounds of Mix1 (non-blocking parameter mix) per outer round", group="gossip")
    mix2_rounds: int = setting(1, Count(0, "gossip rounds of Mix2"),
                               "gossip rounds of Mix2 (blocking pseudo-gradient mix) per outer round",
                               group="gossip")
    codec: Any = setting("lowrank", Choice(_codec_names, _codec_kind, "fgdiloco.factor.Codec"), "Mix2's codec",
                         group="gossip")
    codec_rank: int | None = setting(None, Count(1, "rank of the low-rank codec"),
                                     "rank of a low-rank Mix2 codec given by name (default: the codec's own)",
                                     group="gossip")
    mix1_codec: Any = setting("bf16", Choice(_codec_names, _codec_kind, "fgdiloco.factor.Codec"),
                              "Mix1's codec (a stateless value codec)", group="gossip")
    mix_momentum: bool = setting(True, Flag(), "Mix1 also carries the outer momentum buffers", group="gossip")
    fragments: Any = setting(1, Fragments(), "F: fragments of the model with staggered outer rounds, one every H/F "
                             "steps (Streaming DiLoCo); a list gives the fragments themselves",
                             flag_help="F: fragments of the model with staggered outer rounds, one every H/F steps "
                                       "(Streaming DiLoCo)")
    overlap_steps: int = setting(0, Count(0, "inner steps"), "τ: a fragment's Mix2 starts this many inner steps "
                                 "before its outer step; the inner steps go on meanwhile (< H/F)", unit="steps")
    merge_alpha: float = setting(0.0, Number(0.0, 1.0, low_ok=True, high_ok=True), "α: after the outer step a "
                                 "fragment becomes α·local + (1 − α)·outer (Streaming DiLoCo's merge)")
    outer_optimizer: Any = setting(None, OuterOptimizerCheck(), "the outer optimizer: None (SGD with Nesterov "
                                   "momentum), 'sgd', 'adam', 'adamw', or a callable params -> torch.optim.Optimizer",
                                   flag_help="the outer optimizer: 'nesterov' (SGD with Nesterov momentum, the "
                                             "default), 'sgd', 'adam' or 'adamw'")
    seed: int = setting(0, Integer("all 64 bits count"), "seed of the random gossip schedules (equal on all "
                        "workers)", group="gossip")
    # deadlines
    join_timeout: float = setting(60.0, Seconds(), "a peer's arrival for an exchange, up to its first payload; "
                                  "also the wait for the gossip store and for a donor's state", unit="s",
                                  group="deadlines")
    exchange_timeout: float = setting(60.0, Seconds(), "the rest of an exchange once the peer's first payload "
                                      "came (the adaptive deadline never exceeds it)", unit="s", group="deadlines")
    liveness: float = setting(2.0, Seconds(4 * HEARTBEAT_SECONDS), "heartbeat silence after which a peer is taken "
                              "for dead or hung", unit="s", group="deadlines")
    collective_timeout: float = setting(60.0, Seconds(), "one collective of the exact (allreduce) topology",
                                        unit="s", group="deadlines")
    stage_timeout: float = setting(60.0, Seconds(), "one stage-to-stage transfer of a pipeline", unit="s",
                                   group="deadlines")
    store_timeout: float = setting(60.0, Seconds(), "how long a worker trains on without gossip while the job's "
                                   "store is out of reach; then it stops (StoreUnreachable)", unit="s",
                                   group="deadlines")
    timeout: InitVar[float | None] = None

    def __post_init__(self, timeout: float | None) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            object.__setattr__(self, f.name, f.metadata["check"](f.name, value))
        if timeout is not None:  # the constructor cannot tell a timeout given at its default value from one left
            seconds = Seconds()("timeout", timeout)  # out: it sets those at their default (build() and replace()
            for name in TIMEOUT_FIELDS:  # set those not given by name)
                if getattr(self, name) == _DEFAULTS[name]:
                    object.__setattr__(self, name, seconds)
        from .factor import resolve_codec

        mix1 = self.mix1_codec
        if isinstance(mix1, str):
            mix1 = resolve_codec(mix1, default="bf16", argument="mix1_codec")
        if mix1.stateful:
            raise ValueError(f"mix1_codec={self.mix1_codec!r} keeps per-worker state (warm starts or error "
                             "feedback), which is not safe for parameters; use a stateless value codec: 'dense' "
                             "(lossless), 'bf16' (default) or 'int8'")
        if self.codec_rank is not None:  # a rank for a codec that takes none is refused here, before anything runs
            resolve_codec(self.codec, default="lowrank", argument="codec", rank=self.codec_rank)
        count = fragment_count(self.fragments)
        if self.sync_every % count:
            raise ValueError(f"fragments={count} must divide sync_every={self.sync_every} (one fragment's outer "
                             "round ends every sync_every / fragments inner steps)")
        if self.overlap_steps >= self.sync_every // count:
            raise ValueError(f"overlap_steps must be < sync_every / fragments = {self.sync_every // count} (a "
                             f"fragment's Mix2 must end before the next fragment's starts), got {self.overlap_steps}")
        if self.codec is self.mix1_codec and not isinstance(self.codec, str):
            raise ValueError("codec and mix1_codec must be different Codec instances: a codec keeps per-tensor "
                             "state (error feedback, warm start) and the two mixes run in different threads")

    # ------------------------------------------------------------------ building and changing
    @classmethod
    def build(cls, config: FGDiLoCoConfig | None = None, /, **overrides: Any) -> FGDiLoCoConfig:
        """``config`` (default: the defaults) with ``overrides`` applied; the one way every entry point turns its
        arguments into settings.

        Raises:
            TypeError: ``config`` is not an FGDiLoCoConfig, or an unknown setting name (listing the known ones);
                and the field checks' errors.
        """
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be a fgdiloco.FGDiLoCoConfig or None, got {type(config).__name__}")
        unknown = sorted(set(overrides) - set(cls.names()) - {"timeout"})
        if unknown:
            raise TypeError(f"unknown FGDiLoCo setting(s) {', '.join(unknown)}; the settings are "
                            f"{', '.join(cls.names())} (and timeout=, which sets {', '.join(TIMEOUT_FIELDS)})")
        if config is None:  # through replace: timeout= then sets only the timeouts not given by name
            return cls().replace(**overrides) if "timeout" in overrides else cls(**overrides)
        return config.replace(**overrides) if overrides else config

    def replace(self, **changes: Any) -> FGDiLoCoConfig:
        """A copy with ``changes`` (validated); ``timeout=`` sets the four timeouts not given in ``changes``."""
        timeout = changes.pop("timeout", None)
        if timeout is not None:
            seconds = Seconds()("timeout", timeout)
            for name in TIMEOUT_FIELDS:
                changes.setdefault(name, seconds)
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> list[str]:
        """The settings' names, in definition order."""
        return [f.name for f in dataclasses.fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        """``{name: value}``; a codec or topology instance is given by its name."""
        return {n: getattr(getattr(self, n), "name", getattr(self, n)) for n in self.names()}

    @property
    def exit_wait(self) -> float:
        """The longest an exchange given up on can still run (seconds): what the exit drain waits at most."""
        return max(self.join_timeout + self.exchange_timeout, self.collective_timeout)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.as_dict().items())

    def outer_lr_note(self) -> str | None:
        """A word on an ``outer_lr`` that suits Nesterov SGD but not the Adam-type outer optimizer named
        (``outer_optimizer="adam"``/``"adamw"`` with ``outer_lr >= ADAM_OUTER_LR_WARN``): Adam normalises the
        pseudo-gradient, so every parameter moves by up to about ``outer_lr`` per outer round whatever its size.
        None otherwise. ``FGDiLoCo`` warns with it; ``fgdiloco pretrain`` says it before it starts."""
        name = self.outer_optimizer.lower() if isinstance(self.outer_optimizer, str) else None
        if name not in ("adam", "adamw") or self.outer_lr < ADAM_OUTER_LR_WARN:
            return None
        return (f"outer_optimizer={name!r} with outer_lr={self.outer_lr:g}: Adam normalises the pseudo-gradient, so "
                f"every parameter moves by up to about {self.outer_lr:g} per outer round whatever its size (outer_lr "
                "0.7 is Nesterov SGD's setting, where it scales the pseudo-gradient); give Adam a step on the "
                "parameters' own scale, e.g. a few times the inner learning rate")


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(FGDiLoCoConfig)}


# ---------------------------------------------------------------------------------------------------- views
def settings_table() -> str:
    """The Markdown reference table of every setting (name, default, unit, allowed values, meaning), as
    ``docs/settings.md`` holds it (a test keeps the page equal to this)."""
    lines = ["| setting | default | unit | allowed | what it sets |", "| --- | --- | --- | --- | --- |"]
    for f in dataclasses.fields(FGDiLoCoConfig):
        m = f.metadata
        default = "None" if f.default is None else repr(f.default)
        lines.append(f"| `{f.name}` | `{default}` | {m['unit'] or ''} | {m['check'].allowed} | {m['help']} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser, *, defaults: Mapping[str, Any] | None = None,
                  exclude: tuple[str, ...] = (), notes: Mapping[str, str] | None = None,
                  aliases: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, argparse._ArgumentGroup]:
    """Add one ``--flag`` per setting (``--sync-every``, ``--join-timeout``, ...) to ``parser``, in argument groups
    named after the settings' groups, with help and checks from the fields, and ``--timeout`` (the shorthand).

    ``defaults`` replaces a field's default on this command (say why in ``notes[name]``, appended to its help);
    ``aliases[name]``: more option strings for a setting's flag (a command's older names); string choices (codec,
    topology) are listed from their registries. Each flag's ``dest`` is the field name; a default of None is not
    printed (the help says what None means). Returns the argument groups by the settings' group names
    (``"outer loop"``, ``"gossip"``, ``"deadlines"``), for a command's own flags that belong beside them.
    """
    defaults = dict(defaults or {})
    notes = dict(notes or {})
    aliases = dict(aliases or {})
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(FGDiLoCoConfig):
        if f.name in exclude:
            continue
        m = f.metadata
        check: Check = m["check"]
        title = {"outer loop": "outer loop", "gossip": "gossip", "deadlines": "deadlines (seconds)"}[m["group"]]
        g = groups.setdefault(m["group"], parser.add_argument_group(title))
        default = defaults.get(f.name, f.default)
        kw: dict[str, Any] = {"dest": f.name, "default": default,
                              "help": m["flag_help"] + (f"; {notes[f.name]}" if f.name in notes else "")}
        if hasattr(check, "names"):
            kw["choices"] = check.names()
        elif isinstance(check, Flag):
            kw["type"] = check.parse
            kw["metavar"] = "{true,false}"
        else:
            kw["type"] = check.parse
        if default is None:  # not "(default: None)": the help says what None means
            kw["help"] += "%(default).0s"
        g.add_argument("--" + f.name.replace("_", "-"), *aliases.get(f.name, ()), **kw)
    if "timeout" not in exclude:
        g = groups.setdefault("deadlines", parser.add_argument_group("deadlines (seconds)"))
        g.add_argument("--timeout", dest="timeout", type=Seconds().parse, default=None, metavar="S",
                       help="shorthand: sets " + ", ".join("--" + n.replace("_", "-") for n in TIMEOUT_FIELDS)
                            + " (those not given)%(default).0s")
    return groups


def from_arguments(args: argparse.Namespace | Mapping[str, Any], **fixed: Any) -> FGDiLoCoConfig:
    """The :class:`FGDiLoCoConfig` of parsed arguments (from :func:`add_arguments`): every setting found in
    ``args`` by its field name, then ``fixed``; ``timeout`` sets the four timeouts the command line left at their
    defaults."""
    values = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    chosen = {n: values[n] for n in FGDiLoCoConfig.names() if n in values}
    chosen.update(fixed)
    timeout = values.get("timeout")
    config = FGDiLoCoConfig(**chosen)
    if timeout is not None:
        config = config.replace(**{n: timeout for n in TIMEOUT_FIELDS if getattr(config, n) == _DEFAULTS[n]})
    return config
