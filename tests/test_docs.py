"""Every fenced code block of README.md, docs/*.md, benchmarks/RESULTS.md and CHANGELOG.md runs as written, or, for
long commands, parses; every relative link of these files points at a file (and heading) that exists.

A block's treatment is the HTML comment on the line right before its opening fence, ``<!-- run: MODE -->``:

* ``python``: the block is a complete script, run as ``__main__`` in a fresh temporary folder; it must end
  without an exception. To pay torch's import once, all such blocks run one after the other in one subprocess
  (``runpy.run_path``, each with fresh globals): a block that only works after another one would still pass, so keep
  each block self-contained (the ``slow`` form below runs it alone).
* ``python slow``: run alone as ``python block.py`` in a fresh temporary folder, in the slow tier; it must exit with
  status 0. Lightning scripts are run this way: Lightning's launcher re-executes the script for each process, so it
  runs as its own ``python`` process, never inside pytest's.
* ``torchrun N``: run as ``python -m torch.distributed.run --standalone --nproc-per-node N block.py`` (slow).
* ``launch N``: run as an elastic job, ``fgdiloco launch --workers N --max-restarts 0 block.py`` (slow).
* ``shell`` / ``shell slow``: every command of the block is run in a fresh temporary folder (``fgdiloco`` as
  ``python -m fgdiloco`` of this checkout, ``python`` as this interpreter, ``torchrun`` as
  ``python -m torch.distributed.run``); each must exit with status 0.
* ``parse``: every command is checked without running it (the long runs, benchmarks, multi-machine commands):

  - ``fgdiloco ARGS``: ``fgdiloco.cli.build_parser().parse_args(ARGS)`` accepts them; for ``fgdiloco launch`` with
    a script of this repository, that script's parser accepts the script's arguments too (as below);
  - ``python FILE ARGS`` / ``python -m MODULE ARGS``: the program runs up to its ``ArgumentParser.parse_args``,
    which must accept ARGS, and is stopped there (one subprocess checks all such commands);
  - ``torchrun [OPTIONS] FILE ARGS``: torchrun's own parser accepts OPTIONS, and FILE ARGS as above when FILE is in
    this repository;
  - ``python -m pytest ARGS``: every ``-m`` marker is registered in pyproject.toml and every path exists;
  - ``pip install ...``: every requirement is valid and every ``.[extra]`` exists in pyproject.toml.

In shell blocks ``#`` starts a comment, a trailing backslash continues the command, and leading ``NAME=value``
assignments (set in the environment when run) and ``sudo`` (dropped) may precede the program.

Blocks fenced as ``text`` are output, not run, and take no comment. Every other block must have one
(:func:`test_every_block_has_a_treatment`). Slow blocks are marked ``slow``: ``pytest -m "not slow"`` leaves them out.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md",
             ROOT / "CHANGELOG.md"]
MARKER = re.compile(r"<!--\s*run:\s*(.*?)\s*-->")
FENCE = re.compile(r"^\s*(`{3,})([\w+-]*)\s*$")
OUTPUT = {"text"}
MODES = {"python": (0, 1), "torchrun": (1, 1), "launch": (1, 1), "shell": (0, 1), "parse": (0, 0)}
SLOW_ALWAYS = {"torchrun", "launch"}
TIMEOUT = 600


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    mode: str | None  # the marker's text, None without one

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        return (self.mode or "").split()[0] if self.mode else ""

    @property
    def slow(self) -> bool:
        words = (self.mode or "").split()
        return self.kind in SLOW_ALWAYS or words[-1:] == ["slow"]


def read_blocks(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``path`` and the problems found while reading (unclosed fences, orphan markers)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, problems, i = [], [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            if MARKER.fullmatch(lines[i].strip()) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                problems.append(f"{path.relative_to(ROOT)}:{i + 1}: a run marker not followed by a fence")
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        if j == len(lines):
            problems.append(f"{path.relative_to(ROOT)}:{i + 1}: unclosed fence")
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
        body = textwrap.dedent("\n".join(lines[i + 1 : j]) + "\n")
        blocks.append(Block(path, i + 1, lang, body, marker.group(1) if marker else None))
        i = j + 1
    return blocks, problems


def all_blocks() -> list[Block]:
    return [b for path in DOCUMENTS for b in read_blocks(path)[0]]


def mode_problem(block: Block) -> str | None:
    """Why ``block``'s treatment is not valid, or None."""
    if block.lang in OUTPUT:
        return f"{block.id}: an output block ({block.lang}) takes no run marker" if block.mode else None
    if block.mode is None:
        return f"{block.id}: a {block.lang or 'plain'} block without a <!-- run: MODE --> marker"
    words = block.mode.split()
    if words[0] not in MODES:
        return f"{block.id}: unknown mode {words[0]!r} (one of {', '.join(MODES)})"
    args = words[1:]
    if args[-1:] == ["slow"]:
        args = args[:-1]
    need, allowed = MODES[words[0]]
    if len(args) != need or (need and not args[0].isdigit()) or (words[-1] == "slow" and not allowed):
        return f"{block.id}: bad marker {block.mode!r}"
    if words[0] in ("python", "torchrun", "launch") and block.lang != "python":
        return f"{block.id}: mode {words[0]!r} needs a python block, not {block.lang!r}"
    if words[0] in ("shell", "parse") and block.lang not in ("bash", "sh", "shell"):
        return f"{block.id}: mode {words[0]!r} needs a bash block, not {block.lang!r}"
    return None


