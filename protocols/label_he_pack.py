"""``--label-privacy he --he-pack``: k masked block-gradient values per Okamoto–Uchiyama plaintext, so a
block of d_l columns costs ⌈d_l/k⌉ decryptions instead of d_l (docs/label-privacy.md, "Packed
decryption").

Layout (:func:`layout`), the same at every party, from public numbers only (B and the key size): an
honest column sum satisfies |g| < 2^G with G = bitlen(B) + 2·VALUE_BITS + THETA_BITS + FEATURE_BITS
(B rows, |ϑ| and |x| below 2^VALUE_BITS, the finer fixed point of features). A slot is w = G + 2 + STAT_BITS
bits wide and holds g + 2^G + r, with r uniform on [0, 2^(w−1)): g + 2^G lies in [0, 2^(G+1)), so the
sum stays below 2^w (no carry into the next slot) and its statistical distance from r alone is below
2^(G+1)/2^(w−1) = 2^-STAT_BITS. k = ⌊ou_mask_bits/w⌋ slots fill one plaintext below 2^(k·w) ≤
2^ou_mask_bits, which an honest OU key decrypts exactly (label_he.ou_mask_bits). The layout does not
depend on a party's features, so the number of packed values says nothing the dominator did not know.

The passive party packs homomorphically: column j goes to packed value ⌊j/k⌋, slot j mod k, by Horner's
rule on the column sums ([[P]] = (…([[g_{k−1}]]·2^w + [[g_{k−2}]])·2^w …) + [[g_0]]), then adds one fresh
encryption of Σ_s 2^(ws)·(r_s + 2^G). The dominator decrypts, refuses any plaintext outside
[0, 2^(k·w)) (no honest pack decrypts there) and more than ⌈(B − 1)/k⌉ packed values (what B − 1
columns fill: the unpacked rule's fewer than B values, rounded up to whole plaintexts), and returns each
plaintext whole. The passive party
reads each slot, subtracts r_s + 2^G and checks |g| against what the batch's honest ϑ's can sum to, per
slot (the unpacked check); a slot out of range ends the job naming the dominator.

OU only: under Paillier the masks are uniform on the whole of Z_n (perfect hiding against a dominator that
encrypts what it likes), which leaves no room for a second slot; the launcher refuses ``--he-pack`` with
``--he-scheme paillier``. Under OU a malicious dominator could encrypt ϑ's that carry features past a
slot's 2^-STAT_BITS margin and read one batch before the slot check ends the job: packing is for OU's
documented semi-honest dominator.
"""

from __future__ import annotations

import collections
import secrets
from typing import NamedTuple

import numpy as np

from protocols.errors import ProtocolViolation
from protocols.label_he import (
    FEATURE_BITS,
    PREPARED_PASSES,
    THETA_BITS,
    VALUE_BITS,
    BlockGradient,
    LabelKey,
    Pending,
    ou_mask_bits,
)

#: Statistical hiding per slot: the distribution of a masked slot is within 2^-STAT_BITS of the mask's
#: own, whatever the value. 60 keeps a whole job of up to 2^20 slots (about 100 a9a epochs at B = 256
#: with three passive parties) within 2^-40, the usual statistical security parameter, and still fits
#: k = 4 slots in a 2048-bit key's 681 bits for every B the launcher accepts (B < 2^12).
STAT_BITS = 60
_WHAT_REPLY = "decrypted gradient"


