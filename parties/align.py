"""``vfl align``: private set intersection of the parties' id columns over MPI (issue 17).

Two halves. :func:`launch_alignment` runs in the user's process: it checks what it can see cheaply (files,
headers), starts ``mpiexec -n q python -m mpi4py -m parties.align …`` and turns the job's outcome
into one line and an exit code. :func:`run_rank` runs in each rank: it reads only its own file, runs
the protocol of :mod:`protocols.psi` with buffer calls only (every message's size is known in
advance from the announced set sizes, and a message of another size names its sender), and writes
its aligned file. Every wait on a peer is polled under a deadline (``--peer-timeout``,
protocols/liveness.py): a party that delivers nothing for that long ends the job named, and lists
travel in pieces so that a party blinding a long one is seen to progress. The message flow and what
each party learns are in docs/alignment.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parties.orphans import die_with_parent, tied_command
from parties.outcomes import STOP_LINE, decisive_verdict, find_stop, read_verdicts
from protocols import psi
from protocols.errors import ProtocolViolation
from protocols.liveness import STARTUP_TIMEOUT_S, Liveness, PeerTimeout, Pending
from vertical.datasets.validation import integer_id

#: Exit codes, as for ``vfl train`` (parties.outcomes.EXIT_CODES).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: Tags of the protocol's messages.
TAG_RING, TAG_TAGS, TAG_LEADER_POS, TAG_OWNER_POS = 171, 172, 173, 174
TAG_READY, TAG_SIZES, TAG_NONCE, TAG_COUNT, TAG_REPORT = 175, 176, 177, 178, 179
#: Rows of a list per message around the ring: each piece that arrives restarts the receiver's deadline,
#: so a party blinding a long list (about 37 µs a row, docs/alignment.md) is seen to progress; 2^15 rows
#: are about 1.2 s of blinding and 1 MiB.
CHUNK = 1 << 15
#: Levels of the deadlines (protocols/liveness.py): every party announces its size at once; the leader's
#: nonce follows; round t of the ring waits at LEVEL_NONCE + t, the exchanges after it above that.
LEVEL_SIZES, LEVEL_NONCE = 0, 1
#: ``vfl align --peer-timeout``'s default, as ``vfl train``'s
DEFAULT_PEER_TIMEOUT = 30.0
#: The largest set one party may announce. Every party allocates 32 bytes per announced id for each
#: list it receives (``Link.recv``), before any check of the list: an announced 2^31 ids would be 64 GiB
#: per list. 50 million ids (1.6 GB a list) is past any table ``vfl align`` is meant for; a larger
#: announcement ends the job naming its announcer, and a larger file is refused before the job starts.
MAX_IDS = 50_000_000


class AlignInputError(ValueError):
    """A problem with one party's input file that its owner must fix (exit 2)."""


# ------------------------------------------------------------------------------------------- input


@dataclass
class PartyTable:
    path: Path
    header: list[str]
    rows: list[list[str]]
    ids: list[str]


#: The id column's name in the aligned files: the party-file format's (vertical/datasets/party_files.py)
PARTY_FILE_ID = "id"


def read_header(path: Path, id_column: str) -> list[str]:
    """The header of ``path``, checked for ``id_column`` (the launcher's cheap check)."""
    if not path.is_file():
        raise AlignInputError(f"{path}: no such file")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
    except (OSError, UnicodeDecodeError) as err:
        raise AlignInputError(f"{path}: cannot read it ({err})") from None
    if not header:
        raise AlignInputError(f"{path}: empty file (a header line with a {id_column!r} column is expected)")
    if id_column not in header:
        raise AlignInputError(f"{path}: no column {id_column!r} (columns: {', '.join(header)})")
    if id_column != PARTY_FILE_ID and PARTY_FILE_ID in header:
        raise AlignInputError(f"{path}: a column {PARTY_FILE_ID!r} beside --id-column {id_column!r}: the "
                              f"aligned file names its id column {PARTY_FILE_ID!r}, so rename the other")
    return header


