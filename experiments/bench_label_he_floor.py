"""The CPU an a9a ``--label-privacy he`` epoch needs, operation by operation, and the floor it sets.

Issue 30, item 3 asks for an HE-SGD a9a epoch (q = 4, OU 2048 bits, B = 256 and 1,024) in ≤ 2 s on this
2-core machine. Whatever overlaps with what, an epoch cannot take less than the CPU its operations need
divided by the cores. This script measures that CPU with the protocol's own classes
(``protocols/label_he.py``, ``protocols/label_he_pack.py``): process CPU time of each operation of one
batch on an a9a-shaped passive block (31 one-hot columns, 3.5 non-zeros a row), the best of three rounds,
then scales it to an epoch: ⌈26,049 / B⌉ batches, three passive parties. The process pins itself to one
core first: HEU computes on a thread pool, and with two cores free its threads' waiting counted as CPU
(an epoch at B = 256 read 10.0 s of CPU unpinned, 6.6 s pinned, back to back at load 4).

* dominator: encrypt the batch's B values of ϑ; decrypt each passive party's reply (d_l values, or
  ⌈d_l / 4⌉ packed);
* each passive party: the encrypted column sums, its masks' fresh encryptions, and (packed) the shifts
  that put four columns in one plaintext.

One shift is also timed in GMP (``gmpy2``, same sizes), against HEU's: the largest operation of a
packed epoch, in the fastest big-number library, says whether another library could lower the floor.

    python -m experiments label_he_floor [--batches 256 1024] [--rounds 3]

Outputs in ``experiments/results/label_he_floor/``: ``results.json`` (with the load average and CPU model),
``table.md`` and ``floor.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from experiments._machine import cpu_model

OUT = Path(__file__).resolve().parent / "results" / "label_he_floor"
#: a9a's training rows, q = 4 parties: three passive ones, each with 31 of the 123 one-hot columns
TRAIN_ROWS, PASSIVE, COLUMNS, NNZ_PER_ROW = 26_049, 3, 31, 3.5
GOAL_S = 2.0
#: one colour per operation, in the order the bars stack
COLOURS = {"encrypt ϑ": "tab:blue", "column sums": "tab:orange", "mask encryptions": "tab:green",
           "packing shifts": "tab:red", "decryptions": "tab:purple"}


def _cpu(fn, rounds: int, repeat: int) -> float:
    """Process CPU seconds per call of ``fn``: the best of ``rounds`` rounds of ``repeat`` calls."""
    best = math.inf
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(repeat):
            fn()
        best = min(best, (time.process_time() - started) / repeat)
    return best


def batch_cpu(batch: int, rounds: int = 3, repeat: int = 5, key=None) -> dict[str, dict[str, float]]:
    """CPU seconds of each operation of one batch, unpacked and packed (one passive party's share);
    ``key``: an OU 2048 :class:`~protocols.label_he.LabelKey` (default: a fresh one)."""
    from protocols import label_he, label_he_pack

    block = _block(batch)
    key = key or label_he.LabelKey("ou", 2048)
    rng = np.random.default_rng(0)
    rows, thetas = rng.choice(block.n_rows, batch, replace=False), rng.uniform(-1, 1, batch)
    payload = key.encrypt(thetas)
    plain = label_he.BlockGradient(0, key.public_bytes(), block=block, scheme="ou", key_bits=2048)
    packed = label_he_pack.PackedBlockGradient(0, key.public_bytes(), block=block, batch=batch)
    masked = plain.masked_batch(payload, rows)[0]
    masked_packed = packed.masked_packed_batch(payload, rows)[0]
    sums = _cpu(lambda: plain.sums_and_bounds(payload, rows), rounds, repeat)
    slot_masks = _cpu(packed.encrypt_slot_masks, rounds, repeat)
    whole_packed = _cpu(lambda: packed.masked_packed_batch(payload, rows), rounds, repeat)
    common = {"encrypt ϑ": _cpu(lambda: key.encrypt(thetas), rounds, repeat), "column sums": sums}
    return {
        "unpacked": {**common, "mask encryptions": _cpu(plain.encrypt_masks, rounds, repeat),
                     "packing shifts": 0.0,
                     "decryptions": _cpu(lambda: key.decrypt_masked(1, masked, batch), rounds, repeat)},
        "packed": {**common, "mask encryptions": slot_masks,
                   "packing shifts": max(whole_packed - sums - slot_masks, 0.0),
                   "decryptions": _cpu(lambda: label_he_pack.decrypt_packed(key, 1, masked_packed, batch,
                                                                           packed.layout), rounds, repeat)},
    }


def shift_reference(batch: int, rounds: int = 3, count: int = 64, key=None) -> dict[str, float]:
    """CPU seconds of one packing shift (an OU ciphertext times 2^w, w the layout's slot width) in HEU,
    and of the same arithmetic in GMP (``gmpy2.powmod`` of a 2,048-bit value by 2^w modulo a random odd
    2,048-bit modulus): whether a faster big-number library could lower the floor."""
    import secrets

    import gmpy2

    from protocols import label_he, label_he_pack

    key = key or label_he.LabelKey("ou", 2048)
    lay = label_he_pack.layout(batch, 2048)
    packed = label_he_pack.PackedBlockGradient(0, key.public_bytes(), block=_block(batch), batch=batch)
    kit, ev = packed._kit, packed._evaluator
    cts = packed._encryptor.encrypt(kit.array(np.arange(count, dtype=np.int64), packed._encoder))
    shift = kit.array(np.array([1 << lay.width] * count, dtype=object), packed._big)
    modulus = gmpy2.mpz(secrets.randbits(2048) | (1 << 2047) | 1)
    values = [gmpy2.mpz(secrets.randbelow(int(modulus))) for _ in range(count)]
    exponent = gmpy2.mpz(1) << lay.width
    return {"HEU": _cpu(lambda: ev.mul(cts, shift), rounds, 1) / count,
            "GMP": _cpu(lambda: [gmpy2.powmod(v, exponent, modulus) for v in values], rounds, 1) / count,
            "width": lay.width}


def _block(batch: int):
    """An a9a-shaped passive block of 4·``batch`` rows: 31 one-hot columns, 3.5 non-zeros a row."""
    from vertical.algorithms.vfb2 import Block

    X = sp.random(4 * batch, COLUMNS, density=NNZ_PER_ROW / COLUMNS, random_state=0, format="csr")
    X.data[:] = 1.0
    return Block.from_matrix(X)


def epoch_cpu(per_batch: dict[str, float], batch: int) -> dict[str, float]:
    """An epoch's CPU seconds per operation: the dominator's encryptions once a batch, everything else
    once per passive party a batch."""
    batches = math.ceil(TRAIN_ROWS / batch)
    return {op: batches * s * (1 if op == "encrypt ϑ" else PASSIVE) for op, s in per_batch.items()}


def table(meta: dict, rows: list[dict]) -> str:
    ops = list(COLOURS)
    lines = ["| B | decryption | " + " | ".join(f"{op} (s)" for op in ops)
             + " | CPU an epoch (s) | floor on the cores (s) |", "|---" * (len(ops) + 4) + "|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['decryption']} | "
                     + " | ".join(f"{r['epoch_cpu_s'][op]:.2f}" for op in ops)
                     + f" | {r['total_cpu_s']:.2f} | **{r['floor_s']:.2f}** |")
    if "shift" in meta:
        ref = meta["shift"]
        lines.append(f"\nOne packing shift (×2^{ref['width']}): HEU {ref['HEU'] * 1e6:.0f} µs, GMP "
                     f"(`gmpy2.powmod`, same sizes) {ref['GMP'] * 1e6:.0f} µs of CPU.")
    lines.append(f"\nThe goal: ≤ {GOAL_S:g} s an epoch. {meta['cpu']}, load {meta['load_before'][0]:.2f} "
                 f"before and {meta['load_after'][0]:.2f} after; command: `{meta['command']}`.")
    return "\n".join(lines) + "\n"


def plot(meta: dict, rows: list[dict], path: Path) -> None:
    from experiments._plotting import pyplot, save

    fig, ax = pyplot().subplots(figsize=(7, 4), layout="constrained")
    labels = [f"B = {r['batch']}\n{r['decryption']}" for r in rows]
    bottom = np.zeros(len(rows))
    for op, colour in COLOURS.items():
        values = np.array([r["epoch_cpu_s"][op] / meta["cores"] for r in rows])
        ax.bar(labels, values, bottom=bottom, color=colour, label=op)
        bottom += values
    ax.axhline(GOAL_S, color="black", linestyle="--", label=f"goal ({GOAL_S:g} s)")
    ax.set_ylabel(f"CPU seconds an epoch / {meta['cores']} cores")
    ax.set_title("a9a HE-SGD epoch, OU 2048: the CPU floor per operation")
    ax.legend(fontsize=8)
    ax.set_xlabel("batch size and decryption")
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments label_he_floor",
                                description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    cores, machine = len(os.sched_getaffinity(0)), cpu_model()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before HEU starts its pool: the docstring
    load_before, rows = os.getloadavg(), []
    for batch in args.batches:
        for decryption, per_batch in batch_cpu(batch, args.rounds).items():
            epoch = epoch_cpu(per_batch, batch)
            total = sum(epoch.values())
            rows.append({"batch": batch, "decryption": decryption, "batch_cpu_s": per_batch,
                         "epoch_cpu_s": epoch, "total_cpu_s": total, "floor_s": total / cores})
    shift = shift_reference(max(args.batches), args.rounds)
    meta = {"cpu": machine, "cores": cores, "load_before": load_before, "load_after": os.getloadavg(),
            "command": " ".join(["python -m experiments label_he_floor", *given]), "shift": shift}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    (args.out / "table.md").write_text(table(meta, rows))
    plot(meta, rows, args.out / "floor.png")
    print(table(meta, rows))
    return {**meta, "rows": rows}


if __name__ == "__main__":
    main()
