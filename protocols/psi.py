"""Private set intersection of q parties' id columns (sans-IO core of ``vfl align``; issue 17).

Diffie–Hellman PSI with commutative blinding (Meadows 1986; Huberman–Franklin–Hogg 1999) on X25519
(libsodium's, via PyNaCl): an id is hashed onto Curve25519, and X25519(a, X25519(b, u)) =
X25519(b, X25519(a, u)), so a value
blinded by every party's secret scalar is the same whoever blinded first, while under DDH a value
missing any one key says nothing about the id. The message flow, what each party learns and why the
hash avoids the curve's twist are in docs/alignment.md; :func:`run_in_memory` runs the whole flow
without MPI (the tests' reference), :mod:`parties.align` runs it across MPI ranks.

Everything here is a pure function or a small class over numpy arrays: no MPI, no files.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import gmpy2
import numpy as np
from nacl.bindings import crypto_scalarmult
from nacl.exceptions import CryptoError as SodiumError

#: The field of Curve25519 (v² = u³ + A u² + u over GF(P)).
P = 2**255 - 19
A = 486662
#: Bytes of a blinded point (an X25519 u-coordinate).
POINT = 32
#: Bytes of a fully blinded value as the leader compares it: 128 bits, so that n² / 2¹²⁸ false
#: matches are out of reach for any n this tool sees (1e12 pairs → 3e-27).
TAG = 16
#: Counter bytes are one byte: 256 tries, each on the curve with probability 1/2.
_MAX_TRIES = 256
_P_MPZ = gmpy2.mpz(P)
_ONE = gmpy2.mpz(1)


class PsiError(ValueError):
    """A message from another party that breaks the protocol; names the sender."""

    def __init__(self, sender: int, what: str, detail: str) -> None:
        super().__init__(f"party {sender} sent an invalid {what}: {detail}")
        self.sender = sender


def leader() -> int:
    """Rank 0 compares the fully blinded lists (see docs/alignment.md, "What each party learns")."""
    return 0


def last_hop(owner: int, q: int) -> int:
    """The party that applies the last key to ``owner``'s list: its predecessor on the ring."""
    return (owner - 1) % q


# --------------------------------------------------------------------------------- hashing to the curve


def _on_curve(u: int) -> bool:
    """True when u is the u-coordinate of a point of Curve25519 of order > 2 (not of its twist):
    u³ + A u² + u is a non-zero square mod P."""
    x = gmpy2.mpz(u)
    return gmpy2.jacobi(x * (x * (x + A) + _ONE) % _P_MPZ, _P_MPZ) == 1


def hash_to_curve(ids: Sequence[str], domain: bytes) -> np.ndarray:
    """Each id → a 32-byte u-coordinate on Curve25519 itself, never on its twist, as an (n, 32) array.

    Try-and-increment: u = SHA-256(domain ‖ counter ‖ id) with the top bit cleared, for the first
    counter whose u lies on the curve. A raw hash would land on the twist half the time, and a blinded
    point stays on the side it started on: every blinded value would reveal one bit of its id's hash,
    enough to halve any guess. Clamped X25519 scalars are multiples of 8, so blinded points fall in the
    prime-order subgroup, where DDH is assumed. ``domain`` separates jobs and uses of the hash.
    (The loop is written flat, with :func:`_on_curve` inlined: at 1M ids every 0.1 µs is 0.1 s.)
    """
    base = hashlib.sha256(b"vfl-psi/hash-to-curve/v1\x00" + len(domain).to_bytes(2, "big") + domain)
    counters = [bytes((ctr,)) for ctr in range(_MAX_TRIES)]
    out = bytearray(len(ids) * POINT)
    copy, from_bytes, mpz, jacobi = base.copy, int.from_bytes, gmpy2.mpz, gmpy2.jacobi
    start = 0
    for ident in ids:
        enc = ident.encode()
        for ctr in counters:
            h = copy()
            h.update(ctr + enc)
            u = bytearray(h.digest())
            u[31] &= 0x7F
            x = mpz(from_bytes(u, "little"))
            if x < _P_MPZ and jacobi(x * (x * (x + A) + _ONE) % _P_MPZ, _P_MPZ) == 1:
                break
        else:  # probability 2^-256
            raise RuntimeError(f"id {ident!r} did not hash onto the curve")
        out[start:start + POINT] = u
        start += POINT
    return np.frombuffer(out, dtype=np.uint8).reshape(len(ids), POINT)


# ------------------------------------------------------------------------------------------ blinding