def read_table(path: Path, id_column: str) -> PartyTable:
    """One party's CSV file: header, rows, ids (:func:`canonical_id`), with duplicates, empty input and
    more than :data:`MAX_IDS` rows refused, each naming the file (and line)."""
    header = read_header(path, id_column)
    col = header.index(id_column)
    rows: list[list[str]] = []
    ids: list[str] = []
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            next(reader)
            _read_rows(path, reader, header, col, rows, ids)
    except csv.Error as err:  # a field over csv.field_size_limit(), a NUL byte, ...
        raise AlignInputError(f"{path} line {reader.line_num}: {err}") from None
    except UnicodeDecodeError as err:
        raise AlignInputError(f"{path}: not UTF-8 text ({err.reason})") from None
    if not ids:
        raise AlignInputError(f"{path}: no rows")
    return PartyTable(path, header, rows, ids)


def canonical_id(cell: str) -> str:
    """An id as PSI hashes it: an integer in one spelling (``007``, ``+7`` and ``7.0`` are ``7``, as the
    party-file loader reads them), parsed exactly, never through a float; any other id as written."""
    value = integer_id(cell)
    return cell.strip() if value is None else str(value)


def _read_rows(path: Path, reader, header: list[str], col: int, rows: list[list[str]],
               ids: list[str]) -> None:
    """The data rows of ``reader`` into ``rows`` and their ids into ``ids``; duplicates refused."""
    first_line: dict[str, int] = {}
    for row in reader:
        line = reader.line_num
        if not row:
            continue
        if len(row) != len(header):
            raise AlignInputError(f"{path} line {line}: {len(row)} fields, the header has {len(header)}")
        ident = canonical_id(row[col])
        if not ident:
            raise AlignInputError(f"{path} line {line}: empty id")
        if len(ids) == MAX_IDS:
            raise AlignInputError(f"{path}: more than {MAX_IDS:,} rows (the most one party may align)")
        if ident in first_line:
            raise AlignInputError(f"{path} line {line}: duplicate id {ident!r} "
                                  f"(first on line {first_line[ident]})")
        first_line[ident] = line
        rows.append(row)
        ids.append(ident)


def write_aligned(table: PartyTable, rows: np.ndarray, out: Path, id_column: str = PARTY_FILE_ID) -> None:
    """The common rows of ``table``, in the common order, atomically (a partial file never shows). The
    id column is named ``id`` there, whatever ``--id-column`` was: the aligned files are party files,
    which ``vfl train --party-files`` reads (and ``vfl predict`` keys its output by) under that name."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([PARTY_FILE_ID if name == id_column else name for name in table.header])
        writer.writerows(table.rows[i] for i in rows.tolist())
    os.replace(tmp, out)


def _natural(path: Path) -> list:
    """party-2.csv before party-10.csv."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def party_files(ids: list[str], parties: int) -> list[Path]:
    """``--ids``: one file per party in rank order, or one folder of ``*.csv`` files (by name, numbers
compared as numbers)."""
    if len(ids) == 1 and Path(ids[0]).is_dir():
        folder = Path(ids[0])
        files = sorted(folder.glob("*.csv"), key=_natural)
        if len(files) != parties:
            raise AlignInputError(f"--ids {folder}: {len(files)} .csv files for -n {parties} parties")
        return files
    if len(ids) != parties:
        raise AlignInputError(f"--ids: {len(ids)} files for -n {parties} parties")
    return [Path(p) for p in ids]


# --------------------------------------------------------------------------------- MPI communication


