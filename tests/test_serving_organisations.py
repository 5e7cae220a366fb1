"""``vfl party … --serve``: each organisation serves the run it trained, as its own process, and the
endpoint recovers when a party that left comes back (issue 29).

The organisations' folders hold a trained run as ``vfl party`` leaves it (``party.json``, the block,
the leader's ``checkpoint.json``, a passive party's ``result.json``), written here with the project's
own writers and known blocks, so that no training costs test time and the expected scores are
Σ_l w_l·x_l computed here. Each organisation is started as a user starts it, and requests go through
a real HTTP client (urllib).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from parties.config import ConfigError
from tests.conftest import REPO_ROOT
from tests.test_federation import breast_cancer_orgs, free_port, make_orgs, write_jobs

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def trained_folder(org, seed: int) -> dict[int, float]:
    """``org``'s folder as a finished ``vfl party`` run leaves it, with a block drawn from ``seed``;
    returns this party's w_l·x_l of each of its ids."""
    from parties.checkpoint import mark_complete, save_checkpoint
    from parties.federation.command import write_record
    from parties.federation.jobfile import load_job
    from parties.loading import own_party_file, read_own_party

    data = read_own_party(own_party_file(org.data, org.rank), org.rank == 0, "logistic")
    w = np.random.default_rng(seed).normal(size=data.X_train.shape[1])
    org.run.mkdir()
    write_record(org.run, load_job(org.job), org.rank, os.urandom(16))
    save_checkpoint(org.run, org.rank, w, 2.0, 0.1, 10)
    if org.rank == 0:
        mark_complete(org.run, 2.0)
    else:
        (org.run / "result.json").write_text(json.dumps({"outcome": "budget", "epochs": 2, "updates": 10,
                                                         "train_time": 0.1}))
    ids = np.concatenate([data.train_ids, data.test_ids])
    z = np.concatenate([data.X_train @ w, data.X_test @ w])
    return dict(zip(ids.tolist(), np.asarray(z).ravel().tolist(), strict=True))


@pytest.fixture(scope="module")
def organisations(tmp_path_factory):
    """Three organisations' folders of one trained job, and the expected score of every id."""
    orgs, split = breast_cancer_orgs(tmp_path_factory.mktemp("served"), standardize="off")  # raw x
    partials = [trained_folder(org, seed) for seed, org in enumerate(orgs)]
    expected = {i: sum(p[i] for p in partials) for i in partials[0]}
    return orgs, expected, split


