"""``vfl align`` (issue 17): the PSI core against plain set intersection, its privacy against a curious
party, and real ``mpiexec`` runs of the CLI, its errors and a tampered message."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from protocols import psi
from tests.conftest import REPO_ROOT, run_mpi


def _sets(rng: np.random.Generator, q: int, n: int, common: int) -> list[list[str]]:
    shared = [f"c{i}" for i in range(common)]
    return [[*shared, *(f"p{p}-{i}" for i in rng.choice(10 * n, n - common, replace=False))]
            for p in range(q)]


@pytest.mark.parametrize(("q", "n", "common"), [(2, 1, 0), (2, 40, 0), (2, 40, 40), (2, 300, 120),
                                                (3, 200, 70), (4, 50, 10)])
def test_intersection_is_the_plain_one_and_the_order_is_common(q: int, n: int, common: int) -> None:
    rng = np.random.default_rng(q * 1000 + n + common)
    sets = _sets(rng, q, n, common)
    for s in sets:
        rng.shuffle(s)
    sets[1] = sets[1] + [f"extra-{i}" for i in range(7)]  # unequal sizes
    result = psi.run_in_memory(sets)
    expected = set.intersection(*map(set, sets))
    chosen = [[sets[p][i] for i in result.rows[p]] for p in range(q)]
    assert set(chosen[0]) == expected and len(chosen[0]) == len(expected)
    assert all(c == chosen[0] for c in chosen)  # identical order at every party


def test_hash_lands_on_the_curve_never_the_twist() -> None:
    points = psi.hash_to_curve([f"id{i}" for i in range(200)], b"dom")
    assert all(psi._on_curve(int.from_bytes(p.tobytes(), "little")) for p in points)
    blinded = psi.Key().blind(points)
    assert all(psi._on_curve(int.from_bytes(p.tobytes(), "little")) for p in blinded)
    assert not np.array_equal(points, psi.hash_to_curve([f"id{i}" for i in range(200)], b"other"))


def test_a_curious_party_finds_no_id_outside_the_intersection_in_what_it_received() -> None:
    """Each party tries every id it could guess (all parties' ids) in every form it can compute: the raw
    id, SHA-256, the hashed point, the point under its own key, their 16-byte prefixes. None of them may
    appear in what it received, except for ids of the intersection (there, under all keys, by design)."""
    rng = np.random.default_rng(7)
    sets = _sets(rng, 3, 60, 20)
    domain = b"curious"
    result = psi.run_in_memory(sets, domain)
    common = set.intersection(*map(set, sets))
    outside = sorted(set().union(*map(set, sets)) - common)
    hashed = psi.hash_to_curve(outside, domain)
    for p, received in enumerate(result.received):
        own = result.keys[p].blind(hashed)
        guesses: set[bytes] = set()
        for ident, h, b in zip(outside, hashed, own, strict=True):
            for g in (ident.encode(), hashlib.sha256(ident.encode()).digest(), h.tobytes(), b.tobytes()):
                guesses |= {g, g[:psi.TAG]}
        seen = set()
        for arr in received:
            raw = arr.view(np.uint8).reshape(len(arr), -1) if arr.dtype.kind == "V" else arr
            if raw.dtype == np.uint8:
                seen |= {row.tobytes() for row in raw}
        assert seen, f"party {p} received nothing"
        assert not seen & guesses, f"party {p} recognised an id outside the intersection"


def test_invalid_points_name_their_sender() -> None:
    key = psi.Key()
    good = psi.hash_to_curve(["a", "b"], b"d")
    bad = good.copy()
    bad[1, 31] |= 0x80
    with pytest.raises(psi.PsiError, match="party 3 sent an invalid blinded list"):
        key.blind(bad, sender=3)
    low_order = np.zeros((1, 32), dtype=np.uint8)  # u = 0 is the point of order 2
    with pytest.raises(psi.PsiError, match="party 2 sent"):
        key.blind(low_order, sender=2)
    with pytest.raises(psi.PsiError, match="party 1 sent an invalid list of positions"):
        psi.check_positions(np.array([0, 5]), 5, 2, 1, "list of positions")
    with pytest.raises(psi.PsiError, match="appears twice"):
        psi.check_positions(np.array([1, 1]), 5, 2, 1, "list of positions")


def test_x25519_commutes() -> None:
    u = psi.hash_to_curve(["x"], b"d")
    a, b = psi.Key(), psi.Key()
    assert np.array_equal(a.blind(b.blind(u)), b.blind(a.blind(u)))
    X25519PublicKey.from_public_bytes(u.tobytes())  # a valid public key encoding


def test_blinding_is_rfc7748_x25519_as_openssl_computes_it() -> None:
    """libsodium does the blinding; it must be the standard function: the RFC's first test vector, and
    the same outputs as OpenSSL's X25519 (``cryptography``) for hashed ids."""
    scalar = bytes.fromhex("a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4")
    u = bytes.fromhex("e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c")
    out = psi.Key(scalar).blind(np.frombuffer(u, dtype=np.uint8).reshape(1, 32))
    assert out.tobytes().hex() == "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552"
    secret = os.urandom(32)
    points = psi.hash_to_curve([f"id{i}" for i in range(50)], b"d")
    openssl = X25519PrivateKey.from_private_bytes(secret)
    expected = [openssl.exchange(X25519PublicKey.from_public_bytes(p.tobytes())) for p in points]
    assert [row.tobytes() for row in psi.Key(secret).blind(points)] == expected


def test_the_protocol_modules_use_buffer_calls_only() -> None:
    """The house rule: across parties only buffer calls (capitalised in mpi4py), never pickle."""
    pickled = re.compile(r"comm\.(send|recv|isend|irecv|bcast|gather|allgather|scatter|sendrecv|reduce|"
                         r"allreduce|alltoall|probe)\(")
    for name in ("protocols/psi.py", "parties/align.py"):
        assert not pickled.findall((REPO_ROOT / name).read_text()), name


# --------------------------------------------------------------------------------- real MPI runs


def _vfl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vfl.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
                          check=False)


