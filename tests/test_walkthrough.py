"""The README's walk-through runs as written: two CSV files with overlapping customer ids → ``vfl align``
→ ``vfl train --party-files`` → ``vfl plot`` → a PNG (issue 17).

The commands are taken from README.md between the ``walkthrough`` marker comments, not copied here, so
the README cannot drift from what works.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- walkthrough:start -->", "<!-- walkthrough:end -->"

pytestmark = pytest.mark.mpi


def walkthrough_commands(readme: str) -> str:
    """The shell session between the markers, without its code fence."""
    assert readme.count(START) == 1 and readme.count(END) == 1, "one walk-through, between markers"
    block = readme.split(START, 1)[1].split(END, 1)[0].strip()
    fenced = re.fullmatch(r"```(?:bash|sh|console)?\n(.*)\n```", block, re.DOTALL)
    assert fenced, "the walk-through is one fenced code block"
    return fenced.group(1)


def test_readme_walkthrough_runs_as_written(tmp_path):
    commands = walkthrough_commands((REPO_ROOT / "README.md").read_text())
    assert "vfl align" in commands and "--party-files" in commands and "vfl plot" in commands
    (tmp_path / "examples").symlink_to(REPO_ROOT / "examples")   # as from the repository root
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "intersection: 499 ids common to all 2 parties" in output
    png = tmp_path / "runs" / "mine" / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    accuracy = re.search(r"test_accuracy ([0-9]+(?:\.[0-9]+)?)", output)  # the summary ends with "."
    assert accuracy, output
    assert 0.9 <= float(accuracy.group(1)) <= 1.0
    assert (tmp_path / "runs" / "mine" / "party-files" / "manifest.json").exists()   # converted once
