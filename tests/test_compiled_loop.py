"""``--engine compiled``: the numba pump of the B = 1 hot path (parties/compiled_loop.py) against the
Python path it must match, the jobs it refuses, and hostile messages it must reject naming the sender."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parties.config import ConfigError, RunConfig, validate
from tests.conftest import REPO_ROOT, requires_dataset, run_mpi
from tests.mpi_scripts.stall_runtime import TIMEOUT


def vfl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "vfl.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _train(out: Path, engine: str, *args: str) -> dict:
    proc = vfl("train", "--algorithm", "sgd", "-B", "1", "--gamma", "0.1", "--engine", engine,
               "--out", str(out), "--no-reference", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "result.json").read_text())


def _blocks(out: Path, q: int) -> list[np.ndarray]:
    return [np.load(out / f"party-{r}.ckpt.npz")["w"] for r in range(q)]


@pytest.fixture(scope="module", autouse=True)
def _compiled_once() -> None:
    """The pump compiled into numba's cache once, in its own process (no MPI in pytest's): otherwise
    each rank of the first job compiles it at once, on the same cores."""
    code = "from parties.compiled_pump import compile_once; compile_once()"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, check=True, timeout=300)


# ------------------------------------------------------------------------------------ refusals

REFUSED = [
    ({"batch_size": 2}, "-B 2"),
    ({"mode": "sync"}, "--mode sync"),
    ({"algorithm": "svrg"}, "--algorithm svrg"),
    ({"piggyback": True}, "--piggyback"),
    ({"secure_channels": True}, "--secure-channels"),
    ({"audit": True}, "--audit"),
    ({"label_privacy": "dp", "epsilon": 1.0, "active": 1}, "--label-privacy dp"),
    ({"straggler": 1}, "--straggler"),
    ({"link_delay_ms": 1.0}, "--link-delay"),
]


@pytest.mark.parametrize(("options", "named"), REFUSED, ids=[named for _, named in REFUSED])
def test_a_job_the_pump_cannot_serve_is_refused_in_one_line_naming_the_option(options: dict,
                                                                               named: str) -> None:
    base = {"algorithm": "sgd", "batch_size": 1, "engine": "compiled"}
    validate(RunConfig(**{**base, "engine": "python", **options}))  # the Python engine runs it
    with pytest.raises(ConfigError) as refused:
        validate(RunConfig(**{**base, **options}))
    line = str(refused.value)
    assert named in line and "--engine compiled" in line and "\n" not in line, line


def test_the_command_line_refuses_before_anything_starts(tmp_path: Path) -> None:
    proc = vfl("train", "-n", "3", "--algorithm", "sgd", "-B", "4", "--engine", "compiled",
               "--out", str(tmp_path / "run"))
    assert proc.returncode != 0
    assert "--engine compiled cannot run with -B 4" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("options", "named"), REFUSED, ids=[named for _, named in REFUSED])
def test_auto_takes_the_python_engine_for_a_job_the_pump_cannot_serve(options: dict, named: str) -> None:
    """``--engine auto`` (the default) never refuses: it takes the reference runtime for these jobs."""
    from parties.engine import engine_for

    assert engine_for(validate(RunConfig(**{"algorithm": "sgd", "batch_size": 1, **options}))) == "python"


def test_auto_takes_the_compiled_engine_for_the_papers_b1_job_and_says_so(tmp_path: Path) -> None:
    """The default engine is ``auto``: a B = 1 asynchronous SGD job runs on the pump, its summary line and
    ``result.json`` say which engine ran, and ``--engine python`` still reaches the reference runtime."""
    from parties.engine import engine_for

    assert RunConfig().engine == "auto"
    assert engine_for(validate(RunConfig(algorithm="sgd", batch_size=1))) == "compiled"
    args = ("-n", "3", "-m", "1", "--dataset", "breast-cancer", "--epochs", "0.5", "--eval-every", "0.5",
            "--out")
    default = vfl("train", "--algorithm", "sgd", *args, str(tmp_path / "auto"))
    assert default.returncode == 0, default.stderr
    assert "VFB²-sgd (async, compiled engine) on breast-cancer" in default.stdout
    assert json.loads((tmp_path / "auto" / "result.json").read_text())["engine"] == "compiled"
    python = vfl("train", "--algorithm", "sgd", "--engine", "python", *args, str(tmp_path / "python"))
    assert "VFB²-sgd (async) on breast-cancer" in python.stdout
    assert json.loads((tmp_path / "python" / "result.json").read_text())["engine"] == "python"


def test_the_launcher_compiles_only_when_the_cache_is_missing_or_older_than_the_loop(tmp_path: Path) -> None:
    from parties.engine import _cache_is_fresh

    source = tmp_path / "compiled_loop.py"
    source.write_text("# the loop")
    assert not _cache_is_fresh(source)  # never compiled
    (tmp_path / "__pycache__").mkdir()
    index = tmp_path / "__pycache__" / "compiled_loop.pump-428.py311.nbi"
    index.write_text("index")
    os.utime(source, (time.time() + 60, time.time() + 60))
    assert not _cache_is_fresh(source)  # the loop changed since
    os.utime(index, (time.time() + 120, time.time() + 120))
    assert _cache_is_fresh(source)
    assert _cache_is_fresh()  # this checkout: compiled by the module's fixture



def test_the_launcher_compiles_in_one_process_before_the_ranks_start(monkeypatch, capsys) -> None:
    from parties import engine

    monkeypatch.setattr(engine, "_cache_is_fresh", lambda: False)
    engine.warm_cache(RunConfig(algorithm="sgd", batch_size=1, engine="python"))
    assert capsys.readouterr().err == ""  # the Python engine needs no compiling
    engine.warm_cache(RunConfig(algorithm="sgd", batch_size=1))
    assert "compiling the B = 1 loop (--engine compiled) for this checkout, once" in capsys.readouterr().err


def test_a_long_wait_sleeps_instead_of_taking_a_core_from_other_jobs() -> None:
    """The pump yields the core for its first probes, then sleeps between them: a rank whose peer is not
    running leaves the cores to the jobs beside it (an HFL round beside a B = 1 job: 0.35 s against
    0.74 s with yielding alone, CHANGELOG). Yielding alone read 1.00 s of CPU a second here, the
    backoff 0.13."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "tests/mpi_scripts/pump_wait_cpu.py", "1.0"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    cpu = float(done.stdout.split()[-1])
    assert cpu < 0.5, f"the waiting thread used {cpu:.2f} s of CPU in 1 s"

