#!/usr/bin/env bash
# Launch a VFB² job: one MPI rank per party, under the mpiexec of the `mpich` wheel.
#
#   ./mpirun.sh                                   # the default job: 4 parties, 2 active, breast-cancer
#   ./mpirun.sh -n 4 --dataset a9a --algorithm svrg --threads 2
#   ./mpirun.sh --help                            # every option and its default (the same as `vfl train`)
#
# Options are validated before mpiexec starts; each run gets its own folder runs/<time>-<dataset>
# (runs/latest points to the newest) unless --out says otherwise.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${python}" -m vfl.cli train "$@"
