"""``vfl serve`` end to end: a served federation (q = 3) from a small trained run, asked over HTTP.

One breast-cancer run is trained (2 epochs) and scored with ``vfl predict`` once for the module; the
service is started from it as a user starts it, and requests go through a real HTTP client (urllib).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from parties.serving.front import UNKNOWN_ID
from tests.conftest import REPO_ROOT, run_mpi, says_died_first

pytestmark = pytest.mark.mpi

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def vfl(*args: str, timeout: float = 120) -> None:
    proc = subprocess.run([sys.executable, "-m", "vfl.cli", *args], cwd=REPO_ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        pytest.fail(f"vfl {args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """A q = 3 run and ``vfl predict``'s test scores, by id. Each party keeps its block in a folder of
    its own (``--party-dir``), as organisations do: the service reads each block only at its party."""
    base = tmp_path_factory.mktemp("serve")
    out = base / "run"
    vfl("train", "--out", str(out), "--no-progress", "-n", "3", "-m", "1", "--algorithm", "svrg",
        "--party-dir", str(base / "org{rank}" / "model"),
        "--epochs", "2", "--dataset", "breast-cancer", "--problem", "logistic", "--lam", "0.1",
        "--gamma", "0.02", timeout=240)
    vfl("predict", str(out))
    table = np.loadtxt(out / "predictions-test.csv", delimiter=",", skiprows=1)
    return out, {int(i): float(z) for i, z in zip(table[:, 0], table[:, 1], strict=True)}


class Service:
    """``vfl serve RUN --port 0`` in the background; its output is collected line by line."""

    def __init__(self, run: Path, *options: str) -> None:
        self.run = run
        self.proc = subprocess.Popen([sys.executable, "-m", "vfl.cli", "serve", str(run), "--port", "0",
                                      *options], cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(90):
            self.proc.kill()
            pytest.fail("vfl serve did not start listening:\n" + "".join(self.lines))
        listening = next(line for line in self.lines if "listening on" in line)
        self.url = listening.split("listening on ")[1].split()[0]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "listening on" in line:
                self.ready.set()

    def post(self, body: bytes | dict) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + "/score", data=data, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=30) as response:
            return json.loads(response.read())

    def pids(self) -> list[int]:
        return [int((self.run / "serving" / f"party-{r}.pid").read_text()) for r in range(3)]

    def end(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def service(trained):
    served = Service(trained[0])
    yield served
    if served.proc.poll() is None:
        served.proc.kill()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def test_scores_equal_vfl_predicts_for_the_same_rows(service, trained):
    _, predicted = trained
    ids = list(predicted)
    assert service.health()["sealed"] is False  # a run trained in clear is served in clear
    status, body = service.post({"ids": ids})
    assert status == 200
    results = body["results"]
    assert [r["id"] for r in results] == ids
    served = np.array([r["score"] for r in results])
    np.testing.assert_allclose(served, [predicted[i] for i in ids], atol=1e-6)  # 2**-32 fixed point
    for r in results:
        assert r["probability"] == pytest.approx(1 / (1 + np.exp(-r["score"])))
        assert r["class"] == (1 if r["score"] >= 0 else -1)
    status, one = service.post({"ids": [ids[5]], "output": "class"})
    assert status == 200 and one["results"] == [{"id": ids[5], "class": results[5]["class"]}]


def test_an_unknown_id_gets_its_own_error_and_the_others_their_scores(service, trained):
    known = next(iter(trained[1]))
    status, body = service.post({"ids": [known, 10**12, known]})
    assert status == 200
    first, unknown, again = body["results"]
    assert unknown == {"id": 10**12, "error": UNKNOWN_ID}
    assert first["score"] == pytest.approx(trained[1][known], abs=1e-6) and first == again


@pytest.mark.parametrize("body", [b"{", b'{"ids": "7"}', b'{"ids": [1.5]}', b'{"ids": [1], "output": "x"}'])
def test_a_malformed_request_gets_400_with_one_line(service, body):
    status, answer = service.post(body)
    assert status == 400 and "\n" not in answer["error"] and answer["error"]


def test_concurrent_clients_get_their_own_answers_equal_to_unbatched_ones(service, trained):
    predicted = trained[1]
    ids = list(predicted)
    rng = np.random.default_rng(0)
    asks = [rng.choice(ids, size=int(rng.integers(1, 4))).tolist() for _ in range(96)]
    before = service.health()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(service.post, ({"ids": a, "output": "score"} for a in asks)))
    for ask, (status, body) in zip(asks, answers, strict=True):
        assert status == 200 and [r["id"] for r in body["results"]] == ask
        np.testing.assert_allclose([r["score"] for r in body["results"]], [predicted[i] for i in ask],
                                   atol=1e-6)
    after = service.health()
    assert after["requests"] - before["requests"] == len(asks)
    assert after["batches"] - before["batches"] < len(asks)  # some requests shared an aggregation


def test_sigterm_stops_the_service_cleanly_with_no_orphans(service):
    assert service.health()["status"] == "ok"
    pids = service.pids()
    started = time.monotonic()
    service.proc.send_signal(signal.SIGTERM)
    assert service.end() == 0
    assert time.monotonic() - started < 10  # the parties stopped on the leader's word, not killed at 10 s
    time.sleep(0.5)
    assert not [pid for pid in pids if alive(pid)]
    assert "vfl serve: stopped" in "".join(service.lines)


def test_a_silent_party_gets_503_naming_it_and_the_service_ends_naming_it(trained):
    served = Service(trained[0], "--peer-timeout", "1")
    pids = served.pids()
    try:
        os.kill(pids[2], signal.SIGSTOP)
        status, body = served.post({"ids": [next(iter(trained[1]))]})
        assert status == 503 and "party 2 did not answer within 1 s" in body["error"]
        assert served.end() == 1
    finally:
        if alive(pids[2]):
            os.kill(pids[2], signal.SIGCONT)
    assert "vfl serve: party 2 did not answer within 1 s" in "".join(served.lines)
    time.sleep(0.5)
    assert not [pid for pid in pids if alive(pid)]


def test_a_killed_party_ends_the_service_naming_it(trained):
    """Under one mpiexec a rank's death ends the job: the launcher names the party that died."""
    served = Service(trained[0])
    pids = served.pids()
    os.kill(pids[1], signal.SIGKILL)
    assert served.end() == 1
    assert says_died_first("".join(served.lines), "party 1")
    time.sleep(0.5)
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize("scenario", ["partial", "partial-sealed"])
def test_an_id_some_party_lacks_is_answered_unknown_and_the_others_exactly(scenario):
    """Over real MPI and the secure sum, in clear and sealed: party 2 lacks id 30, party 1 alone holds 50."""
    proc = run_mpi(3, ["tests/mpi_scripts/serve_federation.py", scenario], timeout=60)
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["sealed"] == (scenario == "partial-sealed")
    assert answer["held"] == [True, False, False, True, False]
    for z, plain, held in zip(answer["z"], answer["plain"], answer["held"], strict=True):
        assert (z is None) == (not held)
        if held:
            assert z == pytest.approx(plain, abs=1e-8)


def test_a_passive_party_refuses_a_malformed_request_naming_the_leader():
    proc = run_mpi(3, ["tests/mpi_scripts/serve_federation.py", "hostile"], timeout=60)
    for rank in (1, 2):
        assert f"[party {rank}] party 0 sent an invalid serving request: announces 5 ids" in proc.stdout


def test_sigint_stops_the_service_cleanly_too(trained):
    served = Service(trained[0])
    pids = served.pids()
    assert served.post({"ids": [next(iter(trained[1]))]})[0] == 200
    served.proc.send_signal(signal.SIGINT)
    assert served.end() == 0
    time.sleep(0.5)
    assert not [pid for pid in pids if alive(pid)]