class Endpoint:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def call(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def wait_for(self, status: int, seconds: float) -> dict:
        deadline = time.monotonic() + seconds
        while True:
            try:
                got, body = self.call("/health")
            except (urllib.error.URLError, ConnectionError):
                got, body = None, {}
            if got == status or time.monotonic() > deadline:
                assert got == status, f"/health answered {got} {body}, not {status}, within {seconds} s"
                return body
            time.sleep(0.1)


def start(org, *more: str) -> subprocess.Popen:
    return subprocess.Popen(org.command("--serve", "--join-timeout", "30", *more), cwd=REPO_ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.mpi
def test_organisations_serve_and_a_party_that_returns_is_served_again(organisations):
    orgs, expected, _ = organisations
    endpoint = Endpoint(free_port())
    procs = [start(orgs[0], "--http", endpoint.url.removeprefix("http://")), *map(start, orgs[1:])]
    try:
        health = endpoint.wait_for(200, 30)
        assert health["parties"] == 3 and health["task"] == "binary"
        ids = [int(i) for i in list(expected)[:5]] + [999_999]
        status, body = endpoint.call("/score", {"ids": ids, "output": "score"})
        assert status == 200
        served = [r.get("score") for r in body["results"]]
        assert np.allclose(served[:5], [expected[i] for i in ids[:5]], atol=1e-6, rtol=0)
        assert "error" in body["results"][5]

        procs[2].kill()  # clinic-c's `vfl party --serve` dies, and its federation process with it
        procs[2].communicate()
        down = endpoint.wait_for(503, 10)
        assert "clinic-c" in down["error"], down
        status, body = endpoint.call("/score", {"ids": ids})
        assert status == 503 and "clinic-c" in body["error"], body

        procs[2] = start(orgs[2])  # it comes back: a new federation, and the same scores
        endpoint.wait_for(200, 30)
        status, body = endpoint.call("/score", {"ids": ids, "output": "score"})
        again = [r.get("score") for r in body["results"]]
        assert status == 200 and again == pytest.approx([*served[:5], None])
    finally:
        procs[0].send_signal(signal.SIGTERM)
        outputs = [ended(p) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outputs)
    assert "the leader stopped the service" in outputs[1]
    assert "federation attempt 2" in outputs[1]  # bank-b joined again, saying so


def ended(proc: subprocess.Popen) -> str:
    """Its output once it has ended; killed (and its processes with it) if it has not within 30 s, so
    that no passive party is left joining again after a failed test."""
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0] + "\n(killed: it did not end within 30 s)"


def serving_args(org, *more: str) -> Namespace:
    from parties.federation.command import add_arguments

    return add_arguments(__import__("argparse").ArgumentParser()).parse_args(
        [str(org.job), "--as", org.name, "--key", str(org.key), "--data", str(org.data), "--folder",
         str(org.run), *more])


@pytest.mark.parametrize("rank, more, says", [
    (1, ("--serve", "--resume"), "--resume is for training"),
    (2, ("--serve", "--overwrite"), "--overwrite is for training"),
    (0, ("--serve", "--http", "127.0.0.1:8080", "--audit"), "--audit is for training"),
    (1, ("--serve", "--listen", "0.0.0.0:7700"), "--listen is for the leader (bank-a) only"),
    (0, ("--serve", "--http", "127.0.0.1:0"), "--http: address must be"),
    (1, ("--serve", "--http", "127.0.0.1:8080"), "--http is for the leader (bank-a) only"),
    (0, ("--serve",), "needs --http HOST:PORT"),
    (0, ("--serve", "--http", "127.0.0.1:8080", "--max-batch", "0"), "--max-batch must be in"),
    (2, ("--window-ms", "2"), "--window-ms is for --serve"),
])
def test_a_serving_option_that_does_not_fit_is_refused_in_one_line(organisations, rank, more, says):
    from parties.federation.command import checked
    from parties.serving.organisation import checked_serving

    org = organisations[0][rank]
    args = serving_args(org, *more)
    with pytest.raises(ConfigError) as refused:
        checked_serving(args) if args.serve else checked(args)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_folder_without_a_finished_run_is_refused_in_one_line(organisations, tmp_path):
    from parties.serving.organisation import checked_serving

    org = organisations[0][1]
    args = serving_args(org, "--serve")
    args.folder = str(tmp_path)
    with pytest.raises(ConfigError, match="holds no run of bank-b"):
        checked_serving(args)
    bare = Path(tmp_path) / "unfinished"
    bare.mkdir()
    for name in ("party.json", "party-1.ckpt.npz"):
        (bare / name).write_bytes((org.run / name).read_bytes())
    args.folder = str(bare)
    with pytest.raises(ConfigError, match=r"no result\.json"):
        checked_serving(args)


def test_the_local_link_refuses_a_frame_that_is_not_one():
    from parties.serving import link

    with pytest.raises(link.LinkError, match="unknown frame kind 9"):
        link.check_header(link.frame(9)[:8], 64)
    with pytest.raises(link.LinkError, match="with 72 bytes"):
        link.check_header(link.frame(link.SCORE, bytes(72))[:8], 64)
    with pytest.raises(link.LinkError, match="with 8 bytes"):
        link.check_header(link.frame(link.STOP, bytes(8))[:8], 64)
    with pytest.raises(link.LinkError, match="3 values answer a request of 2 ids"):
        link.scores_of(np.zeros(3).tobytes(), 2)
    with pytest.raises(link.LinkError, match="a request of 0 ids"):
        link.ids_of(b"", 4)
    z, held = link.scores_of(link.scores_frame(np.array([1.5, 7.0]), np.array([True, False]))[8:], 2)
    assert z[0] == 1.5 and np.isnan(z[1]) and held.tolist() == [True, False]


def supervisor_after(*frames: bytes):
    """A front's :class:`Supervisor` after reading ``frames`` from a federation's process that then
    ended; returns it and whether that federation served."""
    import asyncio

    from parties.serving.supervisor import Supervisor

    serving = Namespace(job=Namespace(parties=[Namespace(name=n) for n in ("bank-a", "bank-b", "clinic-c")]),
                        max_batch=4, peer_timeout=1.0)

    async def read():
        front = Supervisor(Namespace(name="bank-a"), serving, "unused")
        reader = asyncio.StreamReader()
        for data in frames:
            reader.feed_data(data)
        reader.feed_eof()
        served = await front._read_link(reader)
        front._lost("the leader's federation process ended (exit code 75)")
        return front, served

    return asyncio.run(read())


def test_the_front_answers_503_naming_the_party_until_a_new_federation_is_ready():
    from parties.serving import link

    front, served = supervisor_after(link.ready_frame(1))
    assert served and "exit code 75" in front.down  # a process that ended without a word
    front, served = supervisor_after(link.ready_frame(1), link.line_frame(link.DOWN, "clinic-c left"))
    assert served and front.down.startswith("clinic-c left; serving again once") and front.excluded is None
    front, served = supervisor_after(link.line_frame(link.DOWN, "the join ended: clinic-c did not join"))
    assert not served and "clinic-c did not join" in front.down


def test_a_party_that_broke_the_protocol_stays_excluded():
    from parties.serving import link

    line = "clinic-c (party 2) broke the protocol (...): it is excluded until the leader's command restarts"
    front, _ = supervisor_after(link.ready_frame(1), link.line_frame(link.EXCLUDED, line))
    assert front.excluded == line and front.down == line


def test_serving_reads_the_runs_scaling_and_label_draw_back_and_writes_nothing(organisations, tmp_path):
    """Under ``standardize`` and ``label-privacy = "dp"`` the leader's folder holds the statistics and
    the one randomized-response draw of training: serving scales with them and draws nothing again."""
    from parties.federation.member import party_plan
    from parties.loading import load_party
    from parties.serving.organisation import checked_serving, serving_plan
    from parties.serving.store import load_model

    orgs = make_orgs(tmp_path, organisations[2])
    write_jobs(orgs, f"127.0.0.1:{free_port()}",
               **{o.name: {"standardize": "center", "label-privacy": "dp", "epsilon": 1.0} for o in orgs})
    leader = orgs[0]
    trained_folder(leader, 0)
    training = serving_args(leader)
    load_party(party_plan(load_job_of(leader), 0, training), 0)  # training's draw and statistics
    before = {p.name: p.read_bytes() for p in leader.run.iterdir()}
    assert {"standardize-0.npz", "label-dp-0.npz"} <= set(before)
    args = serving_args(leader, "--serve", "--http", "127.0.0.1:8080")
    serving = checked_serving(args)
    model = load_model(serving_plan(serving, args), 0, serving.epochs)
    assert {p.name: p.read_bytes() for p in leader.run.iterdir()} == before
    train_rows = model.rows[model.lookup(np.asarray(load_party(serving_plan(serving, args), 0).train_ids))]
    assert np.allclose(np.asarray(train_rows.mean(axis=0)).ravel(), 0, atol=1e-9)  # centred as in training


def load_job_of(org):
    from parties.federation.jobfile import load_job

    return load_job(org.job)


def trained_network_folder(org, classes: int):
    """``org``'s folder as a finished ``vfl party`` run of a network job leaves it: a seeded network of
    the job's ``bottom`` (and the leader's top of ``classes`` classes), saved with the project's
    checkpoint writer; returns that part and the party's rows (train then test) with their ids, for the
    expected answers. Built without an optimiser, as serving builds it (its import takes seconds)."""
    from types import SimpleNamespace

    import scipy.sparse as sp

    from parties.checkpoint import mark_complete, save_checkpoint
    from parties.federation.command import write_record
    from parties.federation.member import party_plan
    from parties.loading import load_party
    from parties.party_model import NetworkPart
    from vertical.nn.networks import MLPBottom, MLPTop

    org.run.mkdir()
    party = load_party(party_plan(load_job_of(org), org.rank, serving_args(org)), org.rank, network=False)
    write_record(org.run, load_job_of(org), org.rank, os.urandom(16))
    bottom = MLPBottom(np.zeros((1, party.block.n_cols)), "*-6-3", optimizer=None, seed=org.rank)
    top = MLPTop("*-*", classes, k=3, optimizer=None, seed=3) if org.rank == 0 else None
    part = NetworkPart(SimpleNamespace(network=bottom, top=top, classes=None))
    save_checkpoint(org.run, org.rank, np.zeros(party.block.n_cols), 2.0, 0.1, 10, network=part.state())
    if org.rank == 0:
        mark_complete(org.run, 2.0)
    else:
        (org.run / "result.json").write_text(json.dumps({"outcome": "budget", "epochs": 2, "updates": 10,
                                                         "train_time": 0.1}))
    rows = sp.vstack([party.block.to_csr(), party.test_block.to_csr()], format="csr")
    return part, rows, np.concatenate([party.train_ids, party.test_ids]).astype(np.int64)


def rows_of(own_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The row of each of ``ids`` among a party's ``own_ids`` (all held)."""
    order = np.argsort(own_ids)
    return order[np.searchsorted(own_ids, ids, sorter=order)]


def three_class_split(split: Path, to: Path) -> Path:
    """``split`` with the leader's labels made three classes (0, 1, 2 by id), as a multiclass split."""
    import shutil

    shutil.copytree(split, to)
    for path in (to / "manifest.json", to / "party-0" / "party.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "task": "multiclass"}))
    for part in ("train", "test"):
        ids = np.load(to / "party-0" / part / "ids.npy")
        np.save(to / "party-0" / part / "y.npy", (ids % 3).astype(np.float64))
    return to


@pytest.fixture(scope="module", params=[2, 3], ids=["two-classes", "three-classes"])
def network_organisations(request, organisations, tmp_path_factory):
    """Three organisations' folders of one trained network job (``model = "mlp"``), the leader's ids,
    and what ``vfl predict`` answers for them (:func:`parties.predict.network_outputs` of the top on
    Σ_l h_l(x_l), from the networks as they were saved): a logit, or three classes' probabilities."""
    from parties.predict import network_outputs

    base = tmp_path_factory.mktemp("served-mlp")
    split = organisations[2] if request.param == 2 else three_class_split(organisations[2], base / "split")
    orgs = make_orgs(base, split)
    write_jobs(orgs, f"127.0.0.1:{free_port()}",
               **{o.name: {"standardize": "off", "model": "mlp", "bottom": "*-6-3"} for o in orgs})
    parts = [trained_network_folder(org, request.param) for org in orgs]
    ids = parts[0][2]
    z = sum(part.embed(rows[rows_of(own_ids, ids)]) for part, rows, own_ids in parts)
    return orgs, ids, network_outputs(parts[0][0].top.predict_proba(z))


def test_each_organisation_serves_its_own_network_and_the_sum_answers_as_vfl_predict(network_organisations):
    """Each organisation's federation process loads its own network from its own folder (the job
    file's model and bottom); the secure sum of their contributions answers as ``vfl predict``."""
    from parties.serving.federation import batch_scores, contribution
    from parties.serving.organisation import checked_serving, serving_plan
    from parties.serving.store import load_model

    orgs, ids, expected = network_organisations
    models = []
    for org in orgs:
        args = serving_args(org, "--serve", *(("--http", "127.0.0.1:8080") if org.rank == 0 else ()))
        serving = checked_serving(args)  # a network job is served, no longer refused
        models.append(load_model(serving_plan(serving, args), org.rank, serving.epochs))
    three = expected.ndim == 2  # a network of three classes answers their probabilities
    assert [m.k for m in models] == [3, 3, 3]
    assert (models[0].classes, models[0].task) == ((3, "multiclass") if three else (1, "binary"))
    assert models[1].network.top is None  # a passive party has its bottom network only
    asked = np.concatenate([ids[:40], [999_999]])
    total = sum(contribution(m, asked) for m in models)  # (k+1)·n values: what the aggregator is sized for
    assert total.size == models[0].round_values(asked.size) == (3 + 1) * asked.size
    scores = batch_scores(models[0], total, asked.size, len(models))
    served = scores.probabilities if three else scores.z
    assert np.allclose(served[:40], expected[:40], atol=1e-6, rtol=0) and np.isnan(served[40]).all()
    assert scores.held.tolist() == [True] * 40 + [False]


def test_a_network_job_whose_round_would_sum_too_many_values_is_refused_in_one_line(organisations, tmp_path):
    from parties.serving.organisation import checked_serving

    orgs = make_orgs(tmp_path, organisations[2])
    write_jobs(orgs, f"127.0.0.1:{free_port()}", **{o.name: {"model": "mlp", "bottom": "*-40"} for o in orgs})
    with pytest.raises(ConfigError, match=r"k \+ 1 = 41 values a row.*--max-batch at most 51150"):
        checked_serving(serving_args(orgs[0], "--serve", "--http", "127.0.0.1:8080", "--max-batch", "65536"))


def test_a_vfl_party_folder_of_a_network_run_exports_parts_that_score_as_vfl_predict(network_organisations,
                                                                                     tmp_path):
    import scipy.sparse as sp

    from parties.export import combined_scores, read_parts
    from parties.loading import own_party_file, read_own_party
    from vfl.cli import main

    orgs, ids, expected = network_organisations
    for org in orgs:
        assert main(["export", str(org.run), "--party", str(org.rank), "--data", str(org.data),
                     "--out", str(tmp_path)]) == 0
    parts = read_parts(tmp_path)
    data = [read_own_party(own_party_file(o.data, o.rank), o.rank == 0, "logistic") for o in orgs]
    blocks = [sp.vstack([sp.csr_matrix(d.X_train), sp.csr_matrix(d.X_test)], format="csr")
              [rows_of(np.concatenate([d.train_ids, d.test_ids]), ids)] for d in data]
    assert [p.k for p in parts] == [3, 3, 3]
    assert np.allclose(combined_scores(parts, blocks), expected, atol=1e-6, rtol=0)


def test_the_link_carries_a_multiclass_answer_checked_against_the_models_classes():
    from parties.serving import link

    proba = np.array([[0.2, 0.5, 0.3], [0.0, 0.0, 0.0]])
    held = np.array([True, False])
    got, flags = link.classes_of(link.classes_frame(proba, held)[8:], 2, 3)
    assert flags.tolist() == [True, False] and got[0].tolist() == [0.2, 0.5, 0.3] and np.isnan(got[1]).all()
    assert link.classes_of_ready(link.ready_frame(10)[8:]) == 10
    refused = [  # (a check, what its one line says)
        (lambda: link.classes_of_ready(link.ready_frame(2)[8:]), "a READY frame for 2 classes"),
        (lambda: link.check_header(link.frame(link.READY)[:8], 64), "kind 1 with 0 bytes"),
        (lambda: link.classes_of(np.zeros(8).tobytes(), 2, 4), "8 values answer a request of 2 ids"),
        (lambda: link.classes_of(np.array([1, 0, np.inf, 0, 0, 0, 0, 0.0]).tobytes(), 2, 3), "not finite"),
        (lambda: link.classes_of(np.array([0.5, 0, 0, 0, 0, 0, 0, 0.0]).tobytes(), 2, 3), "neither 0 nor 1"),
        (lambda: link.scores_of(np.array([np.nan, 1.0]).tobytes(), 1), "not finite"),
    ]
    for check, says in refused:
        with pytest.raises(link.LinkError, match=says):
            check()


def test_the_front_answers_as_the_federations_ready_says_and_stops_a_process_that_breaks_the_link():
    import asyncio

    from parties.serving import link
    from parties.serving.supervisor import FederationDown

    front, served = supervisor_after(link.ready_frame(3))
    assert served and front.classes == 3 and front.task("binary") == "multiclass"
    held = np.array([True])
    answer = front._scores(link.CLASSES, link.classes_frame(np.array([[0.1, 0.2, 0.7]]), held)[8:], 1)
    assert answer.probabilities.tolist() == [[0.1, 0.2, 0.7]]
    killed: list[bool] = []
    front.down, front.writer = None, Namespace(write=lambda data: None)
    front.process = Namespace(kill=lambda: killed.append(True))

    async def answered_with(data: bytes):
        kind = link.check_header(data[:8], 1 << 20)[0]
        asyncio.get_running_loop().call_soon(lambda: front._answer.set_result((kind, data[8:])))
        return await front.score(np.array([5]))

    for wrong in (link.scores_frame(np.array([1.0]), held),  # one score where 3 probabilities belong
                  link.classes_frame(np.array([[0.5, 0.5]]), held)):  # 2 classes where READY said 3
        with pytest.raises(FederationDown, match="federation process sent a malformed answer"):
            asyncio.run(answered_with(wrong))
    assert killed == [True, True]
    front, _ = supervisor_after(link.ready_frame(1))
    assert front.classes == 1 and front.task("binary") == "binary"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