# ------------------------------------------------------------------------------ the same iterates


@pytest.mark.mpi
@pytest.mark.parametrize(("updates", "data"), [
    ("eager", ("--dataset", "breast-cancer")),
    ("lazy", ("--dataset", "breast-cancer")),
    ("eager", ("--dataset", "diabetes", "--problem", "least-squares", "--gamma", "0.01")),
], ids=["eager", "lazy", "least-squares"])
def test_one_dominator_gets_the_python_inline_paths_model(tmp_path: Path, updates: str, data: tuple) -> None:
    """One dominator, -P 1, two segments (--eval-every 0.5), either kernel family, a classification and a
    regression: the compiled job's blocks equal the Python path's (same seed: the same rows, the same
    kernels in the same order)."""
    common = ("-n", "3", "-m", "1", *data, "--epochs", "1", "--eval-every", "0.5", "--updates", updates)
    python = _train(tmp_path / "python", "python", *common)
    compiled_pumps = set(REPO_ROOT.glob("parties/__pycache__/compiled_loop.pump-*.nbc"))
    assert compiled_pumps, "the module's fixture compiled no pump where the launcher looks for it"
    compiled = _train(tmp_path / "compiled", "compiled", *common)
    # the ranks loaded the pump compiled once for the session: a read-only array (diabetes' labels) once
    # made each rank compile its own, 30 s of a 0.02 s job
    assert set(REPO_ROOT.glob("parties/__pycache__/compiled_loop.pump-*.nbc")) == compiled_pumps
    assert compiled["updates"] == python["updates"] > 0
    blocks = zip(_blocks(tmp_path / "compiled", 3), _blocks(tmp_path / "python", 3), strict=True)
    for mine, reference in blocks:
        assert np.abs(reference).max() > 0
        np.testing.assert_allclose(mine, reference, rtol=0, atol=1e-9)


