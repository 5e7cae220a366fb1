"""The runtime with lazy updates, mini-batches and pipelined requests: still VFB², still exactly once.

Lazy kernels are the default only from 10,000 columns a party, so these small jobs ask for them.
"""

from __future__ import annotations

import numpy as np
import pytest

from parties.runtime import TAG_THETA, TAG_THETA_REQUEST
from protocols.aggregation import Kind
from protocols.dispatch import split_piggyback
from protocols.transport import AGGREGATION_TAG
from tests.test_runtime import CANCER, metrics, refused, train

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("algorithm", "gap", "epochs"), [("svrg", 1e-5, 6), ("saga-scalar", 1e-4, 8)])
def test_lazy_updates_with_two_workers_reach_the_nonf_optimum(algorithm, gap, epochs, tmp_path):
    """Eager kernels reach 1e-9 (SVRG) and 2e-5 (SAGA-scalar) on this job in 8 epochs; lazy SVRG is at
    7e-8 after 6 (6e-6 after 4), lazy SAGA-scalar at 4e-5 after 8 (5e-4 after 6)."""
    train(tmp_path, "-n", "3", "-m", "2", "-k", "2", "--algorithm", algorithm, "--epochs", str(epochs),
          "--updates", "lazy", *CANCER)
    assert metrics(tmp_path)[-1]["suboptimality"] < gap


def test_mini_batches_in_flight_are_each_applied_exactly_once(tmp_path):
    batch = 8
    train(tmp_path, "-n", "3", "-m", "2", "--algorithm", "svrg", "--epochs", "8", "--batch-size", str(batch),
          "--inflight", "4", "--updates", "lazy", "--audit", *CANCER[:-2], "--gamma", "0.1")
    assert metrics(tmp_path)[-1]["suboptimality"] < 1e-5
    records = [dict(np.load(tmp_path / f"audit-{r}.npz")) for r in range(3)]
    for collaborator, rec in enumerate(records):
        bounds = np.concatenate([[0], np.cumsum(rec["lengths"])])
        for dominator in (0, 1):
            if dominator == collaborator:
                continue
            mine = np.flatnonzero((rec["sources"] == dominator) & (rec["tags"] == TAG_THETA))
            assert mine.size == int(records[dominator]["sent"]) == rec["applied"][dominator] > 100
            words = [rec["words"][bounds[k]:bounds[k + 1]].view(np.float64) for k in mine]
            assert [int(w[0]) for w in words] == list(range(mine.size))  # in order, none twice
            assert all(int(w[1]) == batch and w.size == 2 + 2 * batch for w in words)


def test_piggybacked_thetas_are_applied_exactly_once_with_one_message_fewer_per_step(tmp_path):
    """--piggyback: each collaborator gets one message per step from a dominator (its request, with the
    previous step's (ϑ, i) inside) instead of two, every ϑ still arrives once and in order, and the
    job still reaches the NonF optimum (8e-8 after 6 epochs). Three requests in flight: ϑ's are held
    behind the pipeline and the last ones of each segment go alone (P = 1 is the same with one)."""
    inflight = 3
    train(tmp_path, "-n", "3", "-m", "2", "--algorithm", "svrg", "--epochs", "6", "--piggyback",
          "--inflight", str(inflight), "--audit", *CANCER)
    assert metrics(tmp_path)[-1]["suboptimality"] < 1e-5
    records = [dict(np.load(tmp_path / f"audit-{r}.npz")) for r in range(3)]
    for collaborator, rec in enumerate(records):
        bounds = np.concatenate([[0], np.cumsum(rec["lengths"])])
        message = [rec["words"][bounds[k]:bounds[k + 1]] for k in range(rec["tags"].size)]
        for dominator in (0, 1):
            if dominator == collaborator:
                continue
            sent = int(records[dominator]["sent"])
            mine = np.flatnonzero(rec["sources"] == dominator)
            tags = rec["tags"][mine]
            plain = [message[k].view(np.float64) for k in mine[tags == TAG_THETA]]
            carried = [split_piggyback(dominator, message[k]) for k in mine[tags == TAG_THETA_REQUEST]]
            bare_requests = sum(int(message[k][0]) == Kind.REQUEST for k in mine[tags == AGGREGATION_TAG])
            thetas = []  # in arrival order, whichever way each came
            for k in mine:
                if rec["tags"][k] == TAG_THETA:
                    thetas.append(message[k].view(np.float64))
                elif rec["tags"][k] == TAG_THETA_REQUEST:
                    thetas.append(split_piggyback(dominator, message[k])[0])
            assert [int(t[0]) for t in thetas] == list(range(sent))  # each once, in order
            assert sent == len(plain) + len(carried) == rec["applied"][dominator] > 1000
            assert all(int(request[0]) == Kind.REQUEST for _, request in carried)
            # one message per step: alone only the first P requests and the last P ϑ of each segment
            assert len(plain) + len(carried) + bare_requests < 1.03 * sent
            assert len(plain) == bare_requests < 0.02 * sent