class Link:
    """Buffer-only messages between ranks under deadlines (protocols/liveness.py): every receive is
    exact-size and polled, so a message of another size names its sender and a peer that delivers
    nothing for ``--peer-timeout`` is named too; bytes sent are counted for the benchmark."""

    def __init__(self, comm, liveness: Liveness) -> None:
        self.comm = comm
        self.liveness = liveness
        self.bytes_sent = 0
        self._pending: list = []

    def send(self, arr: np.ndarray, dest: int, tag: int) -> None:
        from mpi4py import MPI

        arr = np.ascontiguousarray(arr)
        self._pending.append((self.comm.Isend([arr, MPI.BYTE], dest, tag), arr, dest))
        self.bytes_sent += arr.nbytes

    def recv(self, source: int, tag: int, dtype, shape: tuple[int, ...], what: str, level: int) -> np.ndarray:
        buf = np.empty(shape, dtype=dtype)
        pending = Pending(self.comm, self.liveness, what, level)
        pending.recv(buf, source, tag)
        pending.wait()
        return buf

    def expect_list(self, source: int, tag: int, rows: int, width: int, what: str, level: int) -> Pending:
        """Receives for a list of ``rows`` rows of ``width`` bytes sent in pieces of :data:`CHUNK` rows
        (:meth:`Pending.poll` them while computing, :meth:`Pending.wait` for the rest; the list is
        ``.buffer``): each piece that arrives restarts the deadline on ``source``."""
        pending = Pending(self.comm, self.liveness, what, level)
        pending.buffer = np.empty((rows, width), dtype=np.uint8)
        for begin in range(0, rows, CHUNK):
            pending.recv(pending.buffer[begin:begin + CHUNK], source, tag)
        return pending

    def wait(self, level: int) -> None:
        """Every send complete: a receiver that does not take its message in time is named."""
        open_ = self._pending

        def done() -> bool:
            nonlocal open_
            open_ = [item for item in open_ if not item[0].Test()]
            return not open_

        self.liveness.wait(done, lambda: {dest: level for _, _, dest in open_},
                           "it to take the list sent to it")
        self._pending.clear()

    def everyone(self, mine: np.ndarray, tag: int, what: str, level: int) -> np.ndarray:
        """``mine`` (one row) from every rank, to every rank: ``[q, *mine.shape]``."""
        q, rank = self.comm.Get_size(), self.comm.Get_rank()
        every = np.zeros((q, *mine.shape), dtype=mine.dtype)
        every[rank] = mine
        pending = Pending(self.comm, self.liveness, what, level)
        for r in range(q):
            if r != rank:
                pending.recv(every[r], r, tag)
                pending.send(mine, r, tag)
        pending.wait()
        return every


@dataclass
class RankResult:
    rows: np.ndarray
    sizes: list[int]
    seconds: float
    bytes_sent: int


def check_sizes(sizes: list[int]) -> list[int]:
    """Every party's announced set size, each in ``1..MAX_IDS``: a size out of range is its announcer's
    fault (it would make every party allocate for it)."""
    for r, n in enumerate(sizes):
        if not 0 < n <= MAX_IDS:
            raise psi.PsiError(r, "set size", f"{n}")
    return [int(n) for n in sizes]


def _announce_sizes(link: Link, n_ids: int) -> list[int]:
    """Every party's set size, announced up front so that every later message has a size its receiver
    knows."""
    every = link.everyone(np.array([n_ids], dtype=np.int64), TAG_SIZES, "set size", LEVEL_SIZES)
    return check_sizes(every[:, 0].tolist())


def _job_domain(link: Link, lead: int, context: bytes) -> bytes:
    """A job-wide domain separator: a fresh leader nonce plus the caller's context."""
    if link.comm.Get_rank() == lead:
        nonce = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        for r in range(link.comm.Get_size()):
            if r != lead:
                link.send(nonce, r, TAG_NONCE)
        link.wait(LEVEL_NONCE)
    else:
        nonce = link.recv(lead, TAG_NONCE, np.uint8, (16,), "job nonce", LEVEL_NONCE)
    return b"vfl-align/v1\x00" + nonce.tobytes() + context