class Layout(NamedTuple):
    """k slots of w bits per plaintext; honest column sums lie in (−2^G, 2^G)."""
    slots: int
    width: int
    gradient_bits: int

    @property
    def words(self) -> int:
        """uint64 words of one returned plaintext."""
        return -(-self.slots * self.width // 64)

    def packed_count(self, values: int) -> int:
        return -(-values // self.slots)


def layout(batch: int, key_bits: int) -> Layout:
    """The job's layout for batches of ``batch`` rows under a ``key_bits`` OU key (module doc)."""
    g = int(batch).bit_length() + 2 * VALUE_BITS + THETA_BITS + FEATURE_BITS
    width = g + 2 + STAT_BITS
    slots = ou_mask_bits(key_bits) // width
    if slots < 2:
        raise ValueError(f"a {key_bits}-bit key has no room for two {width}-bit slots")
    return Layout(slots, width, g)


def pack_values(values: list[int], lay: Layout) -> list[int]:
    """Σ_s 2^(ws)·(v_s + 2^G) per group of k values: the plaintext a pack of honest values decrypts to
    without its masks (the tests check packed decryptions against it). A value outside (−2^G, 2^G)
    would spill into its neighbour's slot and is refused."""
    limit = 1 << lay.gradient_bits
    if any(not -limit < v < limit for v in values):
        raise OverflowError(f"a value outside ±2^{lay.gradient_bits} does not fit a {lay.width}-bit slot")
    return _pack_contents([v + limit for v in values], lay)


def _pack_contents(contents: list[int], lay: Layout) -> list[int]:
    """Σ_s 2^(ws)·c_s per group of k slot contents c (each in [0, 2^w))."""
    return [sum(c << (lay.width * s) for s, c in enumerate(contents[start:start + lay.slots]))
            for start in range(0, len(contents), lay.slots)]


def unpack_slots(packed: list[int], count: int, lay: Layout) -> list[int]:
    """The ``count`` slot contents (each in [0, 2^w)) of packed plaintexts, in column order."""
    full = (1 << lay.width) - 1
    return [(packed[j // lay.slots] >> (lay.width * (j % lay.slots))) & full for j in range(count)]


def decrypt_packed(key: LabelKey, source: int, payload: bytes, batch: int, lay: Layout) -> np.ndarray:
    """Dominator: the plaintexts of a passive party's packed masked gradient, ``lay.words`` uint64 words
    each; at most the ⌈(B − 1)/k⌉ values that B − 1 columns fill, each in [0, 2^(k·w)), or the job ends
    naming the sender."""
    most = lay.packed_count(batch - 1)
    values = key.decrypt(source, payload, most, f"a batch of {batch} packed {lay.slots} a value",
                         f"B − 1 columns need at most {most}; more could let ϑ be solved for")
    top = 1 << (lay.slots * lay.width)
    out = np.empty((len(values), lay.words), dtype=np.uint64)
    mask = (1 << 64) - 1
    for t, v in enumerate(values):
        v = int(v)
        if not 0 <= v < top:
            raise ProtocolViolation(source, "masked gradient", f"packed value {t} decrypts outside "
                                    f"[0, 2^{lay.slots * lay.width}), where no honest pack lies")
        out[t] = [(v >> (64 * w)) & mask for w in range(lay.words)]
    return out.ravel()


class PackedBlockGradient(BlockGradient):
    """A passive party's side with packing: :meth:`masked_packed` and :meth:`unmask_packed` (the SVRG
    snapshot's full pass keeps the unpacked :meth:`masked` / :meth:`unmask`)."""

    def __init__(self, source: int, public_key: bytes, *, block, batch: int, key_bits: int = 2048
                 ) -> None:
        super().__init__(source, public_key, block=block, scheme="ou", key_bits=key_bits)
        self.layout = layout(batch, key_bits)
        self._slot_masks: list[int] | None = None
        #: packed masks encrypted ahead of need, oldest first; each taken once (the base class's pool
        #: holds the unpacked ones of the snapshot's full pass)
        self._prepared_slots: collections.deque = collections.deque()

    def encrypt_slot_masks(self) -> tuple[list[int], object]:
        """One packed pass's slot masks (uniform on [0, 2^(w−1)), fresh from OS entropy) and the fresh
        encryption of each packed value's Σ_s 2^(ws)·(r_s + 2^G)."""
        lay = self.layout
        slot_masks = [secrets.randbits(lay.width - 1) for _ in range(lay.packed_count(self.block.n_cols)
                                                                     * lay.slots)]
        plain = _pack_contents([r + (1 << lay.gradient_bits) for r in slot_masks], lay)
        return slot_masks, self._encryptor.encrypt(self._kit.array(np.array(plain, dtype=object), self._big))

    def prepare_masks(self) -> None:
        """:meth:`BlockGradient.prepare_masks` for the batches' packed passes."""
        if len(self._prepared_slots) < PREPARED_PASSES:
            self._prepared_slots.append(self.encrypt_slot_masks())

    def masked_packed(self, payload: bytes, rows: np.ndarray) -> bytes:
        """[[Σ_s 2^(ws)·(g_s + 2^G + r_s)]] per group of k columns, from the batch's encrypted ϑ's; keeps
        the slot masks for :meth:`unmask_packed`."""
        masked, (self._slot_masks, self._bounds) = self.masked_packed_batch(payload, rows)
        return masked

    def masked_packed_batch(self, payload: bytes, rows: np.ndarray) -> tuple[bytes, Pending]:
        """:meth:`masked_packed` that returns the slot masks and bounds instead of keeping them
        (:meth:`BlockGradient.masked_batch` says why); :meth:`unmask_packed_batch` takes them back."""
        lay, d = self.layout, self.block.n_cols
        sums, bounds = self.sums_and_bounds(payload, rows)
        count = lay.packed_count(d)
        try:  # a prepared set, removed from the pool: each is used once
            slot_masks, masks = self._prepared_slots.popleft()
        except IndexError:
            slot_masks, masks = self.encrypt_slot_masks()
        pending = Pending(slot_masks, bounds)
        if sums is None:
            return masks.serialize(), pending
        ev = self._evaluator
        # an encrypted zero in the last value's slots past column d_l − 1
        zero = self._encryptor.encrypt(self._kit.array(np.zeros(1, np.int64), self._encoder)) \
            if count * lay.slots > d else None

        def slot(s: int):
            group = sums[[t * lay.slots + s if t * lay.slots + s < d else 0 for t in range(count)]]
            if (count - 1) * lay.slots + s >= d:
                group[count - 1] = zero[0]
            return group

        shift = self._kit.array(np.array([1 << lay.width] * count, dtype=object), self._big)
        acc = slot(lay.slots - 1)
        for s in range(lay.slots - 2, -1, -1):
            acc = ev.add(ev.mul(acc, shift), slot(s))
        return ev.add(acc, masks).serialize(), pending

    def unmask_packed(self, words: np.ndarray) -> np.ndarray:
        """The batch gradient (float64, d_l values) from the dominator's packed reply; a slot outside what
        the batch's honest ϑ's can sum to ends the job naming the dominator."""
        assert self._slot_masks is not None and self._bounds is not None, "masked_packed() first"
        pending, self._slot_masks, self._bounds = Pending(self._slot_masks, self._bounds), None, None
        return self.unmask_packed_batch(words, pending)

    def unmask_packed_batch(self, words: np.ndarray, pending: Pending) -> np.ndarray:
        """:meth:`unmask_packed` with the slot masks and bounds :meth:`masked_packed_batch` returned."""
        slot_masks, bounds = pending
        lay, d = self.layout, self.block.n_cols
        count = len(slot_masks) // lay.slots
        if words.dtype != np.uint64 or words.shape != (count * lay.words,):
            raise ProtocolViolation(self.source, _WHAT_REPLY, f"{words.size} words, expected "
                                    f"{count * lay.words}")
        rows = words.reshape(count, lay.words).tolist()
        packed = [sum(int(w) << (64 * i) for i, w in enumerate(row)) for row in rows]
        slots = unpack_slots(packed, count * lay.slots, lay)
        offset, out = 1 << lay.gradient_bits, np.empty(d)
        for j, (slot, r) in enumerate(zip(slots, slot_masks, strict=True)):
            g = slot - r - offset
            bound = bounds[j] if j < d else 0.0
            if abs(g) > bound:
                raise ProtocolViolation(self.source, _WHAT_REPLY, f"slot {j % lay.slots} of packed value "
                                        f"{j // lay.slots} (column {j}) unmasks to {abs(g):.3g}·2^-"
                                        f"{THETA_BITS + self.feature_bits}, more than the batch's ϑ's can "
                                        f"sum to: no honest key and reply give that")
            if j < d:
                out[j] = g / 2.0**(THETA_BITS + self.feature_bits)
        return out
