"""Three ranks whose sample ids differ at rank 2: ``check_aligned`` must stop the job naming it.
``argv[1]``: the folder for the ranks' verdict files (a line printed just before ``Abort`` may never reach
the launcher; parties/lifecycle.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from parties.lifecycle import report_verdicts_to
from parties.loading import ids_digest
from parties.runtime import stop_job
from parties.training import MisalignedError, check_aligned

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
report_verdicts_to(Path(sys.argv[1]) / f"verdict-{rank}.txt")
train_ids = np.arange(100)
if rank == 2:
    train_ids = train_ids[::-1].copy()
party = SimpleNamespace(ids_digest=ids_digest(train_ids, np.arange(100, 120)))
try:
    check_aligned(comm, party)
except MisalignedError as err:
    stop_job(comm, rank, "usage", str(err))
