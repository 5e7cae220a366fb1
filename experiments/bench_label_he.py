"""Cost of ``--label-privacy he`` per mini-batch, and the HE libraries it was chosen from.

The workload of one batch (protocols/label_he.py): the dominator encrypts B values of ϑ; each passive
party sums them into d_l encrypted block-gradient coordinates (one-hot data: additions only) and adds
d_l freshly encrypted masks; the dominator decrypts d_l values per passive party. This script times
each step with the protocol's own classes (HEU), and the three library candidates on the primitive
operations. ``phe`` is timed when installed; ``lightphe`` too, but install it in a separate venv: its
wheel ships a top-level ``tests`` package that shadows this repository's.

``python -m experiments bench_label_he`` writes ``results/label_he/bench.json`` with the load average
and CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

OUT = Path(__file__).resolve().parent / "results" / "label_he"


def _timed(fn, repeat: int) -> float:
    """Seconds per call, the best of three rounds of ``repeat`` calls (least disturbed by load)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - started) / repeat)
    return best


def protocol_batch(batch: int, columns: int, nnz_per_row: float, scheme: str, key_bits: int) -> dict:
    """Milliseconds of each step of one HE batch with ``protocols.label_he`` (one passive party)."""
    from protocols.label_he import BlockGradient, LabelKey
    from vertical.algorithms.vfb2 import Block

    rng = np.random.default_rng(0)
    started = time.perf_counter()
    key = LabelKey(scheme, key_bits)
    keygen = time.perf_counter() - started
    X = sp.random(4 * batch, columns, density=nnz_per_row / columns, random_state=0, format="csr")
    X.data[:] = 1.0  # one-hot, as a9a
    party = BlockGradient(0, key.public_bytes(), block=Block.from_matrix(X), scheme=scheme, key_bits=key_bits)
    rows = rng.integers(0, X.shape[0], batch)
    thetas = rng.uniform(-1, 1, batch)
    payload = key.encrypt(thetas)
    masked = party.masked(payload, rows)
    return {"scheme": scheme, "key_bits": key_bits, "batch": batch, "columns": columns,
            "keygen_s": keygen,
            "encrypt_batch_ms": 1e3 * _timed(lambda: key.encrypt(thetas), 2),
            "passive_masked_gradient_ms": 1e3 * _timed(lambda: party.masked(payload, rows), 2),
            "decrypt_block_ms": 1e3 * _timed(lambda: key.decrypt_masked(1, masked, batch), 2)}


def primitives(key_bits: int) -> list[dict]:
    """Encrypt, add and decrypt one value, per library and scheme that is installed."""
    rows = []
    from heu import phe as heu_phe

    for name, schema in (("heu-ou", heu_phe.SchemaType.OU), ("heu-paillier", heu_phe.SchemaType.ZPaillier)):
        kit = heu_phe.setup(schema, key_bits)
        enc, ev, dec = kit.encryptor(), kit.evaluator(), kit.decryptor()
        a, b = enc.encrypt_raw(123456), enc.encrypt_raw(654321)
        rows.append({"library": name, "encrypt_ms": 1e3 * _timed(lambda e=enc: e.encrypt_raw(123456), 20),
                     "add_us": 1e6 * _timed(lambda e=ev, x=a, y=b: e.add(x, y), 200),
                     "decrypt_ms": 1e3 * _timed(lambda d=dec, x=a: d.decrypt_raw(x), 20)})
    try:
        from phe import paillier
    except ImportError:
        pass
    else:
        public, private = paillier.generate_paillier_keypair(n_length=key_bits)
        a, b = public.encrypt(123456), public.encrypt(654321)
        rows.append({"library": "phe-paillier", "encrypt_ms": 1e3 * _timed(lambda: public.encrypt(123456), 3),
                     "add_us": 1e6 * _timed(lambda: a + b, 50),
                     "decrypt_ms": 1e3 * _timed(lambda: private.decrypt(a), 3)})
    try:
        from lightphe import LightPHE
    except ImportError:
        pass
    else:
        for algorithm in ("Okamoto-Uchiyama", "Paillier"):
            cs = LightPHE(algorithm_name=algorithm, key_size=key_bits)
            a, b = cs.encrypt(123456), cs.encrypt(654321)
            rows.append({"library": f"lightphe-{algorithm}",
                         "encrypt_ms": 1e3 * _timed(lambda c=cs: c.encrypt(1), 2),
                         "add_us": 1e6 * _timed(lambda x=a, y=b: x + y, 20),
                         "decrypt_ms": 1e3 * _timed(lambda c=cs, x=a: c.decrypt(x), 2)})
    return rows


def main(argv: list[str] | None = None) -> None:
    from experiments.label_attacks import _cpu

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--columns", type=int, default=31, help="d_l: a9a's 123 features over 4 parties")
    p.add_argument("--nnz-per-row", type=float, default=3.5, help="a9a: ~14 non-zeros a row over 4 parties")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    batches = [protocol_batch(args.batch, args.columns, args.nnz_per_row, scheme, 2048)
               for scheme in ("ou", "paillier")]
    result = {"load_before": load_before, "load_after": os.getloadavg(), "cpu": _cpu(),
              "protocol_batch": batches, "primitives": primitives(2048)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
