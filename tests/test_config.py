"""FGDiLoCoConfig: one frozen settings object validated from its field definitions, the timeout shorthand, the
command-line flags generated from the fields, the reference table in docs/settings.md, and every default written
once (an AST scan of the library's signatures)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fgdiloco import FGDiLoCoConfig
from fgdiloco.config import TIMEOUT_FIELDS, Count, Flag, Number, Seconds, add_arguments, from_arguments, settings_table

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name: f for f in dataclasses.fields(FGDiLoCoConfig)}


def test_defaults_are_valid_and_the_object_is_frozen():
    c = FGDiLoCoConfig()
    assert c.sync_every == 50 and c.codec == "lowrank" and c.liveness == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.sync_every = 3  # type: ignore[misc]
    assert FGDiLoCoConfig.sync_every == 50  # each default readable where it is written


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if isinstance(f.metadata["check"], Count)])
@given(value=st.integers(max_value=-1))
def test_every_count_below_its_minimum_is_refused_naming_the_setting(name, value):
    minimum = FIELDS[name].metadata["check"].minimum
    with pytest.raises(ValueError, match=f"^{name} must be an int >= {minimum}"):
        FGDiLoCoConfig(**{name: minimum + value})


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items()
                                  if isinstance(f.metadata["check"], (Count, Number, Flag))])
@given(value=st.one_of(st.text(max_size=3), st.lists(st.integers(), max_size=2)))
def test_every_setting_refuses_a_value_of_the_wrong_type_naming_itself(name, value):
    with pytest.raises(TypeError, match=f"^{name} must be "):
        FGDiLoCoConfig(**{name: value})


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if isinstance(f.metadata["check"], Seconds)])
@given(value=st.one_of(st.floats(max_value=0.0), st.just(float("inf")), st.just(float("nan"))))
def test_every_deadline_must_be_finite_positive_seconds(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be seconds"):
        FGDiLoCoConfig(**{name: value})


def test_bools_are_not_counts_and_names_come_from_the_registries():
    with pytest.raises(TypeError, match="sync_every must be an int"):
        FGDiLoCoConfig(sync_every=True)
    with pytest.raises(ValueError, match="codec must be one of 'bf16', 'dense', 'int8', 'lowrank'"):
        FGDiLoCoConfig(codec="gzip")
    assert FGDiLoCoConfig(codec="LowRank").codec == "lowrank"  # names are case-insensitive, stored lower case


def test_a_codec_rank_needs_a_codec_given_by_name_that_takes_one():
    from fgdiloco.factor import LowRank

    assert FGDiLoCoConfig(codec="lowrank", codec_rank=8).codec_rank == 8
    with pytest.raises(ValueError, match=r"^codec_rank=8 applies to a codec that takes a rank \(lowrank\); "
                                         r"codec='dense' has none"):
        FGDiLoCoConfig(codec="dense", codec_rank=8)
    with pytest.raises(ValueError, match="^codec_rank=8 applies to a codec given by name; codec=LowRank"):
        FGDiLoCoConfig(codec=LowRank(4), codec_rank=8)


def test_an_empty_list_of_fragments_is_refused_as_empty():
    with pytest.raises(ValueError, match="^fragments must be an int >= 1 or a list .*; got an empty list"):
        FGDiLoCoConfig(fragments=[], sync_every=10)


def test_the_timeout_shorthand_sets_the_four_timeouts_not_given():
    c = FGDiLoCoConfig(timeout=7)
    assert [getattr(c, n) for n in TIMEOUT_FIELDS] == [7.0] * 4 and c.liveness == 2.0
    c = FGDiLoCoConfig(timeout=7, join_timeout=3)
    assert (c.join_timeout, c.exchange_timeout) == (3.0, 7.0)
    assert FGDiLoCoConfig().replace(timeout=9, stage_timeout=2).stage_timeout == 2.0
    assert FGDiLoCoConfig.build(timeout=4).collective_timeout == 4.0
    # a timeout given by name at its default value stays (FGDiLoCo(..., join_timeout=60, timeout=10) builds this way)
    c = FGDiLoCoConfig.build(join_timeout=60.0, timeout=10)
    assert (c.join_timeout, c.exchange_timeout) == (60.0, 10.0)
    with pytest.raises(ValueError, match="timeout must be seconds > 0"):
        FGDiLoCoConfig(timeout=-1)


def test_build_applies_overrides_and_names_unknown_settings():
    base = FGDiLoCoConfig(sync_every=10)
    assert FGDiLoCoConfig.build(base, mix2_rounds=2) == FGDiLoCoConfig(sync_every=10, mix2_rounds=2)
    assert FGDiLoCoConfig.build(base) is base
    with pytest.raises(TypeError, match=r"unknown FGDiLoCo setting\(s\) sync_evry; the settings are sync_every"):
        FGDiLoCoConfig.build(sync_evry=3)
    with pytest.raises(TypeError, match="config must be a fgdiloco.FGDiLoCoConfig"):
        FGDiLoCoConfig.build({"sync_every": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sync_every"):
        base.replace(sync_every=0)


def test_flags_are_generated_from_the_fields_and_give_the_same_object_back():
    p = argparse.ArgumentParser()
    add_arguments(p, defaults={"sync_every": 20}, notes={"sync_every": "a shorter job"})
    args = p.parse_args(["--codec", "lowrank", "--mix2-rounds", "2", "--liveness", "3", "--nesterov", "false",
                         "--timeout", "30", "--join-timeout", "12"])
    c = from_arguments(args)
    assert c == FGDiLoCoConfig(sync_every=20, codec="lowrank", mix2_rounds=2, liveness=3.0, nesterov=False,
                               join_timeout=12.0, exchange_timeout=30.0, collective_timeout=30.0, stage_timeout=30.0)
    text = p.format_help()
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in text, name
    assert "a shorter job" in text
    with pytest.raises(SystemExit):
        p.parse_args(["--codec", "gzip"])


def test_the_docs_reference_table_is_the_generated_one():
    page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    between = page.split("<!-- settings-table:start -->")[1].split("<!-- settings-table:end -->")[0]
    assert between.strip() == settings_table(), "regenerate with fgdiloco.config.settings_table()"


def test_every_settings_default_is_written_once():
    """No signature in the library repeats a setting's default: a parameter named after a setting (or
    ``timeout``) defaults to None or to the field itself (``FGDiLoCoConfig.<name>``). (``seed`` is left out: codecs,
    topologies and bases have seeds of their own; ``fgdiloco.testing``'s ``timeout`` bounds a test, not gossip.)"""
    names = (set(FIELDS) | {"timeout"}) - {"seed"}
    bad = []
    for path in sorted((ROOT / "fgdiloco").rglob("*.py")) + sorted((ROOT / "lightning_callbacks").rglob("*.py")):
        if path.name in ("config.py", "testing.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg in names and isinstance(default, ast.Constant) and default.value is not None:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({arg.arg}={default.value!r})")
    assert bad == []
