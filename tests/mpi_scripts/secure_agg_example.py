"""The example of ``protocols.secure_aggregation``'s docstring, run as written there, plus a check
against the plain sum. The example is read from the docstring (its one home), so a docstring that
drifts from the library fails this script.

Run: ``mpiexec -n 4 python -m mpi4py tests/mpi_scripts/secure_agg_example.py``.
"""

import textwrap

import numpy as np
from mpi4py import MPI

import protocols.secure_aggregation


def docstring_example(doc: str) -> str:
    """The indented block after the first line of ``doc`` that ends with ``::``."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("::")) + 1
    block = []
    for line in lines[start:]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block))


example: dict = {}
exec(compile(docstring_example(protocols.secure_aggregation.__doc__), "docstring example", "exec"), example)
comm, z, X_local, w_local = MPI.COMM_WORLD, example["z"], example["X_local"], example["w_local"]

# Test-only check: gather the blocks in the clear and compare.
blocks = comm.gather((X_local[:8], w_local), root=0)
if comm.rank == 0:
    plain = sum(X @ w for X, w in blocks)
    print("matches the plain sum:", bool(np.allclose(z, plain, rtol=0, atol=1e-8)))
