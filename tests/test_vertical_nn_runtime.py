"""``vfl train --model mlp``: each party's network on the VFB² runtime (issue 28, phase 2).

The wire carries k values a row (the aggregation node and the inbox check exactly B·k), a lock-step
job is lock-step split learning exactly (the one-process simulator on the same batches, every
parameter of every party), a resumed job goes on as if never stopped, the asynchronous modes train,
and every option the network cannot keep is refused in one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from parties.config import ConfigError, RunConfig, validate
from parties.model_options import bottom_specs, cut_width
from protocols.aggregation import AggregationNode, Kind
from protocols.dispatch import DispatchError, Inbox, pack
from protocols.errors import ProtocolViolation
from protocols.trees import build_all_tree_pairs
from tests.test_runtime import metrics, train

NET = ["--model", "mlp", "--algorithm", "sgd", "-m", "1", "--dataset", "breast-cancer", "--standardize",
       "off", "-B", "16", "--bottom", "*-8-4", "--top", "*-*"]


def _net(**given) -> RunConfig:
    return RunConfig(**{"model": "mlp", "algorithm": "sgd", "active": 1, "parties": 3, **given})


# ------------------------------------------------------------------------------------ the wire


def test_the_aggregation_node_takes_b_indices_and_b_times_k_values_a_partial_sum():
    q, b, k, root = 3, 2, 4, 0
    pairs = build_all_tree_pairs(q, 0)
    child = pairs[root].t1.children[root][0]
    at_a_party = AggregationNode(child, q, pairs, batch=b, width=k)
    with pytest.raises(ProtocolViolation, match=f"party {root}.*8 values where every request of this job "
                                                f"has 2"):
        at_a_party.receive(root, np.array([int(Kind.REQUEST), root, 0, 0, *range(b * k)], dtype=np.uint64))
    at_a_party.receive(root, np.array([int(Kind.REQUEST), root, 0, 0, 1, 2], dtype=np.uint64))
    at_the_root = AggregationNode(root, q, pairs, batch=b, width=k)
    with pytest.raises(ProtocolViolation, match=f"party {child}.*2 values where every partial sum of "
                                                f"this job has 8"):
        at_the_root.receive(child, np.array([int(Kind.MASKED), root, 0, 0, 0, 0], dtype=np.uint64))
    at_the_root.receive(child, np.array([int(Kind.MASKED), root, 0, 0, *[0] * (b * k)], dtype=np.uint64))


def test_the_inbox_takes_exactly_k_values_of_theta_a_row_and_refuses_a_non_finite_one():
    inbox = Inbox(2, n_rows=10, width=3)
    rows, thetas = inbox.unpack(1, pack(0, np.array([4, 5]), np.arange(6.0)))
    assert rows.tolist() == [4, 5] and thetas.tolist() == list(np.arange(6.0))
    with pytest.raises(DispatchError, match=r"party 1.*is truncated"):
        inbox.unpack(1, pack(1, np.array([4, 5]), np.arange(2.0)))  # a scalar ϑ a row: k = 1's message
    with pytest.raises(DispatchError, match="not finite"):
        inbox.unpack(1, pack(1, np.array([4]), np.array([0.0, np.nan, 1.0])))


# --------------------------------------------------------------------------------- the options


def test_bottom_specs_are_one_for_all_or_one_per_party_ending_at_one_width():
    assert bottom_specs("*-8-4", 3) == ["*-8-4"] * 3
    assert bottom_specs("*-8-4, *-4, 10-16-4", 3) == ["*-8-4", "*-4", "10-16-4"]
    assert cut_width("*-8-4, *-4, 10-16-4", 3) == 4
    with pytest.raises(ValueError, match="2 specs for 3 parties"):
        bottom_specs("*-4,*-4", 3)
    with pytest.raises(ValueError, match="same width k"):
        cut_width("*-4,*-4,*-5", 3)


@pytest.mark.parametrize(("given", "why"), [
    ({"algorithm": "svrg"}, "--algorithm sgd"),
    ({"active": 2}, "-m 1"),
    ({"problem": "least-squares"}, "a classifier with the logistic loss"),
    ({"label_privacy": "he", "batch_size": 512}, "--label-privacy he"),
    ({"f_star": 0.1}, r"no f\*"),
    ({"bottom": "*-8-4,*-8-4"}, "2 specs for 3 parties"),
    ({"bottom": "*-8-*"}, r"'\*' only stands first"),
    ({"top": "5-*"}, "first width must be 16"),
    ({"bottom": "*-5000", "batch_size": 4000}, "at most k = 4096"),
    ({"label_privacy": "dp-theta"}, "needs --epsilon"),
    ({"label_privacy": "dp-theta", "epsilon": 1.0, "resume": True}, "cannot --resume"),
    ({"model": "linear", "label_privacy": "dp-theta", "epsilon": 1.0}, "protects a network's vector"),
])
def test_what_a_network_cannot_keep_is_refused_in_one_line(given, why):
    with pytest.raises(ConfigError, match=why) as err:
        validate(_net(**given))
    assert "\n" not in str(err.value)


def test_what_a_network_keeps_is_accepted():
    for given in ({}, {"mode": "sync"}, {"mode": "sync-global"}, {"piggyback": True, "inflight": 4},
                  {"secure_channels": True}, {"label_privacy": "dp", "epsilon": 2.0},
                  {"bottom": "*-16-8,*-8,*-32-8", "top": "8-4-1"}, {"straggler": 2, "slowdown": 2.0},
                  {"label_privacy": "dp-theta", "epsilon": 1.0, "mode": "sync-global"}):
        validate(_net(**given))


# ------------------------------------------------------------------------------- real MPI jobs


def _replayed_lock_step(out: Path, epochs: int) -> dict[str, dict[str, np.ndarray]]:
    """What the job's parties hold after ``epochs`` of lock-step split learning in one process: each
    rank's data and fresh network as the rank builds them (``parties.loading.load_party``), driven by
    the simulator on the batches the job's dominator drew (its sampler, one call a segment), each epoch
    at the job's decayed step γ/(1 + decay·e) (``--gamma-decay``)."""
    from parties.loading import load_party
    from parties.plan import JobPlan, segment_quota
    from vertical.nn.simulate import simulate

    plan = JobPlan.from_json((out / "config.json").read_text())
    parties = [load_party(plan, rank) for rank in range(plan.parties)]
    n = parties[0].block.n_rows
    sampler = np.random.default_rng([plan.seed, 0])
    quota = segment_quota(plan.options, 1.0, n)
    schedule = [list(sampler.integers(0, n, size=(quota, plan.batch_size))) for _ in range(epochs)]
    for epoch in range(epochs):
        for optimizer in [p.network.optimizer for p in parties] + [parties[0].top.optimizer]:
            for group in optimizer.param_groups:
                group["lr"] = plan.gamma_at(epoch)
        simulate([p.network for p in parties], parties[0].top, parties[0].classes, epochs=1,
                 batch_size=plan.batch_size, mode="sync", batches=lambda _, rng, e=epoch: schedule[e])
    held = {f"party-{p.rank}": p.network.state_dict() for p in parties}
    held["top"] = parties[0].top.state_dict()
    return held


