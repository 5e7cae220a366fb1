"""``python -m experiments label_he_floor``: the CPU an HE epoch's operations need (issue 30, item 3)."""

from __future__ import annotations

import math

from experiments.bench_label_he_floor import (
    COLOURS,
    PASSIVE,
    TRAIN_ROWS,
    batch_cpu,
    epoch_cpu,
    shift_reference,
    table,
)


def test_packing_cuts_the_decryptions_cpu_and_pays_for_it_in_shifts(ou_key):
    """The per-batch CPU of each operation, measured with the protocol's own classes: packing four values
    to a plaintext must cut the dominator's decryption CPU at least twofold (it decrypts ⌈31/4⌉ values,
    not 31) and cost shifts that the unpacked reply does not have."""
    cpu = batch_cpu(64, rounds=1, repeat=1, key=ou_key)
    assert set(cpu) == {"unpacked", "packed"} and all(set(ops) == set(COLOURS) for ops in cpu.values())
    assert cpu["packed"]["decryptions"] < cpu["unpacked"]["decryptions"] / 2
    assert cpu["unpacked"]["packing shifts"] == 0 < cpu["packed"]["packing shifts"]
    assert all(s >= 0 for ops in cpu.values() for s in ops.values())


def test_an_epoch_counts_the_encryptions_once_and_the_rest_per_passive_party():
    per_batch = {op: 1.0 for op in COLOURS}
    epoch = epoch_cpu(per_batch, 1024)
    batches = math.ceil(TRAIN_ROWS / 1024)
    assert epoch["encrypt ϑ"] == batches and epoch["decryptions"] == batches * PASSIVE


def test_the_shift_is_timed_in_heu_and_in_gmp_and_said_in_the_table(ou_key):
    """The GMP reference times the same arithmetic as HEU's shift: both positive, of the layout's slot
    width, and a 2,048-bit modular exponentiation by 2^w is at least w squarings, so neither can be
    faster than a microsecond; the table says both."""
    ref = shift_reference(64, rounds=1, count=8, key=ou_key)
    assert ref["width"] > 100 and ref["HEU"] > 1e-6 and ref["GMP"] > 1e-6
    meta = {"cpu": "cpu", "cores": 2, "load_before": (1.0,), "load_after": (1.0,), "command": "c",
            "shift": ref}
    assert f"×2^{ref['width']}" in table(meta, []) and "GMP" in table(meta, [])