def _learns_as_the_python_path_does(tmp_path: Path, common: tuple, floor: float) -> None:
    """The same job on both engines: the same number of updates, and the compiled one's test accuracy
    above ``floor`` and within two points of the Python path's."""
    python = _train(tmp_path / "python", "python", *common)
    compiled = _train(tmp_path / "compiled", "compiled", *common)
    assert compiled["updates"] == python["updates"]
    accuracy, reference = compiled["record"]["test_accuracy"], python["record"]["test_accuracy"]
    assert accuracy > floor and abs(accuracy - reference) <= 0.02, (accuracy, reference)

@pytest.mark.mpi
def test_several_requests_in_flight_learn_as_the_python_path_does(tmp_path: Path) -> None:
    """-P 4: each dominator keeps four requests open (each party holds a slot per request), steps them
    in request order; the model learns breast-cancer as the Python path's does."""
    common = ("-n", "4", "-m", "4", "-P", "4", "--dataset", "breast-cancer", "--epochs", "2")
    _learns_as_the_python_path_does(tmp_path, common, floor=0.93)


@pytest.mark.mpi
def test_a_resumed_compiled_job_goes_on(tmp_path: Path) -> None:
    common = ("-n", "3", "-m", "2", "--dataset", "breast-cancer")
    first = _train(tmp_path / "run", "compiled", *common, "--epochs", "0.5")
    resumed = _train(tmp_path / "run", "compiled", *common, "--epochs", "1", "--resume")
    assert first["epochs"] == 0.5 and resumed["epochs"] == 1
    assert resumed["record"]["test_accuracy"] > 0.9


@pytest.mark.mpi
@requires_dataset("a9a")
def test_the_issue_command_trains_a9a_as_the_python_path_does(tmp_path: Path) -> None:
    """``vfl train -n 4 -m 4 --dataset a9a --algorithm sgd -B 1 --gamma 0.1 --engine compiled`` (a
    quarter epoch): every dominator's updates, and the Python path's test accuracy within two points
    (four dominators interleave differently in every run of either engine: a full run read 0.823
    against 0.838; one dominator gives the same blocks to 1e-9, above)."""
    common = ("-n", "4", "-m", "4", "--dataset", "a9a", "--epochs", "0.25")
    _learns_as_the_python_path_does(tmp_path, common, floor=0.8)


# ------------------------------------------------------------------------------------ hostile peers


@pytest.mark.mpi
@pytest.mark.parametrize(("scenario", "named"), [
    ("row", "party 1 sent an invalid (ϑ, i) message: a row is not an integer in 0..39"),
    ("request", "party 1 sent an invalid REQUEST: sample indices 40..40 are not in 0..39"),
    ("sum", "party 1 sent an invalid aggregation message: request id 9 where 10 is open at party 0"),
])
def test_a_forged_message_ends_the_job_naming_its_sender(scenario: str, named: str) -> None:
    proc = run_mpi(3, ["tests/mpi_scripts/tamper_compiled.py", scenario], timeout=60, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 139, -11), output
    assert "NOT REJECTED" not in output
    assert named in output, output