def _ring(link: Link, party: psi.Party, ids: list[str], domain: bytes, sizes: list[int]) -> np.ndarray:
    """Each list goes once around the ring, every party adding its key; returns the list this rank
    blinded last (that of ``party.next``), under every key, shuffled and cut to tags. Lists travel in
    pieces of :data:`CHUNK` rows, sent as each is blinded: a party blinding a long list is seen to
    progress, and its successor's deadline measures silence, not the list's length. Round t waits at
    level t + 1: a party stuck in round t waits for a predecessor stuck in an earlier round."""
    outgoing = party.start_chunks(ids, domain, CHUNK)
    for t in range(1, party.q):  # after round t this rank holds the list of owner (rank - t) mod q
        owner = (party.rank - t) % party.q
        incoming = link.expect_list(party.prev, TAG_RING, sizes[owner], psi.POINT,
                                    f"blinded list (round {t}, {sizes[owner]} ids of party {owner})",
                                    LEVEL_NONCE + t)
        for piece in outgoing:
            link.send(piece, party.next, TAG_RING)
            incoming.poll()
        incoming.wait()
        link.wait(LEVEL_NONCE + t)
        outgoing = party.hop_chunks(incoming.buffer, CHUNK)
    return party.finish_ring(np.concatenate(list(outgoing)))


