"""The threads of an in-process HFL simulation (``experiments``' entry points): OpenMP's idle threads
spin briefly before they sleep, unless the caller chose otherwise, and torch gets the CPUs the process may use
or ``--compute-threads``. Spinning threads beside a busy MPI job made a FedAvg round 10-20× slower
(``experiments/results/hfl_busy/table.md``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, check=True, env={**clean, "PYTHONPATH": str(REPO_ROOT), **env})


def test_torch_loaded_by_an_experiment_spins_its_idle_threads_only_briefly():
    """libgomp prints its settings when torch loads it: its spin count must be 10,000, not the 300,000
    spins it takes when nothing sets it."""
    proc = _python("import experiments, torch", OMP_DISPLAY_ENV="verbose")
    if "GOMP_SPINCOUNT" not in proc.stderr:
        pytest.skip("torch's OpenMP here is not libgomp: nothing prints its spin count")
    assert "GOMP_SPINCOUNT = '10000'" in proc.stderr


def test_a_wait_policy_or_spin_count_the_caller_set_is_kept():
    proc = _python("import os, experiments; print(os.environ.get('GOMP_SPINCOUNT'))",
                   OMP_WAIT_POLICY="ACTIVE")
    assert proc.stdout.strip() == "None"
    proc = _python("import os, experiments; print(os.environ['GOMP_SPINCOUNT'])", GOMP_SPINCOUNT="5")
    assert proc.stdout.strip() == "5"


def test_the_simulation_takes_the_cpus_it_may_use_or_the_option():
    torch = pytest.importorskip("torch")
    from experiments.hfl_quick import apply_threads
    from parties.threads import available_cpus

    before = torch.get_num_threads()
    try:
        assert apply_threads(None) == available_cpus() == torch.get_num_threads()
        assert apply_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_thread_count_is_one_line(value, capsys):
    pytest.importorskip("torch")
    from experiments import hfl_quick

    with pytest.raises(SystemExit) as stop:
        hfl_quick.main(["--compute-threads", value])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"must be an integer of at least 1 (got {value!r})")


def test_the_busy_benchmark_table_gives_each_setting_its_spread_and_the_mpi_ratio():
    from experiments.bench_hfl_busy import table

    names = ["default: 2 threads", "before: spinning", "parties.hfl, 4 ranks (P = 3)"]
    seconds = {names[0]: (0.1, 0.12, 0.5), names[1]: (1.0, 2.0, 3.0), names[2]: (0.15, 0.15, 0.2)}
    runs = [{"setting": setting, "config": name, "repeat": rep, "seconds_per_round": value * factor,
             "load_before": 1.0 + rep}
            for setting, factor in (("idle", 1), ("beside", 3)) for name in names
            for rep, value in enumerate(seconds[name])]
    lines = table(runs, names, "python -m experiments hfl_busy").splitlines()
    assert lines[0] == "| configuration | idle (goal ≤ 0.13 s) | beside (goal ≤ 0.4 s) |"
    assert lines[2] == "| default: 2 threads | 0.120 (0.100–0.500) | 0.360 (0.300–1.500) |"
    assert lines[5] == "| parties.hfl ÷ the simulation's default (goal ≤ 1.5×) | 1.25× | 1.25× |"
    assert "idle: 1.00–3.00; beside: 1.00–3.00" in lines[-1]
