"""``vfl export``: every party of a trained q = 3 run writes its own part; recombined on one machine, the
parts score the test rows as ``vfl predict`` does. Parts read back as untrusted files are refused in one
line when damaged."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parties.export import PartyExport, combined_scores, part_paths, read_part, read_parts, write_part
from tests.conftest import REPO_ROOT

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def vfl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vfl.cli", *args], cwd=REPO_ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout, check=False)


def export(*args: str) -> subprocess.CompletedProcess:
    """``vfl export <args>`` in this process (what the command-line entry runs, without a fresh
    interpreter's second of imports): its exit code and what it printed, as from ``vfl``."""
    from vfl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["export", *args])
    return subprocess.CompletedProcess(["vfl", "export", *args], code, out.getvalue(), err.getvalue())


def ok(*args: str, timeout: float = 120) -> str:
    proc = export(*args[1:]) if args[0] == "export" else vfl(*args, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"vfl {args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A q = 3 breast-cancer run under ``--standardize center`` (a shift and a scale per column), each
    party's block in a folder of its own (``--party-dir``), and ``vfl predict``'s test scores."""
    base = tmp_path_factory.mktemp("export")
    out = base / "run"
    ok("train", "--out", str(out), "--no-progress", "-n", "3", "-m", "1", "--party-dir",
       str(base / "org{rank}"), "--epochs", "2", "--dataset", "breast-cancer", "--problem", "logistic",
       "--lam", "0.1", "--gamma", "0.02", "--standardize", "center", timeout=240)
    ok("predict", str(out))
    return out


@pytest.mark.mpi
def test_recombined_parts_score_as_vfl_predict(trained, tmp_path):
    from parties.loading import own_party_file, read_own_party
    from parties.resume import load_run

    for rank in range(3):
        line = ok("export", str(trained), "--party", str(rank), "--out", str(tmp_path))
        assert f"party {rank}: wrote" in line and "center" in line
    parts = read_parts(tmp_path)
    plan = load_run(trained)
    data = [read_own_party(own_party_file(plan.party_files, r), r == 0, "logistic") for r in range(3)]
    z = combined_scores(parts, [d.X_test for d in data])  # raw columns: each part scales its own
    table = np.loadtxt(trained / "predictions-test.csv", delimiter=",", skiprows=1)
    assert np.array_equal(table[:, 0].astype(np.int64), data[0].test_ids)
    np.testing.assert_allclose(z, table[:, 1], rtol=0, atol=1e-6)
    manifest = json.loads(part_paths(tmp_path, 1)[0].read_text())
    assert manifest["problem"] == "logistic" and manifest["link"] == "sigmoid"
    assert manifest["id_column"] == "id" and manifest["standardize"] == "center"
    assert manifest["n_features"] == data[1].n_features == parts[1].w.size
    assert np.array_equal(parts[1].columns, data[1].columns)  # the schema: its own global columns only
    assert sum(p.n_features for p in parts) == 30


@pytest.mark.mpi
def test_export_refuses_a_rank_the_run_lacks_and_an_existing_part(trained, tmp_path):
    proc = export(str(trained), "--party", "3", "--out", str(tmp_path))  # an exception would fail here
    assert proc.returncode == 2 and "0..2" in proc.stderr and len(proc.stderr.splitlines()) == 1
    ok("export", str(trained), "--party", "2", "--out", str(tmp_path))
    proc = export(str(trained), "--party", "2", "--out", str(tmp_path))
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    ok("export", str(trained), "--party", "2", "--out", str(tmp_path), "--overwrite")
    proc = export(str(trained), "--party", "2", "--out", str(tmp_path), "--data", str(tmp_path))
    assert proc.returncode == 2 and "--data is for a `vfl party` folder" in proc.stderr


def _part(rank: int = 0, **changes) -> PartyExport:
    fields = {"party": rank, "parties": 2, "problem": "least-squares", "epochs": 3.0,
              "w": np.array([1.0, -2.0, 0.5]), "standardize": "on", "shift": np.zeros(3),
              "scale": np.array([2.0, 1.0, 4.0]), "feature_names": ("age", "income", "debt")}
    return PartyExport(**(fields | changes))


def test_a_part_round_trips_and_scores_raw_columns(tmp_path):
    write_part(_part(), tmp_path)
    back = read_part(tmp_path, 0)
    assert back.feature_names == ("age", "income", "debt") and back.link == "identity"
    X = np.array([[2.0, 1.0, 4.0], [0.0, 0.0, 8.0]])
    np.testing.assert_allclose(back.partial_scores(X), [1.0 - 2.0 + 0.5, 1.0])


@pytest.mark.parametrize("damage", ["digest", "manifest", "unhashable", "shape", "nan", "pickle", "big",
                                    "wide-names"])
def test_a_damaged_part_is_refused_in_one_line(tmp_path, damage):
    json_path, npz_path = write_part(_part(), tmp_path)
    manifest = json.loads(json_path.read_text())
    if damage == "digest":
        np.savez(npz_path, w=np.ones(3), shift=np.zeros(3), scale=np.ones(3))
    elif damage == "manifest":
        manifest["n_features"] = -1
    elif damage == "unhashable":
        manifest["problem"] = ["logistic"]
    elif damage == "big":
        json_path.write_text(" " * 20000 + "{}")
    else:
        arrays = {"w": np.ones(3), "shift": np.zeros(3), "scale": np.ones(3)}
        arrays |= {"shape": {"w": np.ones(4)}, "nan": {"scale": np.array([1.0, np.nan, 1.0])},
                   "pickle": {"w": np.array([1, "x", None], dtype=object)},
                   "wide-names": {"feature_names": np.array(["a", "b", "c"], dtype="U100000")}}[damage]
        np.savez(npz_path, **arrays)
    if damage != "big":
        if damage not in ("digest", "manifest", "unhashable"):  # the digest matches: the arrays' checks
            manifest["arrays_sha256"] = hashlib.sha256(npz_path.read_bytes()).hexdigest()
        json_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"party-0\.export"):
        read_part(tmp_path, 0)


def test_parts_of_different_models_do_not_combine(tmp_path):
    write_part(_part(0), tmp_path)
    write_part(_part(1, epochs=4.0), tmp_path)
    with pytest.raises(ValueError, match="another model"):
        read_parts(tmp_path)


@pytest.mark.mpi
def test_a_csv_party_exports_its_header_names(tmp_path):
    """A run on ``party-<p>.csv`` files (``vfl align``'s form): each part names its columns as its own
    CSV header does, and holds no other party's names."""
    rng = np.random.default_rng(0)
    X, ids = rng.normal(size=(60, 6)), np.arange(100, 160)
    y = (X @ [1.0, -1.0, 0.5, 0.0, 2.0, -0.5] > 0).astype(int)
    names = [["age", "income"], ["debt", "tenure"], ["visits", "spend"]]
    folder = tmp_path / "csv"
    folder.mkdir()
    for p, cols in enumerate(names):
        header = ["id", *(["label"] if p == 0 else []), *cols]
        rows = [",".join([str(ids[i]), *([str(y[i])] if p == 0 else []),
                          *(repr(float(v)) for v in X[i, 2 * p:2 * p + 2])]) for i in range(60)]
        (folder / f"party-{p}.csv").write_text(",".join(header) + "\n" + "\n".join(rows) + "\n")
    run = tmp_path / "run"
    ok("train", "--out", str(run), "--no-progress", "-n", "3", "-m", "1", "--party-files", str(folder),
       "--epochs", "1", "--problem", "logistic", "--lam", "0.1", "--gamma", "0.05", timeout=240)
    for p in range(3):
        ok("export", str(run), "--party", str(p), "--out", str(tmp_path / "parts"))
        part = read_part(tmp_path / "parts", p)
        manifest = json.loads(part_paths(tmp_path / "parts", p)[0].read_text())
        assert part.feature_names == tuple(names[p]) and manifest["schema"] == "names"
        assert manifest["standardize"] == "on" and part.scale is not None and np.any(part.w != 0)