def _leader_intersect(link: Link, party: psi.Party, tagged: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """The leader collects every fully blinded list (rank r sends that of r + 1) and intersects them:
    per owner, the positions of the common values in the list its last hop shuffled."""
    q = party.q
    lists: dict[int, np.ndarray] = {party.next: tagged}
    for r in range(q):
        if r != party.rank:
            owner = (r + 1) % q
            raw = link.recv(r, TAG_TAGS, np.uint8, (sizes[owner] * psi.TAG,),
                            f"fully blinded list ({sizes[owner]} tags of party {owner})", _level(q, 1))
            lists[owner] = raw.view(f"V{psi.TAG}")
    return psi.intersect([lists[o] for o in range(q)], [psi.last_hop(o, q) for o in range(q)])


def _level(q: int, after_ring: int) -> int:
    """The level of the ``after_ring``-th exchange after the ring (whose last round waits at q)."""
    return LEVEL_NONCE + q - 1 + after_ring


def align_ids(comm, ids: list[str], context: bytes = b"", *, liveness: Liveness | None = None) -> RankResult:
    """This rank's part of the protocol (docs/alignment.md, "Message flow"); collective over ``comm``.

    Returns the own rows in the intersection, in the common order. Raises :class:`psi.PsiError` or
    :class:`~protocols.errors.ProtocolViolation` naming the sender of any invalid message, and
    :class:`~protocols.liveness.PeerTimeout` naming a party silent past ``liveness``'s limit (default:
    none; ``vfl align`` waits ``--peer-timeout``).
    """
    t0 = time.perf_counter()
    rank, q = comm.Get_rank(), comm.Get_size()
    lead = psi.leader()
    link = Link(comm, liveness if liveness is not None else Liveness(rank, q, None))
    sizes = _announce_sizes(link, len(ids))
    party = psi.Party(rank, q)
    tagged = _ring(link, party, ids, _job_domain(link, lead, context), sizes)
    mine_last = party.next  # this rank applied the last key to the list of its successor
    if rank != lead:
        link.send(tagged.view(np.uint8), lead, TAG_TAGS)
        link.wait(_level(q, 1))
        positions = None
    else:
        positions = _leader_intersect(link, party, tagged, sizes)
    count = np.array([len(positions[0]) if positions is not None else 0], dtype=np.int64)
    if rank == lead:
        for r in range(q):
            if r != lead:
                link.send(count, r, TAG_COUNT)
        link.wait(_level(q, 2))
    else:
        count = link.recv(lead, TAG_COUNT, np.int64, (1,), "intersection size", _level(q, 2))
    k = int(count[0])
    if not 0 <= k <= min(sizes):
        raise psi.PsiError(lead, "intersection size", f"{k} exceeds the smallest set ({min(sizes)})")
    # The leader tells each last hop where the common values sit in the list it shuffled...
    if rank == lead:
        assert positions is not None
        for owner in range(q):
            hop = psi.last_hop(owner, q)
            if hop != lead:
                link.send(positions[owner], hop, TAG_LEADER_POS)
        at_hop = positions[mine_last]
    else:
        at_hop = link.recv(lead, TAG_LEADER_POS, np.int64, (k,), "list of positions", _level(q, 3))
        psi.check_positions(at_hop, sizes[mine_last], k, lead, "list of positions")
    # ...each last hop undoes its shuffle for the owner, who undoes its own.
    link.send(party.translate(at_hop), mine_last, TAG_OWNER_POS)
    back = link.recv(party.prev, TAG_OWNER_POS, np.int64, (k,), "list of positions", _level(q, 4))
    psi.check_positions(back, sizes[rank], k, party.prev, "list of positions")
    link.wait(_level(q, 4))
    rows = party.rows(back)
    return RankResult(rows, sizes, time.perf_counter() - t0, link.bytes_sent)


# ------------------------------------------------------------------------------------------ one rank


def _stop(comm, rank: int, line: str, code: int) -> None:
    """End the job with ``line``: to this rank's verdict file first (``<out>/verdict-<rank>.txt``, read
    by :func:`launch_alignment`), then standard error, which Hydra may lose when the abort kills the
    ranks (``parties/lifecycle.py``)."""
    from parties.lifecycle import end_job  # imports mpi4py.MPI: the rank's side only

    end_job(comm, line, code)


def run_rank(argv: list[str] | None = None) -> None:
    """The entry point of one rank under ``mpiexec`` (see :func:`launch_alignment`)."""
    from mpi4py import MPI

    args = _rank_parser().parse_args(argv)
    die_with_parent()  # no orphan rank if its proxy is killed (parties/orphans.py)
    comm = MPI.COMM_WORLD
    rank, q = comm.Get_rank(), comm.Get_size()
    from parties.lifecycle import report_verdicts_to

    report_verdicts_to(None if args.out is None else Path(args.out) / f"verdict-{rank}.txt")
    try:
        if args.bench:
            ids = bench_ids(rank, args.bench, args.overlap, args.seed)
            table = None
        else:
            if len(args.ids) != q:
                raise AlignInputError(f"{len(args.ids)} files for {q} ranks")
            table = read_table(Path(args.ids[rank]), args.id_column)
            ids = table.ids
    except (AlignInputError, OSError) as err:
        _stop(comm, rank, STOP_LINE.format(rank=rank, outcome="usage", reason=err), EXIT_USAGE)
        return
    liveness = Liveness(rank, q, max(STARTUP_TIMEOUT_S, args.peer_timeout))
    link = Link(comm, liveness)
    try:
        # a rank that failed to read its input stops the job before any message is sent; reading a
        # large file takes its time, so this first wait has the start-up's limit
        link.everyone(np.zeros(1, dtype=np.int64), TAG_READY, "its input read", LEVEL_SIZES)
        liveness.timeout = args.peer_timeout
        result = align_ids(comm, ids, context=args.id_column.encode(), liveness=liveness)
        if table is not None:
            write_aligned(table, result.rows, Path(args.out or ".") / f"party-{rank}.csv", args.id_column)
        mine = np.array([result.seconds, result.bytes_sent, len(result.rows)], dtype=np.float64)
        if rank == 0:
            report = np.zeros((q, 3), dtype=np.float64)
            report[0] = mine
            pending = Pending(comm, liveness, "report", _level(q, 5))
            for r in range(1, q):
                pending.recv(report[r], r, TAG_REPORT)
            pending.wait()
        else:
            link.send(mine, 0, TAG_REPORT)
            link.wait(_level(q, 5))
    except (psi.PsiError, ProtocolViolation, PeerTimeout) as err:
        _stop(comm, rank, f"[party {rank}] error: {err}", EXIT_FAILED)
        return
    if rank == 0:
        summary = {"parties": q, "sizes": result.sizes, "intersection": len(result.rows),
                   "seconds": float(report[:, 0].max()), "bytes_sent": [int(b) for b in report[:, 1]]}
        print("ALIGN-SUMMARY " + json.dumps(summary), flush=True)
        if args.report:
            Path(args.report).write_text(json.dumps(summary) + "\n")


def _rank_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="one party of `vfl align` (run under mpiexec)")
    p.add_argument("--ids", nargs="*", default=[], help="the parties' files, in rank order")
    p.add_argument("--id-column", default="id")
    p.add_argument("--out", default=None, help="the aligned files and the verdict files (default: the "
                   "current folder, and no verdict files)")
    p.add_argument("--report", default=None, help="the leader writes the summary here (JSON)")
    p.add_argument("--bench", type=int, default=0, help="synthetic ids per party instead of files")
    p.add_argument("--overlap", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-timeout", type=float, default=DEFAULT_PEER_TIMEOUT,
                   help="seconds a party waits for a peer that delivers nothing")
    return p