@pytest.mark.mpi
def test_a_python_party_that_stops_answering_is_named_by_the_pumps_deadline() -> None:
    """Parties 0 and 1 compiled, party 2 on the Python path (the same wire: they train together first),
    then party 2's communication thread ignores every aggregation message while it heartbeats: the
    heartbeat thread reads the pump's open requests and ends the job naming party 2."""
    proc = run_mpi(3, ["tests/mpi_scripts/stall_runtime.py", "tree", "compiled"], check=False, timeout=60)
    assert proc.returncode != 0 and "NOT ENDED" not in proc.stdout and "STALL" in proc.stdout, proc.stdout
    assert re.search(r"stop \(failed\): party 2 has been silent for [\d.]+ s while party \d waited for its "
                     r"partial sum", proc.stderr), proc.stderr
    stalled = time.time() - float(re.search(r"STALL (\d+\.\d+)", proc.stdout).group(1))
    assert stalled < TIMEOUT + 2, f"the job took {stalled:.1f} s after the stall to end"


@pytest.mark.mpi
@pytest.mark.parametrize(("scenario", "inflight", "detail"), [
    ("flood", 1, "REQUEST: request id 11 "),
    ("flood", 2, "REQUEST: request id 12 "),
    ("unrequested", 1, "(ϑ, i) message: #10 is for a step it never requested"),
    ("rows", 1, "(ϑ, i) message: #10 is for rows [7] where its request aggregated rows [3]"),
    ("twice", 1, "(ϑ, i) message: #11 is for a step it never requested"),
])
def test_a_dominator_beyond_its_schedule_is_named_by_the_pump(tmp_path: Path, scenario: str, inflight: int,
                                                              detail: str):
    """``tests/test_hostile_schedule.py``'s attacks, parties 0 and 2 on the pump (B = 1; -P 1 and 2)."""
    from parties.outcomes import decisive_verdict, read_verdicts

    proc = run_mpi(3, ["tests/mpi_scripts/hostile_schedule.py", scenario, str(tmp_path), "compiled",
                       str(inflight)], check=False, timeout=60)
    output = proc.stdout + proc.stderr
    assert "ATTACK" in proc.stdout and proc.returncode != 0 and "NOT REJECTED" not in output, output
    verdict = decisive_verdict(read_verdicts(tmp_path, 3))
    assert verdict is not None and f"party 1 sent an invalid {detail}" in verdict, (verdict, output)


@pytest.mark.mpi
@pytest.mark.parametrize(("scenario", "detail"), [
    ("done-low", "DONE message: count 5 is below the 10 (ϑ, i) messages received"),
    ("done-twice", "DONE message: for segment 1 where 2 was expected (a second or replayed DONE"),
])
def test_a_lying_done_is_caught_from_the_pumps_counts(scenario: str, detail: str) -> None:
    """Party 1 (Python path) lies in a DONE to party 0 (the pump counted its (ϑ, i))."""
    proc = run_mpi(3, ["tests/mpi_scripts/tamper_counts.py", scenario, "compiled"], check=False, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NOT REJECTED" not in output, output
    assert f"party 1 sent an invalid {detail}" in output, output


@pytest.mark.mpi
def test_a_derived_and_decaying_step_reaches_the_passive_parties_pumps(tmp_path: Path) -> None:
    """The step derived from the data (set after the pump is built) and ``--gamma-decay`` (set at each
    segment's end) go through ``LinearPart.set_step``; the pump keeps γ in its own arrays, so a party whose
    pump never starts a segment (a passive one, -m 1) must get both: two epochs, the blocks equal the
    Python path's. (Without the hook the passive pumps stepped with the rule's first γ and the job
    diverged.)"""
    common = ("-n", "3", "-m", "1", "--dataset", "breast-cancer", "--epochs", "2", "--eval-every", "1",
              "--gamma-decay", "1", "--updates", "lazy", "--gamma", "auto")
    python = _train(tmp_path / "python", "python", *common)
    compiled = _train(tmp_path / "compiled", "compiled", *common)
    assert compiled["updates"] == python["updates"] > 0
    blocks = zip(_blocks(tmp_path / "compiled", 3), _blocks(tmp_path / "python", 3), strict=True)
    for mine, reference in blocks:
        np.testing.assert_allclose(mine, reference, rtol=0, atol=1e-9)
