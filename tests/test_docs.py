"""The documentation says what the code and CI do: the README's quickstart is what ``.ci/run`` runs, its
command and exit-code tables match the CLI and ``parties.outcomes``, every doc is indexed, every relative
link resolves, and the test lanes name the markers ``pyproject.toml`` declares.

These read files only (no ``mpiexec``), so they run in the fast lane; the README's walk-through itself is
run by ``tests/test_walkthrough.py``.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from parties.outcomes import EXIT_CODES
from vfl.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINKED_DOCS = [README, ROOT / "CHANGELOG.md", ROOT / "experiments" / "results" / "README.md",
               *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250


def _fenced_commands(text: str) -> list[str]:
    """Every line of every fenced ``bash`` block."""
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def _pip_install_args(command: str) -> list[str]:
    """What a ``pip install`` installs, without ``python -m``, ``-q`` or the other commands on the line."""
    words = shlex.split(next(part for part in command.split("&&") if "pip install" in part))
    start = words.index("install") + 1
    return [w for w in words[start:] if w not in ("-q", "--quiet")]


def test_readme_stays_a_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; details belong in docs/"


def test_quickstart_is_what_ci_runs():
    """``.ci/run`` runs the README's two quickstart commands, in order: the install with the main job,
    then the test-suite install with the test command (``python -m pip`` and ``-q`` aside)."""
    quick = _fenced_commands(_section(README.read_text(), "Quickstart"))
    assert len(quick) == 2, quick
    main_job, test_suite = quick
    assert main_job.endswith("./mpirun.sh") and "pip install -e ." in main_job
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    ci_steps = [line for line in ci if "pip install" in line and "--upgrade pip" not in line]
    assert len(ci_steps) == 2, ci_steps
    for ci_step, readme_step in zip(ci_steps, (main_job, test_suite), strict=True):
        assert _pip_install_args(ci_step) == _pip_install_args(readme_step)
        assert ci_step.split("&&")[-1].strip() == readme_step.split("&&")[-1].strip()
    assert test_suite.split("&&")[-1].strip() == "python -m pytest" and ci[-1] == ci_steps[1]


def test_every_vfl_command_has_a_line_in_the_readme():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse keeps subparsers here
    commands = _section(README.read_text(), "Commands")
    for name in sub.choices:
        assert re.search(rf"`vfl {re.escape(name)}\b", commands), f"README 'Commands' lacks `vfl {name}`"
    for other in ("python -m parties.hfl", "python -m experiments", "./mpirun.sh"):
        assert other in commands, other


def test_exit_code_table_matches_outcomes():
    table = _section(README.read_text(), "Exit codes")
    codes = {int(code) for code in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)}
    assert codes == set(EXIT_CODES.values())


def test_every_doc_is_indexed():
    index = (ROOT / "docs" / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if doc.name != "README.md":
            assert f"]({doc.name})" in index, f"docs/README.md does not list {doc.name}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{doc.relative_to(ROOT)} links to missing {target}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{doc.relative_to(ROOT)}: no heading for #{anchor} in {file}"


def test_test_lanes_name_every_marker():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lanes = (ROOT / "docs" / "testing.md").read_text()
    for marker in config["markers"]:
        name = marker.split(":")[0]
        assert f"`{name}`" in lanes, f"docs/testing.md does not explain the {name} marker"
    assert 'python -m pytest -m "not mpi"' in lanes and ".ci/run" in lanes