def _trained(out: Path, rank: int) -> dict[str, np.ndarray]:
    with np.load(out / f"party-{rank}.ckpt.npz") as z:
        return {name[len("net/"):]: z[name] for name in z.files if name.startswith("net/")}


def _assert_same(held: dict[str, np.ndarray], expected: dict[str, np.ndarray], what: str, rtol: float,
                 atol: float) -> None:
    assert set(held) == set(expected), what
    for name, value in expected.items():
        np.testing.assert_allclose(held[name], value, rtol=rtol, atol=atol, err_msg=f"{what} {name}")


def _part(held: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {name[len(prefix):]: value for name, value in held.items() if name.startswith(prefix)}


@pytest.mark.mpi
def test_a_lock_step_network_job_is_split_learning_and_resumes_where_it_left_off(tmp_path):
    """Every parameter (and Adam's state) of every party's network and of the top, after 2 epochs of a
    real 3-party ``sync`` job, equals the one-process lock-step simulation on the batches the job drew:
    the secure sum of k-wide contributions, the k-wide (ϑ, i) dispatch and each party's step are split
    learning exactly (to float32 rounding; the masked sum is exact to 2^-32), and every optimiser takes
    the second epoch at the decayed step (``--gamma-decay 1``: half). A ``sync-global`` job of 1 epoch
    resumed for a second (networks, Adam's moments, the sampler in the checkpoints, the step decayed
    from the epoch) ends at the same parameters."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    decay = ("--gamma", "0.004", "--gamma-decay", "1")
    train(whole, *NET, *decay, "-B", "32", "-n", "3", "--mode", "sync", "--epochs", "2", "--seed", "3")
    assert [r.get("gamma") for r in metrics(whole)] == [0.004, 0.004, 0.002]
    expected = _replayed_lock_step(whole, epochs=2)
    for rank in range(3):
        _assert_same(_part(_trained(whole, rank), "bottom/"), expected[f"party-{rank}"], f"party {rank}",
                     rtol=1e-4, atol=1e-5)
    _assert_same(_part(_trained(whole, 0), "top/"), expected["top"], "top", rtol=1e-4, atol=1e-5)

    train(resumed, *NET, *decay, "-B", "32", "-n", "3", "--mode", "sync-global", "--epochs", "1",
          "--seed", "3")
    proc = train(resumed, "--resume", "--epochs", "2")
    assert "resuming from epoch 1" in proc.stdout
    for rank in range(3):
        a = _trained(whole, rank)
        assert any(name.startswith("bottom/optim/") for name in a)
        _assert_same(_trained(resumed, rank), a, f"resumed party {rank}", rtol=1e-6, atol=1e-7)
    assert metrics(resumed)[-1]["loss"] == pytest.approx(metrics(whole)[-1]["loss"], rel=1e-6)


@pytest.mark.mpi
def test_an_asynchronous_network_job_with_per_party_networks_learns(tmp_path):
    """q = 4, each organisation its own network (one spec per party), requests in flight and ϑ riding
    on them, sealed channels, evaluations every half epoch: the job learns breast-cancer (a
    majority-class guess scores 0.63) and says what it ran."""
    proc = train(tmp_path, *NET[:-4], "--bottom", "*-8-4,*-4,*-16-4,*-8-4", "--top", "*-8-*", "-n", "4",
                 "-P", "4", "--piggyback", "--epochs", "4", "--audit", "--straggler", "2",
                 "--apply-delay-ms", "3", "--secure-channels", "--eval-every", "0.5")
    records = metrics(tmp_path)
    assert [r["epoch"] for r in records] == [0.5 * e for e in range(9)]
    # ≥ 97 of 114 test rows (the majority class is 76): a proxy of this job sat at 103 of the old bound's
    # 103 rows in a fifth of 80 runs and fell below it in one
    assert records[-1]["test_accuracy"] >= 0.85
    assert records[-1]["loss"] < 0.6 * records[0]["loss"]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert "networks *-8-4,*-4,*-16-4,*-8-4 / top *-8-*" in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["outcome"] == "budget"
    assert (tmp_path / "party-2.channel.key").stat().st_mode & 0o077 == 0  # the launcher's keys: private
    _every_party_stepped_once_per_batch(tmp_path, parties=4)
    _predictions_score_as_evaluated(tmp_path, records[-1]["test_accuracy"])
    _served_and_exported_as_predicted(tmp_path)
    for projection in (False, True):  # unprotected: a passive party reads the labels off ϑ
        leak = _direction_attack(tmp_path, rank=3, projection=projection)
        assert leak["accuracy"] >= 0.95, (projection, leak)


def _every_party_stepped_once_per_batch(out: Path, parties: int) -> None:
    """Every bottom took as many optimizer steps as the top, one per dispatched batch, though the
    straggler (rank 2, its workers waiting before each apply) took its queued messages together: one
    gradient on their rows, one step per message. Stepping once per queue left its network behind."""
    top_steps = int(_trained(out, 0)["top/optim/0/step"])
    assert top_steps > 50
    for rank in range(parties):
        assert int(_trained(out, rank)["bottom/optim/0/step"]) == top_steps, f"party {rank}"


def _direction_attack(out: Path, rank: int, projection: bool = False) -> dict[str, float]:
    """Li et al.'s direction attack on passive party ``rank``'s own ``--audit`` transcript, oriented by
    20 labels the attacker knows, judged against the leader's labels; ``projection``: the same without
    the cosine's normalisation, which averages a row's noisy releases (``theta_projection``)."""
    from experiments.label_attacks import Transcript, judge, theta_direction, theta_projection
    from parties.loading import load_party
    from parties.plan import JobPlan

    y = load_party(JobPlan.from_json((out / "config.json").read_text()), 0).y
    known = (np.arange(20), y[:20])
    read = theta_projection if projection else theta_direction
    return judge(read(Transcript.load(out / f"audit-{rank}.npz"), y.size, known), y)


@pytest.mark.mpi
def test_the_protected_mode_defeats_the_direction_attack_that_reads_an_unprotected_run(tmp_path):
    """``--label-privacy dp-theta --epsilon 1``: each row's ϑ clipped and noised (σ from the accountant
    over the run's passes, printed), the top by DP-SGD; on a passive party's transcript the direction
    attack that reads ≥ 95 % of the labels of an unprotected run (the test above) is near chance, and so
    is its projection variant, which averages each row's passes."""
    protected = ["--bottom", "*-8-4", "--top", "*-8-*", "-n", "3", "--mode", "sync", "--label-privacy",
                 "dp-theta", "--epsilon", "1", "--audit"]
    proc = train(tmp_path / "a", *NET[:-4], *protected, "--epochs", "3")
    assert "label-DP ε = 1, δ = 1e-05: each row's ϑ is clipped to norm 1" in proc.stdout
    for projection in (False, True):
        attack = _direction_attack(tmp_path / "a", rank=2, projection=projection)
        assert attack["coverage"] > 0.9 and abs(attack["auc"] - 0.5) <= 0.15, (projection, attack)
    assert all(math.isfinite(r["loss"]) for r in metrics(tmp_path / "a"))
    # the noise is drawn from OS entropy: the same lock-step job again (everything else deterministic)
    # sends other ϑ's; noise from the job's seed, which config.json gives every party, could be subtracted
    train(tmp_path / "b", *NET[:-4], *protected, "--epochs", "1")
    from experiments.label_attacks import Transcript, theta_batches

    first = [theta_batches(Transcript.load(tmp_path / run / "audit-2.npz"))[0] for run in ("a", "b")]
    assert np.array_equal(first[0][0], first[1][0])  # the same rows: the batches are the job's
    assert not np.allclose(first[0][1], first[1][1])  # other noise


def _served_and_exported_as_predicted(out: Path) -> None:
    """``vfl serve`` of the trained network run, asked over HTTP by a real client, and every party's
    ``vfl export`` part, recombined, give ``vfl predict``'s outputs for the same rows (to the secure sum's
    fixed point and float32 rounding); an unknown id and an output a binary network lacks get their
    documented answers."""
    import signal

    from parties.export import combined_scores, export_party, read_parts
    from parties.serving.front import UNKNOWN_ID
    from tests.test_serving import Service

    table = np.genfromtxt(out / "predictions-test.csv", delimiter=",", names=True)
    ids = table["id"].astype(np.int64).tolist()
    served = Service(out)
    try:
        assert served.health()["task"] == "binary"
        status, body = served.post({"ids": [*ids, 10**12]})
        assert status == 200 and body["results"][-1] == {"id": 10**12, "error": UNKNOWN_ID}
        results = body["results"][:-1]
        assert [r["id"] for r in results] == ids
        np.testing.assert_allclose([r["probability"] for r in results], table["probability"], atol=1e-6)
        np.testing.assert_allclose([r["score"] for r in results], table["score"], atol=1e-5)
        assert [r["class"] for r in results] == table["predicted_label"].astype(int).tolist()
        status, body = served.post({"ids": ids[:1], "output": "probabilities"})
        assert status == 400 and "not available for a binary model" in body["error"]
        served.proc.send_signal(signal.SIGTERM)
        assert served.end() == 0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    parts = [export_party(out, rank, out / "export") for rank in range(4)]
    assert parts[0].top is not None and all(part.top is None for part in parts[1:])
    z = combined_scores(read_parts(out / "export"), _raw_test_blocks(out))
    np.testing.assert_allclose(z, table["score"], atol=1e-5)
    np.testing.assert_allclose(1 / (1 + np.exp(-z)), table["probability"], atol=1e-6)


def _raw_test_blocks(out: Path) -> list:
    """Every party's test rows as its own file holds them (raw: an exported part scales its own)."""
    from parties.loading import own_party_file, read_own_party
    from parties.resume import load_run

    plan = load_run(out)
    return [read_own_party(own_party_file(plan.party_files, rank), rank == 0, plan.problem).X_test
            for rank in range(plan.parties)]


def _predictions_score_as_evaluated(out: Path, accuracy: float) -> None:
    """``vfl predict`` on the run: each party's trained network, the secure sum and the top give the
    test accuracy the run's last evaluation logged."""
    import subprocess
    import sys

    from parties.loading import load_party
    from parties.plan import JobPlan
    from tests.conftest import REPO_ROOT

    proc = subprocess.run([sys.executable, "-m", "vfl.cli", "predict", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = np.genfromtxt(out / "predictions-test.csv", delimiter=",", names=True)
    leader = load_party(JobPlan.from_json((out / "config.json").read_text()), 0)
    assert table["id"].astype(np.int64).tolist() == leader.test_ids.tolist()
    assert np.mean(table["predicted_label"] == leader.y_test) == pytest.approx(accuracy, abs=1e-12)


@pytest.mark.mpi
def test_a_network_job_classifies_image_strips_of_ten_classes(tmp_path):
    """Multiclass through the runtime: digits (8 × 8 images, 10 classes) cut by `vfl split --strips`
    into 4 vertical strips of 2 pixel columns; the softmax top over the secure sum of 4 networks learns
    them (a majority guess scores about 0.1) and `vfl predict` writes the class it logged."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT
    from vfl.cli import main

    files = tmp_path / "files"
    assert main(["split", "digits", "-n", "4", "--strips", "--out", str(files)]) in (0, None)
    out = tmp_path / "run"
    train(out, "--model", "mlp", "--algorithm", "sgd", "-m", "1", "-n", "4", "--party-files", str(files),
          "-B", "32", "--epochs", "3", "--gamma", "0.006")
    accuracy = metrics(out)[-1]["test_accuracy"]
    assert accuracy >= 0.9
    proc = subprocess.run([sys.executable, "-m", "vfl.cli", "predict", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "predicted_label, probability" in proc.stdout, proc.stderr
    from parties.loading import load_party
    from parties.plan import JobPlan

    table = np.genfromtxt(out / "predictions-test.csv", delimiter=",", names=True)
    leader = load_party(JobPlan.from_json((out / "config.json").read_text()), 0)
    assert np.mean(table["predicted_label"] == leader.y_test) == pytest.approx(accuracy, abs=1e-12)
    assert np.all((table["probability"] > 0.1) & (table["probability"] <= 1))
    _classes_served_and_exported_as_predicted(out, table)


def _classes_served_and_exported_as_predicted(out: Path, table: np.ndarray) -> None:
    """Ten classes, served and exported: each party's serving model (``load_model``, as a serving rank
    loads it) contributes its embeddings of the asked ids, their sum (what the secure sum gives the
    leader; the transport is the binary run's) goes through the leader's top, and the answer has
    ``vfl predict``'s class with its probability, and every class's; the exported parts agree."""
    from parties.checkpoint import complete_epochs
    from parties.export import combined_scores, export_party, read_parts
    from parties.resume import load_run
    from parties.serving.federation import batch_scores, contribution
    from parties.serving.front import BadRequest, answer, parse_outputs
    from parties.serving.store import load_model

    plan = load_run(out)
    models = [load_model(plan, rank, complete_epochs(out)) for rank in range(plan.parties)]
    assert models[0].task == "multiclass" and parse_outputs(None, "multiclass") == ("class", "probabilities")
    with pytest.raises(BadRequest, match="'score' is not available for a multiclass model"):
        parse_outputs("score", "multiclass")
    ids = np.append(table["id"].astype(np.int64), 10**12)
    total = np.sum([contribution(model, ids) for model in models], axis=0)
    results = answer(ids, batch_scores(models[0], total, ids.size, plan.parties), ("class", "probabilities"))
    predicted = table["predicted_label"].astype(int).tolist()
    assert "error" in results[-1] and [r["class"] for r in results[:-1]] == predicted
    chosen = [r["probabilities"][r["class"]] for r in results[:-1]]
    np.testing.assert_allclose(chosen, table["probability"], atol=1e-6)
    assert all(len(r["probabilities"]) == 10 for r in results[:-1])
    for rank in range(plan.parties):
        export_party(out, rank, out / "export")
    proba = combined_scores(read_parts(out / "export"), _raw_test_blocks(out))
    assert proba.shape == (len(table), 10) and np.argmax(proba, axis=1).tolist() == predicted
    np.testing.assert_allclose(proba.max(axis=1), table["probability"], atol=1e-6)


def test_a_checkpoint_of_another_network_or_planted_arrays_is_refused_before_it_is_read(tmp_path):
    """A party file is untrusted input: the network's arrays must be exactly the names this party's
    network may hold, each of its shape (checked from the headers), finite; one line otherwise."""
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from parties.checkpoint import load_checkpoint, save_checkpoint
    from parties.party_model import NetworkPart
    from vertical.nn.networks import MLPBottom

    torch.set_num_threads(1)
    X = np.random.default_rng(0).random((20, 5))
    part = NetworkPart(SimpleNamespace(network=MLPBottom(X, "*-4-2"), top=None, classes=None))
    part.step(np.arange(4), np.ones(8), writer=1)  # Adam's moments exist from the first step on
    save_checkpoint(tmp_path, 1, np.zeros(5), 1.0, 0.5, 10, network=part.state())
    restored = load_checkpoint(tmp_path, 1, 5, 1.0, part.state_shapes())
    assert restored.network is not None and set(restored.network) == set(part.state())
    other = NetworkPart(SimpleNamespace(network=MLPBottom(X, "*-8-2"), top=None, classes=None))
    with pytest.raises(ValueError, match=r"is damaged \(its network's bottom/.* has shape \(4, 5\), this "
                                         r"party's has \(8, 5\)\)") as err:
        load_checkpoint(tmp_path, 1, 5, 1.0, other.state_shapes())
    assert "\n" not in str(err.value)
    planted = {**part.state(), "bottom/param/evil": np.zeros(3)}
    save_checkpoint(tmp_path, 1, np.zeros(5), 1.0, 0.5, 10, network=planted)
    with pytest.raises(ValueError, match=r"unexpected \['bottom/param/evil'\]"):
        load_checkpoint(tmp_path, 1, 5, 1.0, part.state_shapes())
    poisoned = {**part.state(), "bottom/param/0.bias": np.full(4, np.nan, dtype=np.float32)}
    save_checkpoint(tmp_path, 1, np.zeros(5), 1.0, 0.5, 10, network=poisoned)
    with pytest.raises(ValueError, match=r"0\.bias is not finite"):
        load_checkpoint(tmp_path, 1, 5, 1.0, part.state_shapes())


def test_split_strips_refuses_what_is_not_a_square_image_dataset_in_one_line(tmp_path):
    """``vfl split --strips`` cuts square images only, and not with ``--contiguous`` or a file."""
    from vfl.cli import _image_strips, main

    assert [len(c) for c in _image_strips(64, 4)] == [16] * 4  # 8 × 8: 2 pixel columns × 8 rows each
    with pytest.raises(ValueError, match="not 4 strips of a square image"):
        _image_strips(30, 4)
    assert main(["split", "breast-cancer", "-n", "4", "--strips", "--out", str(tmp_path / "a")]) == 2
    assert main(["split", "digits", "-n", "4", "--strips", "--contiguous", "--out", str(tmp_path / "b")]) == 2