def _write(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    path.write_text("\n".join(",".join(r) for r in [header, *rows]) + "\n")
    return path


@pytest.mark.mpi
def test_vfl_align_writes_the_intersection_in_one_order_at_every_party(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    ids = [[f"u{i}" for i in rng.choice(60, 40, replace=False)] for _ in range(3)]
    common = set.intersection(*map(set, ids))
    files = [_write(tmp_path / "a.csv", ["id", "age"], [[i, str(k)] for k, i in enumerate(ids[0])]),
             _write(tmp_path / "b.csv", ["score", "id"], [[str(k), i] for k, i in enumerate(ids[1])]),
             _write(tmp_path / "c.csv", ["id"], [[i] for i in ids[2]])]
    proc = _vfl("align", "-n", "3", "--ids", *map(str, files), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert f"intersection: {len(common)} ids" in proc.stdout
    aligned = []
    for p, src in enumerate(files):
        lines = (tmp_path / "out" / f"party-{p}.csv").read_text().splitlines()
        header = lines[0].split(",")
        assert header == src.read_text().splitlines()[0].split(",")
        col = header.index("id")
        rows = [line.split(",") for line in lines[1:]]
        source_rows = {tuple(r) for r in (line.split(",") for line in src.read_text().splitlines()[1:])}
        assert all(tuple(r) in source_rows for r in rows)  # whole rows, unchanged
        aligned.append([r[col] for r in rows])
    assert set(aligned[0]) == common and len(aligned[0]) == len(common)
    assert aligned[0] == aligned[1] == aligned[2]


@pytest.mark.mpi
def test_the_id_column_named_at_align_is_the_one_training_reads(tmp_path: Path) -> None:
    """``--id-column customer_id`` once: the aligned files call it ``id``, the party files' name, so
    ``vfl train --party-files`` takes them as they are (it used to refuse them until renamed)."""
    rng = np.random.default_rng(4)
    rows0 = [[str(100 + i), str(i % 2), f"{rng.normal():.3f}"] for i in range(40)]
    rows1 = [[f"{rng.normal():.3f}", str(100 + i)] for i in range(5, 45)]
    files = [_write(tmp_path / "a.csv", ["customer_id", "label", "x"], rows0),
             _write(tmp_path / "b.csv", ["y", "customer_id"], rows1),
             _write(tmp_path / "c.csv", ["customer_id", "z"], [[str(100 + i), str(i)] for i in range(45)])]
    proc = _vfl("align", "-n", "3", "--ids", *map(str, files), "--id-column", "customer_id",
                "--out", str(tmp_path / "aligned"))
    assert proc.returncode == 0, proc.stderr
    headers = [(tmp_path / "aligned" / f"party-{p}.csv").read_text().splitlines()[0] for p in range(3)]
    assert headers == ["id,label,x", "y,id", "id,z"]
    proc = _vfl("train", "--party-files", str(tmp_path / "aligned"), "-n", "3", "-m", "1", "--epochs", "1",
                "--out", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    clash = _write(tmp_path / "d.csv", ["customer_id", "id"], [["1", "2"]])
    proc = _vfl("align", "-n", "2", "--ids", str(files[0]), str(clash), "--id-column", "customer_id",
                "--out", str(tmp_path / "clash"))
    assert proc.returncode == 2 and "a column 'id' beside --id-column 'customer_id'" in proc.stderr


@pytest.mark.mpi
def test_vfl_align_takes_a_folder(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    _write(tmp_path / "in" / "party-0.csv", ["id"], [["1"], ["2"], ["3"]])
    _write(tmp_path / "in" / "party-1.csv", ["id"], [["3"], ["4"], ["1"]])
    proc = _vfl("align", "-n", "2", "--ids", str(tmp_path / "in"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert "intersection: 2 ids" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["missing file", "no id column", "duplicate id", "empty", "count"])
def test_vfl_align_errors_are_one_line_with_exit_2(tmp_path: Path, case: str) -> None:
    good = _write(tmp_path / "good.csv", ["id", "x"], [["1", "a"], ["2", "b"]])
    other, expected = tmp_path / "other.csv", ""
    if case == "missing file":
        expected = "other.csv: no such file"
    elif case == "no id column":
        _write(other, ["key", "x"], [["1", "a"]])
        expected = "no column 'id'"
    elif case == "duplicate id":
        _write(other, ["id", "x"], [["1", "a"], ["2", "b"], ["1", "c"]])
        expected = "other.csv line 4: duplicate id '1' (first on line 2)"
    elif case == "empty":
        _write(other, ["id", "x"], [])
        expected = "other.csv: no rows"
    files = [str(good), str(other)] if case != "count" else [str(good)]
    if case == "count":
        expected = "--ids: 1 files for -n 2 parties"
    proc = _vfl("align", "-n", "2", "--ids", *files, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vfl align: error:"), proc.stderr
    assert expected in lines[0]


TAMPER = """
import sys
import numpy as np
from mpi4py import MPI
import parties.align as align
if MPI.COMM_WORLD.Get_rank() == 1:
    real = align.Link.send
    def short(self, arr, dest, tag):
        if tag == align.TAG_RING:
            arr = np.ascontiguousarray(arr)[:-1]
        real(self, arr, dest, tag)
    align.Link.send = short
align.run_rank(["--bench", "50", "--out", sys.argv[1]])
"""


@pytest.mark.mpi
def test_a_message_of_the_wrong_length_ends_the_job_naming_its_sender(tmp_path) -> None:
    from parties.outcomes import decisive_verdict, read_verdicts

    proc = run_mpi(2, ["-c", TAMPER, str(tmp_path)], check=False, timeout=60)
    assert proc.returncode != 0
    line = decisive_verdict(read_verdicts(tmp_path, 2)) or ""
    assert "party 1 sent an invalid blinded list" in line, (line, proc.stderr)


DUPLICATE = """
import sys
import numpy as np
from mpi4py import MPI
import parties.align as align
if MPI.COMM_WORLD.Get_rank() == 1:
    real = align.Link.send
    def repeat(self, arr, dest, tag):
        if tag == align.TAG_RING:
            arr = np.ascontiguousarray(arr).copy()
            arr[1] = arr[0]
        real(self, arr, dest, tag)
    align.Link.send = repeat
align.run_rank(["--bench", "50", "--out", sys.argv[1]])
"""


@pytest.mark.mpi
@pytest.mark.parametrize("q", [2, 3])
def test_a_repeated_point_is_blamed_on_the_party_that_made_it_not_the_last_hop(q: int, tmp_path) -> None:
    """Party 1 repeats a point of the list it passes on: its successor names it (at q = 2 the leader
    used to blame itself, at q = 3 the honest last hop was blamed). The naming line is read from the
    verdict files, as ``vfl align`` reads it: standard error may be lost when the abort kills the ranks."""
    from parties.outcomes import decisive_verdict, read_verdicts

    proc = run_mpi(q, ["-c", DUPLICATE, str(tmp_path)], check=False, timeout=60)
    assert proc.returncode != 0
    line = decisive_verdict(read_verdicts(tmp_path, q)) or ""
    assert "party 1 sent an invalid blinded list" in line and "the same point twice" in line, \
        (line, proc.stderr)


def test_a_received_list_with_a_repeat_names_its_sender() -> None:
    points = psi.hash_to_curve(["a", "b", "c"], b"d")
    points[2] = points[0]
    with pytest.raises(psi.PsiError, match="party 4 sent an invalid blinded list: it holds the same point"):
        psi.check_points(points, 4, "blinded list")


@pytest.mark.mpi
def test_benchmark_quick_writes_its_outputs(tmp_path: Path) -> None:
    from experiments.bench_psi import main

    main(["--quick", "--parties", "2", "--out", str(tmp_path)])
    for name in ("results.csv", "table.md", "psi_time.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "intersection" in (tmp_path / "results.csv").read_text()


# ------------------------------------------------------------------------------- ids and set sizes


def test_ids_past_two_to_the_53_are_not_merged(tmp_path: Path) -> None:
    """2^53 and 2^53 + 1 are the same float64: read exactly, they are two ids, and neither PSI nor the
    party-file loader takes one for the other."""
    from parties.align import canonical_id, read_table
    from vertical.datasets import DataValidationError
    from vertical.datasets.party_files import check_aligned, load_party_file

    ids = (9007199254740992, 9007199254740993)
    paths = []
    for p, ident in enumerate(ids):
        paths.append(tmp_path / f"party-{p}.csv")
        paths[-1].write_text(f"id,f{p}{',label' if p == 0 else ''}\n{ident},1.5{',1' if p == 0 else ''}\n")
    tables = [read_table(path, "id") for path in paths]
    assert [t.ids for t in tables] == [[str(ids[0])], [str(ids[1])]]
    assert psi.run_in_memory([t.ids for t in tables]).rows[0].size == 0
    assert canonical_id(" 007 ") == canonical_id("+7.0") == "7" and canonical_id("a7") == "a7"
    parties = [load_party_file(path, task="binary") for path in paths]
    assert parties[0].train_ids.tolist() == [ids[0]] and parties[1].train_ids.tolist() == [ids[1]]
    with pytest.raises(DataValidationError, match="not aligned"):
        check_aligned(parties)


def test_an_id_past_64_bits_is_one_line_naming_the_line(tmp_path: Path) -> None:
    from vertical.datasets import DataValidationError
    from vertical.datasets.party_files import load_party_file

    path = tmp_path / "party-0.csv"
    path.write_text(f"id,f\n1,2\n{2**64},3\n")
    with pytest.raises(DataValidationError, match=r"party-0\.csv, line 3: id 18446744073709551616 does"):
        load_party_file(path)


@pytest.mark.parametrize("announced", [2**31 - 1, 50_000_001, 0, -1])
def test_a_set_size_past_the_maximum_is_refused_before_any_allocation(announced: int) -> None:
    """A peer announcing 2^31 − 1 ids would make every party allocate 64 GiB for its list: the size
    is checked first, and the job ends naming the announcer."""
    from parties import align

    with pytest.raises(psi.PsiError, match=rf"party 2 sent an invalid set size: {announced}"):
        align.check_sizes([10, 10, announced])
    assert align.check_sizes([10, align.MAX_IDS]) == [10, align.MAX_IDS]