def bench_ids(rank: int, n: int, overlap: float, seed: int) -> list[str]:
    """Synthetic ids for the benchmark: ⌊overlap·n⌋ shared by every party, the rest its own."""
    common = int(overlap * n)
    shared = [f"cust-{seed}-{i:09d}" for i in range(common)]
    own = [f"cust-{seed}-p{rank}-{i:09d}" for i in range(n - common)]
    return shared + own


# ------------------------------------------------------------------------------------------ launcher


def rank_command(parties: int, args: list[str]) -> list[str]:
    from parties.launch import mpiexec_path

    return [mpiexec_path(), "-n", str(parties), sys.executable, "-m", "mpi4py", "-m", "parties.align",
            *args]


def run_job(parties: int, args: list[str], *,
            timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``mpiexec`` the ranks with this checkout importable, tied to this process (parties/orphans.py);
    output captured for :func:`launch_alignment`."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run(tied_command(rank_command(parties, args)), env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def launch_alignment(parties: int, ids: list[str], id_column: str, out: str,
                     peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> int:
    """``vfl align``: check the inputs, run the job, print the intersection size; an exit code."""
    if parties < 2:
        raise AlignInputError(f"-n must be at least 2 (got {parties})")
    if not peer_timeout > 0:
        raise AlignInputError(f"--peer-timeout must be positive (got {peer_timeout:g})")
    files = party_files(ids, parties)
    for path in files:  # the cheap checks; each rank reads its whole file itself
        read_header(path, id_column)
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AlignInputError(f"--out {out_dir}: cannot create it ({err.strerror})") from None
    for stale in out_dir.glob("verdict-*.txt"):  # a previous job's: only this job's ranks decide
        stale.unlink(missing_ok=True)
    proc = run_job(parties, ["--ids", *map(str, files), "--id-column", id_column, "--out", str(out_dir),
                             "--peer-timeout", repr(peer_timeout)])
    output = proc.stdout + proc.stderr
    # the ranks' verdict files decide (written before the abort), the forwarded output only without them
    verdict = decisive_verdict(read_verdicts(out_dir, parties)) if proc.returncode != 0 else None
    if verdict is not None:
        output = verdict
    stopped = find_stop(output)
    if stopped:
        print(f"vfl align: error: {stopped[1]}", file=sys.stderr)
        return EXIT_USAGE
    failed = re.search(r"\[party (\d+)\] error: (.*)", output)
    if failed:
        print(f"vfl align: party {failed.group(1)} stopped the job: {failed.group(2)}", file=sys.stderr)
        return EXIT_FAILED
    summary = re.search(r"ALIGN-SUMMARY (.*)", proc.stdout)
    if proc.returncode != 0 or not summary:
        last = output.strip().splitlines()[-1:] or ["no output"]
        print(f"vfl align: the job failed (exit code {proc.returncode}): {last[0]}", file=sys.stderr)
        return EXIT_FAILED
    info = json.loads(summary.group(1))
    sizes = ", ".join(f"{n:,}" for n in info["sizes"])
    print(f"intersection: {info['intersection']:,} ids common to all {parties} parties "
          f"(set sizes {sizes}); aligned files in {out_dir}/party-<p>.csv")
    return EXIT_OK


if __name__ == "__main__":
    run_rank()