def commands(body: str) -> list[list[str]]:
    """The commands of a shell block, as argument lists (comments dropped, continuations joined)."""
    out, pending = [], ""
    for raw in body.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


def split_environment(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``NAME=value`` assignments and ``sudo``, then the command."""
    env = {}
    while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] == "sudo"):
        if words[0] != "sudo":
            name, _, value = words[0].partition("=")
            env[name] = value
        words = words[1:]
    return env, words


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(extra or {})}


def run(argv: list[str], cwd: Path, what: str, extra_env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(argv, cwd=cwd, env=environment(extra_env), capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (f"{what} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
                                  f"--- stderr\n{proc.stderr[-5000:]}")


# ---------------------------------------------------------------------------------------------------- parse mode
#: Runs programs up to their ArgumentParser.parse_args and stops them there: stdin holds [[kind, target, args], ...]
#: (kind "module" or "script"); stdout gets one result per request: None (parsed) or what went wrong.
DRY_RUNNER = r"""
import argparse, contextlib, io, json, runpy, sys, traceback

class Parsed(Exception):
    pass

original = argparse.ArgumentParser.parse_args

def parse_args(self, args=None, namespace=None):
    original(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
results = []
for kind, target, args in json.load(sys.stdin):
    err = io.StringIO()
    sys.argv = [target, *args]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        results.append("the program ended without parsing its arguments")
    except Parsed:
        results.append(None)
    except SystemExit as e:
        results.append(f"exit status {e.code}: {err.getvalue().strip()[-2000:]}")
    except BaseException:
        results.append(traceback.format_exc()[-3000:])
print("DRY-RESULTS " + json.dumps(results))
"""


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def script_request(words: list[str]) -> tuple[str, str, tuple[str, ...]] | str:
    """The dry-run request for ``FILE ARGS`` or ``-m MODULE ARGS``, or why there is none."""
    if words[:1] == ["-m"] and len(words) >= 2:
        return ("module", words[1], tuple(words[2:]))
    if words and words[0].endswith(".py"):
        path = ROOT / words[0]
        if not path.is_file():
            return f"{words[0]} is not a file of this repository"
        return ("script", str(path), tuple(words[1:]))
    return f"cannot tell the program of {shlex.join(words)!r}"


def check_pytest(args: list[str]) -> list[str]:
    markers = {m.split(":")[0].strip() for m in pyproject()["tool"]["pytest"]["ini_options"].get("markers", [])}
    problems, i = [], 0
    while i < len(args):
        a = args[i]
        if a == "-m":
            names = set(re.findall(r"[A-Za-z_]\w*", args[i + 1])) - {"and", "or", "not"}
            problems += [f"pytest marker {n!r} is not registered in pyproject.toml" for n in sorted(names - markers)]
            i += 2
            continue
        if not a.startswith("-") and not (ROOT / a.split("::")[0]).exists():
            problems.append(f"pytest path {a!r} does not exist")
        i += 1
    return problems


def check_pip(args: list[str]) -> list[str]:
    from packaging.requirements import InvalidRequirement, Requirement

    if args[:1] != ["install"]:
        return [f"only 'pip install' is checked, got {shlex.join(['pip', *args])!r}"]
    extras = set(pyproject()["project"].get("optional-dependencies", {}))
    problems = []
    for a in args[1:]:
        if a.startswith("-"):
            continue
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", a)
        if m:
            problems += [f"pip extra {e!r} is not in pyproject.toml" for e in (m.group(1) or "").split(",")
                         if e and e not in extras]
            continue
        try:
            Requirement(a)
        except InvalidRequirement as e:
            problems.append(f"not a valid requirement: {a!r} ({e})")
    return problems


def plan(words: list[str]) -> tuple[list[str], list[tuple[str, str, tuple[str, ...]]]]:
    """Check one command of a parse block: ``(problems found here, dry-run requests for the subprocess)``."""
    _, words = split_environment(words)
    program, args = words[0], words[1:]
    problems: list[str] = []
    requests: list[tuple[str, str, tuple[str, ...]]] = []

    def want(request: tuple[str, str, tuple[str, ...]] | str) -> None:
        (problems if isinstance(request, str) else requests).append(request)

    if program == "fgdiloco":
        from fgdiloco.cli import build_parser

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                ns = build_parser().parse_args(args)
        except SystemExit as e:
            return [f"fgdiloco {shlex.join(args)}: exit status {e.code}: {err.getvalue().strip()}"], []
        if getattr(ns, "command", None) == "launch":
            script = ns.script[1:] if ns.script[:1] == ["--"] else ns.script
            if script[:1] == ["-m"] or (script and (ROOT / script[0]).is_file()):
                want(script_request(script))
    elif program == "python" and args[:2] == ["-m", "pytest"]:
        problems += check_pytest(args[2:])
    elif program == "python":
        want(script_request(args))
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = get_args_parser().parse_args(args)
        except SystemExit as e:
            return [f"torchrun {shlex.join(args)}: exit status {e.code}: {err.getvalue().strip()}"], []
        script = [ns.training_script, *ns.training_script_args]
        if ns.module:
            want(("module", ns.training_script, tuple(ns.training_script_args)))
        elif (ROOT / ns.training_script).is_file():
            want(script_request(script))
    elif program == "pip":
        problems += check_pip(args)
    else:
        problems.append(f"no parse check for the program {program!r}")
    return problems, requests


@pytest.fixture(scope="session")
def dry_results(tmp_path_factory) -> dict[tuple[str, str, tuple[str, ...]], str | None]:
    """Every dry-run request of every parse block, run in one subprocess."""
    requests = []
    for block in all_blocks():
        if block.kind == "parse" and mode_problem(block) is None:
            for words in commands(block.body):
                requests += [r for r in plan(words)[1] if r not in requests]
    if not requests:
        return {}
    cwd = tmp_path_factory.mktemp("dry")
    proc = subprocess.run([sys.executable, "-c", DRY_RUNNER], input=json.dumps(requests), cwd=cwd,
                          env=environment(), capture_output=True, text=True, timeout=TIMEOUT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("DRY-RESULTS ")), None)
    assert line is not None, f"the dry runner failed ({proc.returncode}):\n{proc.stderr[-5000:]}"
    return dict(zip(requests, json.loads(line[len("DRY-RESULTS "):])))


# ---------------------------------------------------------------------------------------------------- python mode
#: Runs scripts one after the other as ``__main__``: stdin holds [[script, folder], ...]; stdout gets one result per
#: script: None (ended normally) or what went wrong, with the script's output.
SCRIPT_RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback

results = []
for script, folder in json.load(sys.stdin):
    out = io.StringIO()
    os.chdir(folder)
    sys.argv = [script]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
        results.append(None)
    except SystemExit as e:
        results.append(None if e.code in (None, 0) else f"exit status {e.code}\n{out.getvalue()[-3000:]}")
    except BaseException:
        results.append(f"{out.getvalue()[-3000:]}\n{traceback.format_exc()[-4000:]}")
print("SCRIPT-RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="session")
def python_results(tmp_path_factory) -> dict[str, str | None]:
    """Every fast ``python`` block, run in one subprocess: block id -> None (passed) or what went wrong."""
    blocks = [b for b in all_blocks() if b.kind == "python" and not b.slow and mode_problem(b) is None]
    jobs = []
    for block in blocks:
        folder = tmp_path_factory.mktemp("block")
        (folder / "block.py").write_text(block.body, encoding="utf-8")
        jobs.append([str(folder / "block.py"), str(folder)])
    proc = subprocess.run([sys.executable, "-c", SCRIPT_RUNNER], input=json.dumps(jobs), env=environment(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("SCRIPT-RESULTS ")), None)
    assert line is not None, f"the script runner failed ({proc.returncode}):\n{proc.stderr[-5000:]}"
    return dict(zip([b.id for b in blocks], json.loads(line[len("SCRIPT-RESULTS "):])))


# ---------------------------------------------------------------------------------------------------- the tests
def test_every_block_has_a_treatment():
    problems = []
    for path in DOCUMENTS:
        blocks, found = read_blocks(path)
        problems += found + [p for p in map(mode_problem, blocks) if p]
    assert not problems, "\n".join(problems)


def test_documents_exist():
    missing = [str(p.relative_to(ROOT)) for p in DOCUMENTS if not p.is_file()]
    names = {p.name for p in DOCUMENTS}
    assert not missing and {"settings.md", "gossip.md", "faults.md", "pipelines.md", "lightning.md", "design.md",
                            "pretrain.md"} <= names, missing


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The heading anchors of a markdown file, as GitHub makes them (lower case, punctuation dropped, spaces to
    hyphens; code blocks skipped)."""
    out, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_links():
    problems = []
    for doc in DOCUMENTS:
        text = re.sub(r"(?ms)^\s*```.*?^\s*```", "", doc.read_text(encoding="utf-8"))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                problems.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{doc.relative_to(ROOT)}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def _params() -> list:
    out = []
    for block in all_blocks():
        if block.lang in OUTPUT or mode_problem(block) is not None:
            continue
        out.append(pytest.param(block, id=block.id, marks=[pytest.mark.slow] if block.slow else []))
    return out


@pytest.mark.parametrize("block", _params())
def test_block(block: Block, tmp_path: Path, request):
    kind, words = block.kind, block.mode.split()
    if kind == "parse":
        results = request.getfixturevalue("dry_results")
        problems = []
        for command in commands(block.body):
            found, requests = plan(command)
            problems += [f"{shlex.join(command)}: {p}" for p in found]
            problems += [f"{shlex.join(command)}: {r[1]} {shlex.join(r[2])}: {results[r]}" for r in requests
                         if results[r] is not None]
        assert not problems, "\n".join(problems)
        return
    if kind == "shell":
        for command in commands(block.body):
            env, argv = split_environment(command)
            program = {"fgdiloco": [sys.executable, "-m", "fgdiloco"], "python": [sys.executable],
                       "torchrun": [sys.executable, "-m", "torch.distributed.run"]}.get(argv[0])
            assert program is not None, f"{block.id}: no way to run {argv[0]!r}"
            run(program + argv[1:], tmp_path, shlex.join(command), env)
        return
    if kind == "python" and not block.slow:
        result = request.getfixturevalue("python_results")[block.id]
        assert result is None, f"{block.id} failed:\n{result}"
        return
    script = tmp_path / "block.py"
    script.write_text(block.body, encoding="utf-8")
    if kind == "python":
        argv = [sys.executable, str(script)]
    elif kind == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", words[1],
                str(script)]
    else:
        assert kind == "launch"
        argv = [sys.executable, "-m", "fgdiloco", "launch", "--workers", words[1], "--max-restarts", "0",
                str(script)]
    run(argv, tmp_path, f"{block.id} ({block.mode})")
