"""No pickle between parties: every party-to-party message in ``parties/`` and ``protocols/`` is a buffer.

mpi4py's lowercase communicator methods (``send``, ``recv``, ``bcast``, ``gather``, ...) pickle their
objects, and the receiving rank *unpickles* what another organisation sent: that runs code of the
sender's choosing. The capitalised buffer calls (``Send``, ``Gatherv``, ...) move raw numbers only. This
AST check fails on any lowercase call on a communicator-like object, and on importing ``pickle`` and its
relatives, anywhere in those packages; a crafted-payload test shows the receive paths reject a pickle.
"""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from protocols.aggregation import AggregationNode
from protocols.dispatch import Inbox
from protocols.errors import ProtocolViolation
from protocols.transport import MpiTransport
from protocols.trees import build_all_tree_pairs
from tests.conftest import REPO_ROOT

#: mpi4py's pickle-based communicator methods (the buffer versions are capitalised).
PICKLING_METHODS = {
    "send", "recv", "isend", "irecv", "ssend", "issend", "bsend", "ibsend", "sendrecv", "mprobe_recv",
    "bcast", "ibcast", "gather", "igather", "scatter", "iscatter", "allgather", "iallgather",
    "alltoall", "ialltoall", "reduce", "ireduce", "allreduce", "iallreduce", "scan", "exscan",
    "neighbor_allgather", "neighbor_alltoall", "probe_recv",
}
#: Names of objects that are (or may be) communicators: comm, ctrl, world, data (the runtime's data
#: communicator), *_comm, comm_*, intercomm, MPI.COMM_WORLD / COMM_SELF.
COMMUNICATOR = re.compile(r"^(comm|ctrl|world|data|intercomm|COMM_WORLD|COMM_SELF|\w*_comm|comm_\w*)$")
PICKLE_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "_pickle"}


def _receiver_name(node: ast.expr) -> str | None:
    """The last name of the object a method is called on: ``comm`` in ``self.rt.comm.bcast(...)``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):  # comm.Dup().bcast(...)
        return _receiver_name(node.func.value) if isinstance(node.func, ast.Attribute) else None
    return None


def offences(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: what`` for every pickling MPI call or pickle import in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = _receiver_name(node.func.value)
            if node.func.attr in PICKLING_METHODS and receiver and COMMUNICATOR.match(receiver):
                found.append(f"{filename}:{node.lineno}: {receiver}.{node.func.attr}() pickles its message")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.split(".")[0] in PICKLE_MODULES:
                    found.append(f"{filename}:{node.lineno}: imports {module}")
    return found


def test_the_scanner_finds_pickling_calls_and_ignores_buffer_calls() -> None:
    bad = """
import pickle
comm.bcast(x, root=0)
self.rt.ctrl.allreduce(done)
MPI.COMM_WORLD.gather(ids, root=0)
self.data.recv(source=1)
own_comm.sendrecv(1, dest=2)
comm.Dup().scatter(parts)
"""
    assert len(offences(bad)) == 7
    good = """
comm.Bcast(x, root=0); comm.Gatherv(a, [b, counts], root=0); self.data.Recv([raw, MPI.BYTE])
transport.send(dest, buffer); self.sender.send(buf, dest, tag); queue.put(item); rule.apply(w, r, t)
functools.reduce(f, xs)
"""
    assert offences(good) == []


@pytest.mark.parametrize("package", ["parties", "protocols"])
def test_no_party_to_party_path_pickles(package: str) -> None:
    found = [hit for path in sorted((REPO_ROOT / package).rglob("*.py"))
             for hit in offences(path.read_text(), str(path.relative_to(REPO_ROOT)))]
    assert found == [], "pickle on a party-to-party path:\n" + "\n".join(found)


# ------------------------------------------------------------------- a crafted pickle payload is refused


class _WritesMarker:
    """Unpickling this calls ``open(path, "w")``: the file appears if anything unpickles the payload."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _payload(path: Path, pad_to_words: bool) -> np.ndarray:
    blob = pickle.dumps(_WritesMarker(path))  # unpickling stops at its STOP opcode: padding is ignored
    if pad_to_words:
        blob += bytes(-len(blob) % 8)
    elif len(blob) % 8 == 0:  # the path's length decides: keep this payload a ragged number of bytes
        blob += b"\x00"
    return np.frombuffer(blob, dtype=np.uint8).copy()


def test_the_crafted_payload_is_armed(tmp_path: Path) -> None:
    """Sanity: unpickling the payload does run code (so the rejection tests below mean something)."""
    marker = tmp_path / "armed"
    pickle.loads(_payload(marker, pad_to_words=False).tobytes()).close()
    assert marker.exists()


@pytest.mark.parametrize("pad", [False, True])
def test_a_pickle_payload_is_rejected_naming_the_sender_not_executed(tmp_path: Path, pad: bool) -> None:
    """The payload goes through MPI (over COMM_SELF) into the transport's receive path, and its words to
    the protocol node and the (ϑ, i) inbox: each rejects it with ProtocolViolation naming party 0."""
    marker = tmp_path / "pwned"
    payload = _payload(marker, pad)
    comm = MPI.COMM_SELF.Dup()
    try:
        transport = MpiTransport(comm)
        request = comm.Isend([payload, MPI.BYTE], 0, transport.tag)
        if not pad:  # not a whole number of words: the transport refuses it
            with pytest.raises(ProtocolViolation, match=r"^party 0 sent an invalid message: \d+ bytes"):
                transport.recv()
            request.Wait()
            assert not marker.exists()
            return
        source, words = transport.recv()
        request.Wait()
    finally:
        comm.Free()
    assert source == 0
    node = AggregationNode(1, 3, build_all_tree_pairs(3, 0))
    with pytest.raises(ProtocolViolation, match=r"^party 0 sent an invalid aggregation message: unknown"):
        node.receive(source, words)
    with pytest.raises(ProtocolViolation, match=r"^party 0 sent an invalid \(ϑ, i\) message"):
        Inbox(3, n_rows=100).unpack(source, words.view(np.float64))
    assert not marker.exists()