class Key:
    """One party's secret blinding scalar for one job (fresh per job: no value links across jobs).

    X25519 (RFC 7748) from libsodium: the same function as OpenSSL's (tests/test_psi.py checks both
    against the RFC's vector), called without OpenSSL's per-call key objects, which cost ~3 µs of the
    ~35 µs per point on this project's machines; at 1M ids a party computes 2M of them.
    """

    def __init__(self, private: bytes | None = None) -> None:
        self._secret = os.urandom(POINT) if private is None else bytes(private)
        if len(self._secret) != POINT:
            raise ValueError(f"an X25519 private key has {POINT} bytes, got {len(self._secret)}")

    def blind(self, points: np.ndarray, *, sender: int | None = None,
              what: str = "blinded list") -> np.ndarray:
        """X25519(key, u) for every row of an (n, 32) array.

        Points that came from another party (``sender`` given) are validated first: canonical
        encodings (< P) of curve points, never the twist nor a point of small order.
        """
        n = check_points(points, sender, what) if sender is not None else len(points)
        secret, scalarmult = self._secret, crypto_scalarmult
        buf = points.tobytes()
        out = bytearray(n * POINT)
        for i in range(n):
            s = i * POINT
            u = buf[s:s + POINT]
            if sender is not None and not _on_curve(int.from_bytes(u, "little")):
                raise PsiError(sender, what, f"row {i} is not a point of Curve25519")
            try:
                out[s:s + POINT] = scalarmult(secret, u)
            except SodiumError:  # libsodium refuses points of small order (the result would be 0)
                raise PsiError(sender if sender is not None else -1, what,
                               f"row {i} is a point of small order") from None
        return np.frombuffer(out, dtype=np.uint8).reshape(n, POINT)


def check_points(points: np.ndarray, sender: int, what: str) -> int:
    """Shape and canonical encoding of received points (the top bit clear and u < P); returns n."""
    if points.ndim != 2 or points.shape[1] != POINT or points.dtype != np.uint8:
        raise PsiError(sender, what, f"expected rows of {POINT} bytes, got shape {points.shape}")
    high = points[:, 31]
    if np.any(high & 0x80):
        raise PsiError(sender, what, "a u-coordinate has its top bit set")
    big = (high == 0x7F) & np.all(points[:, 1:31] == 0xFF, axis=1) & (points[:, 0] >= 0xED)
    if np.any(big):
        raise PsiError(sender, what, "a u-coordinate is not reduced mod 2^255-19")
    # Every list of the protocol is free of repeats (unique ids, and blinding is a bijection), so the
    # first party to receive a repeat names the one that put it there: checked at the last hop only,
    # a repeat made at the first hop blamed whoever forwarded it (at q = 2 the leader blamed itself).
    rows = np.ascontiguousarray(points).view(f"V{POINT}").reshape(len(points))
    if len(rows) > 1 and np.unique(rows).size != len(rows):
        raise PsiError(sender, what, "it holds the same point twice")
    return len(points)


def secure_permutation(n: int) -> np.ndarray:
    """A uniformly random permutation of range(n) from the OS's CSPRNG (sort of random 64-bit keys;
    ties, at probability n²/2⁶⁵, only make two positions follow their input order)."""
    keys = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) if n else np.zeros(0, np.uint64)
    return np.argsort(keys, kind="stable").astype(np.int64)


def tags(points: np.ndarray) -> np.ndarray:
    """The compared form of fully blinded points: their first :data:`TAG` bytes, one void scalar each."""
    return np.ascontiguousarray(points[:, :TAG]).view(f"V{TAG}").reshape(len(points))


# ------------------------------------------------------------------------------------ the leader's part


def intersect(lists: Sequence[np.ndarray], senders: Sequence[int]) -> list[np.ndarray]:
    """Positions, in each list of fully blinded tags, of the values present in every list, in the
    common order: ascending tag bytes (pseudo-random, so the order says nothing about the ids).

    Every list must be free of repeats (each party's ids are unique, and blinding is a bijection); a
    repeat is a broken message from ``senders[p]``, the party that sent list p.
    """
    sorted_lists, orders = [], []
    for values, sender in zip(lists, senders, strict=True):
        order = np.argsort(values, kind="stable")
        s = values[order]
        if len(s) > 1 and np.any(s[1:] == s[:-1]):
            raise PsiError(sender, "fully blinded list", "it holds the same value twice")
        sorted_lists.append(s)
        orders.append(order)
    common = sorted_lists[0]
    for s in sorted_lists[1:]:
        common = np.intersect1d(common, s, assume_unique=True)
    return [order[np.searchsorted(s, common)].astype(np.int64) for s, order in zip(sorted_lists, orders,
                                                                                   strict=True)]


def check_positions(pos: np.ndarray, length: int, count: int, sender: int, what: str) -> np.ndarray:
    """Received positions: ``count`` distinct integers in [0, length)."""
    if pos.shape != (count,):
        raise PsiError(sender, what, f"expected {count} positions, got {pos.shape[0] if pos.ndim else 0}")
    if count and (pos.min() < 0 or pos.max() >= length):
        raise PsiError(sender, what, f"a position is outside [0, {length})")
    if count > 1 and len(np.unique(pos)) != count:
        raise PsiError(sender, what, "a position appears twice")
    return pos