def test_piggybacking_is_refused_where_a_step_cannot_wait_for_the_next_request(tmp_path):
    for extra in (["--mode", "sync"], ["--label-privacy", "he", "-B", "64"]):
        proc = refused(tmp_path, "-n", "3", "-m", "1", "--piggyback", *extra, *CANCER)
        assert proc.returncode == 2, proc.stderr
        assert "--piggyback needs --mode async and no --label-privacy he" in proc.stderr


def test_the_piggyback_benchmark_times_both_variants_and_a_serial_run(tmp_path):
    from experiments.bench_piggyback import main

    summary = main(["--dataset", "breast-cancer", "--parties", "3", "--active", "2", "--epochs", "0.5",
                    "--repeats", "1", "--out", str(tmp_path)])
    assert set(summary["ms_per_update"]) == {"plain", "piggyback"}
    assert all(v[0] > 0 for v in summary["ms_per_update"].values()) and summary["serial_ms_per_update"] > 0
    assert summary["cpu"] and len(summary["load_before"]) == 3
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "table.md", "per_update.png"}


def test_the_update_profile_sees_each_threads_cpu_by_its_name(tmp_path):
    """The ranks name their threads in the OS (p<rank>-main, -comm, -worker-k, -heartbeat), so the
    profile can split a job's CPU by role; a longer job costs more CPU in its communication threads."""
    from experiments.bench_update_profile import main

    summary = main(["--dataset", "breast-cancer", "--parties", "3", "--repeats", "1", "--short", "4",
                    "--long", "12", "--out", str(tmp_path)])
    short, long = summary["jobs"]
    assert {"main", "comm", "worker", "heartbeat"} <= set(long["cpu_by_role"])
    assert long["updates"] > short["updates"] > 0
    assert long["cpu_by_role"]["comm"] > short["cpu_by_role"]["comm"]
    assert summary["profiles"][0]["cpu_ms_per_update"]["comm"] > 0 and summary["serial_ms_per_update"] > 0
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "table.md", "profile.png"}


def test_the_batches_benchmark_reports_a_federation_cost_beside_its_serial_run(tmp_path):
    from experiments.vfb2_batches import main

    rows = main(["--quick", "--datasets", "breast-cancer", "--batches", "8", "--inflight", "1",
                 "--delays", "0", "--target", "0.1", "--epochs", "6", "--out", str(tmp_path)])
    (row,) = rows
    assert row["status"] == "reached" and row["halvings"] == 0
    assert row["federation_cost"] == pytest.approx(row["time_to_target"] / row["serial_time_to_target"])
    assert row["federation_cost"] > 1  # messages cost something: a federation is never free
    written = {p.name for p in tmp_path.iterdir()}
    assert {"results.csv", "results.json", "table.md", "time_to_target.png"} <= written