# ------------------------------------------------------------------------------- one party's state


@dataclass
class Party:
    """What one party keeps through the protocol (see docs/alignment.md for the flow).

    ``rho`` shuffles its own blinded list before it leaves (row ``rho[k]`` is position k of the list
    that travels); ``sigma`` shuffles the list it blinds last before the leader sees it.
    """

    rank: int
    q: int
    key: Key = field(default_factory=Key)
    rho: np.ndarray | None = None
    sigma: np.ndarray | None = None

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.q

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.q

    def start(self, ids: Sequence[str], domain: bytes) -> np.ndarray:
        """Hash and blind the own ids, shuffled: the list that leaves for the next party."""
        pieces = list(self.start_chunks(ids, domain, max(len(ids), 1)))
        return np.concatenate(pieces) if pieces else np.zeros((0, POINT), dtype=np.uint8)

    def start_chunks(self, ids: Sequence[str], domain: bytes, chunk: int) -> Iterator[np.ndarray]:
        """:meth:`start`'s list in pieces of ``chunk`` rows, each computed when it is asked for (shuffling
        first and blinding row by row gives the same list): a party sends each piece as it is done,
        so its successor sees it progress (protocols/liveness.py)."""
        self.rho = secure_permutation(len(ids))
        for begin in range(0, len(ids), chunk):
            part = self.rho[begin:begin + chunk].tolist()
            yield self.key.blind(hash_to_curve([ids[i] for i in part], domain))

    def hop(self, received: np.ndarray) -> np.ndarray:
        """Add this party's key to the list from the previous party, order kept (the owner's ``rho``
        must still map positions back to its rows)."""
        return self.key.blind(received, sender=self.prev)

    def hop_chunks(self, received: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
        """:meth:`hop` in pieces of ``chunk`` rows, each computed when it is asked for."""
        for begin in range(0, len(received), chunk):
            yield self.hop(received[begin:begin + chunk])

    def finish_ring(self, fully_blinded: np.ndarray) -> np.ndarray:
        """The next party's list, now under every key: reshuffled (``sigma``) so that the leader can
        link no position to the owner's order, and cut to tags."""
        self.sigma = secure_permutation(len(fully_blinded))
        return tags(fully_blinded[self.sigma])

    def translate(self, positions: np.ndarray) -> np.ndarray:
        """Positions in the leader's (``sigma``) order → positions in the owner's (``rho``) order."""
        assert self.sigma is not None
        return self.sigma[positions]

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """Positions in the own travelling list → own rows, in the common order."""
        assert self.rho is not None
        return self.rho[positions]


# ----------------------------------------------------------------------------- the flow without MPI


@dataclass
class InMemoryResult:
    rows: list[np.ndarray]  #: per party, its rows in the intersection, in the common order
    received: list[list[np.ndarray]]  #: per party, every array it received (its transcript)
    keys: list[Key]


def run_in_memory(sets: Sequence[Sequence[str]], domain: bytes = b"test") -> InMemoryResult:
    """The whole protocol for q ≥ 2 parties in one process, with the same steps and messages as
    :mod:`parties.align` (tests and docs use it as the reference)."""
    q = len(sets)
    if q < 2:
        raise ValueError("PSI needs at least 2 parties")
    parties = [Party(r, q) for r in range(q)]
    received: list[list[np.ndarray]] = [[] for _ in range(q)]

    def deliver(dest: int, arr: np.ndarray) -> np.ndarray:
        received[dest].append(arr.copy())
        return arr

    # ring: after round t, party r holds the list of owner (r - t) mod q
    lists = [parties[r].start(sets[r], domain) for r in range(q)]
    for _ in range(1, q):
        lists = [parties[r].hop(deliver(r, lists[(r - 1) % q])) for r in range(q)]
    # party r now holds the fully blinded list of owner r + 1; the leader gets them all
    tagged = {(r + 1) % q: parties[r].finish_ring(lists[r]) for r in range(q)}
    lead = leader()
    for r in range(q):
        if r != lead:
            deliver(lead, tagged[(r + 1) % q])
    positions = intersect([tagged[o] for o in range(q)], [last_hop(o, q) for o in range(q)])
    rows = []
    for owner in range(q):
        hop = last_hop(owner, q)
        at_hop = positions[owner] if hop == lead else deliver(hop, positions[owner])
        back = parties[hop].translate(at_hop)
        rows.append(parties[owner].rows(deliver(owner, back)))
    return InMemoryResult(rows, received, [p.key for p in parties])
