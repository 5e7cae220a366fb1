"""Party models (``vertical/nn``): the linear block is the k = 1 case of the abstraction, a party's
network steps by the gradient autograd gives the assembled network, lock-step split learning is the
centralised network, the asynchronous simulation converges, and the estimator keeps scikit-learn's
contract. All in one process and fast (seconds); the MPI runtime carries none of this yet (phase 2)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sklearn.base import clone  # noqa: E402

from protocols.dispatch import pack as linear_pack  # noqa: E402
from tests.conftest import REPO_ROOT  # noqa: E402
from vertical.algorithms.serial import run_serial  # noqa: E402
from vertical.algorithms.vfb2 import Block, SGDRule  # noqa: E402
from vertical.datasets import load  # noqa: E402
from vertical.nn import messages  # noqa: E402
from vertical.nn.base import parse_spec  # noqa: E402
from vertical.nn.central import AssembledNetwork, train_central  # noqa: E402
from vertical.nn.linear import LinearPartyModel, LossTop  # noqa: E402
from vertical.nn.networks import MLPBottom, MLPTop, OptimizerSpec, build_split_network  # noqa: E402
from vertical.nn.protection import LabelProtection  # noqa: E402
from vertical.nn.simulate import predict_proba, simulate  # noqa: E402
from vertical.partition import image_strips, random_blocks  # noqa: E402
from vertical.problems import get_problem  # noqa: E402
from vfl import VerticalMLPClassifier  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These layers are far too small for intra-op threads; on a loaded 2-core box two threads that
    spin-wait for each other make a run many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_linear_block_through_the_party_model_gives_the_vfb2_rules_iterates_bit_for_bit(batch_size):
    """k = 1: LinearPartyModel over the existing Block/SGD rule and the loss as an identity top, driven
    by the simulator in lock-step, are today's serial VFB²-SGD (same draws): every bit of w."""
    ds = load("breast-cancer", seed=0)
    X, y = ds.X_train, ds.y_train
    problem = get_problem("logistic", lam=1e-3)
    blocks = random_blocks(X.shape[1], 3, seed=1)
    epochs, gamma, seed = 2, 0.05, 7
    expected = run_serial(problem, X, y, blocks, "sgd", gamma, epochs, seed=seed, batch_size=batch_size).w

    draws = np.random.default_rng(seed)
    steps = max(1, X.shape[0] // batch_size)

    def schedule(epoch, rng):
        taken = draws.integers(0, X.shape[0], size=steps * batch_size)
        return [taken[s:s + batch_size] for s in range(0, taken.size, batch_size)]

    parties = [LinearPartyModel(SGDRule(Block.from_matrix(X[:, cols]), problem.regularizer, problem.lam,
                                        gamma, batch_size=batch_size)) for cols in blocks]
    simulate(parties, LossTop(problem), y, epochs=epochs, batch_size=batch_size, mode="sync",
             batches=schedule)
    w = np.zeros(X.shape[1])
    for cols, party in zip(blocks, parties, strict=True):
        w[cols] = party.weights()
    assert np.array_equal(w, expected)
    assert problem.score(w, ds.X_test, ds.y_test) > 0.9


@pytest.mark.parametrize("n_classes", [2, 3])
def test_a_partys_backward_is_autograd_on_the_assembled_network(n_classes):
    """float64: the top's ϑ dispatched to each party and the party's own backward give exactly the
    gradient autograd computes on top(Σ_l bottom_l(x_l)), and both agree with finite differences."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 9))
    y = rng.integers(0, n_classes, size=40)
    columns = [np.array([0, 3, 6]), np.array([1, 4, 7, 8]), np.array([2, 5])]
    bottoms, top = build_split_network(X, columns, ["*-5-4", "*-4", "*-3-6-4"], "4-7-*", n_classes,
                                       dtype="float64", seed=3)
    rows = np.array([3, 17, 5, 22, 39, 0, 8])
    z = sum(b.forward(rows) for b in bottoms)
    theta, top_grads, loss = top.gradients(z, y[rows])
    assert theta.shape == (rows.size, 4)
    party_grads = [{k: v.clone() for k, v in b.gradients(rows, theta).items()} for b in bottoms]

    model = AssembledNetwork.from_parties(bottoms, columns, top)
    Xt, yt = torch.as_tensor(X[rows]), torch.as_tensor(y[rows])
    central = model.loss(model(Xt), yt)
    central.backward()
    assert float(central.detach()) == pytest.approx(loss, rel=1e-14)
    for grads, net in zip(party_grads, model.bottoms, strict=True):
        for name, p in net.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-14)
    for name, p in model.top.named_parameters():
        torch.testing.assert_close(top_grads[name], p.grad, rtol=1e-12, atol=1e-14)

    # finite differences on the assembled loss, for a few coordinates of each party's first layer
    weight = model.bottoms[1][0].weight
    for index in [(0, 0), (2, 3), (3, 1)]:
        with torch.no_grad():
            weight[index] += 1e-6
            up = float(model.loss(model(Xt), yt))
            weight[index] -= 2e-6
            down = float(model.loss(model(Xt), yt))
            weight[index] += 1e-6
        assert party_grads[1]["0.weight"][index].item() == pytest.approx((up - down) / 2e-6, abs=1e-8)


def test_lock_step_split_learning_is_the_centralised_network():
    """With no staleness, q optimisers over q bottoms and the top are one Adam over the assembled
    network on the same batches: the same parameters after two passes, to rounding (float64)."""
    ds = load("digits", seed=0)
    X, y = ds.X_train[:300].astype(np.float64), ds.y_train[:300]
    columns = random_blocks(64, 3, seed=0)
    spec = OptimizerSpec("adam", 1e-2)
    bottoms, top = build_split_network(X, columns, "*-8-6", "6-*", 10, optimizer=spec, dtype="float64")
    model = AssembledNetwork.from_parties(bottoms, columns, top)
    simulate(bottoms, top, y, epochs=2, batch_size=32, mode="sync", seed=5)
    train_central(model, X, y, epochs=2, batch_size=32, optimizer=spec, seed=5)
    for b, net in zip(bottoms, model.bottoms, strict=True):
        for (name, p), q in zip(b.net.named_parameters(), net.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=name)
    for p, q in zip(top.net.parameters(), model.top.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)


def test_asynchronous_vfb2_of_networks_converges_with_bounded_staleness():
    """Digits over 4 parties, collaborators up to 3 updates behind: the staleness is really there
    (each collaborator reached τ), and the network still learns (> 90 % test accuracy; a network that
    learned nothing scores 10 %)."""
    torch.manual_seed(0)
    ds = load("digits", seed=0)
    columns = random_blocks(64, 4, seed=0)
    bottoms, top = build_split_network(ds.X_train, columns, "*-32-8", "8-*", 10,
                                       optimizer=OptimizerSpec("adam", 3e-3))
    result = simulate(bottoms, top, ds.y_train, epochs=12, batch_size=32, max_staleness=3, seed=1)
    assert result.max_staleness == [0, 3, 3, 3]
    assert result.history[-1]["loss"] < result.history[0]["loss"] / 3
    proba = predict_proba(bottoms, top, [ds.X_test[:, c] for c in columns])
    assert np.mean(proba.argmax(axis=1) == ds.y_test) > 0.9


def test_state_dicts_resume_a_party_and_the_top_exactly():
    """state_dict → load into fresh models (other seeds) → the same next steps, Adam moments included."""
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(50, 6)), rng.integers(0, 2, size=50)
    original = (MLPBottom(X, "*-5-3", seed=0), MLPTop("3-4-*", 2, seed=1))
    rows = np.arange(10)
    for _ in range(3):
        theta, _ = original[1].step(original[0].forward(rows), y[rows])
        original[0].backward(rows, theta)
    copies = (MLPBottom(X, "*-5-3", seed=8), MLPTop("3-4-*", 2, seed=9))
    for source, target in zip(original, copies, strict=True):
        state = source.state_dict()
        assert all(isinstance(v, np.ndarray) for v in state.values()) and any("optim/" in k for k in state)
        target.load_state_dict(state)
    for bottom, head in (original, copies):
        theta, _ = head.step(bottom.forward(rows + 10), y[rows + 10])
        bottom.backward(rows + 10, theta)
    assert all(np.array_equal(a, copies[0].state_dict()[k]) for k, a in original[0].state_dict().items())
    assert all(np.array_equal(a, copies[1].state_dict()[k]) for k, a in original[1].state_dict().items())
    with pytest.raises(ValueError, match="shape"):
        MLPBottom(X, "*-4-3").load_state_dict(original[0].state_dict())


def test_the_k_wide_message_is_todays_message_at_k_1():
    rows, theta = np.array([4, 0, 7]), np.array([[0.5], [-1.0], [2.0]])
    assert np.array_equal(messages.pack(9, rows, theta), linear_pack(9, rows, theta[:, 0]))
    wide = np.arange(12.0).reshape(3, 4)
    seq, got_rows, got = messages.unpack(messages.pack(2, rows, wide))
    assert seq == 2 and np.array_equal(got_rows, rows) and np.array_equal(got, wide)
    with pytest.raises(ValueError, match="do not hold"):
        messages.unpack(messages.pack(2, rows, wide)[:-1])
    with pytest.raises(ValueError, match="k = 3"):
        messages.unpack(messages.pack(2, rows, wide), k=3)


def test_spec_strings_and_their_errors():
    assert parse_spec("196-64-16", first=196) == (196, 64, 16)
    assert parse_spec("*-64-16", first=30) == (30, 64, 16)
    assert parse_spec("16-*", first=16, last=10) == (16, 10)
    assert parse_spec("10", first=10, last=10) == (10,)
    for bad, message in [("196-64-16", "first width must be 30"), ("*-x-16", "not a positive width"),
                         ("*--16", "widths joined"), ("*-0-16", "not a positive width"), ("", "widths")]:
        with pytest.raises(ValueError, match=message):
            parse_spec(bad, first=30)
    with pytest.raises(ValueError, match="same width k"):
        build_split_network(np.zeros((4, 4)), [np.array([0, 1]), np.array([2, 3])], ["*-3", "*-2"], "3-*", 2)
    with pytest.raises(ValueError, match="last width must be 1"):
        MLPTop("3-2", 2)


def test_protection_clips_each_row_and_adds_the_calibrated_noise():
    protection = LabelProtection.calibrated(2.0, 1e-5, 3, clip=0.5, seed=0)
    assert protection.epsilon(1e-5, 3) <= 2.0
    assert protection.theta_std(False) == pytest.approx(2 * protection.noise_multiplier * 0.5)
    share = protection.top_share
    assert (2 * 0.5 / protection.theta_std(True)) ** 2 + (2 * 0.5 / protection.top_std) ** 2 == \
        pytest.approx(1 / protection.noise_multiplier ** 2)
    silent = LabelProtection(clip=0.5, noise_multiplier=0.0, rng=np.random.default_rng(0))
    theta = np.array([[3.0, 4.0], [0.1, 0.0]])
    np.testing.assert_allclose(silent.release(theta), [[0.3, 0.4], [0.1, 0.0]])
    assert 0 < share < 1
    released = protection.release(np.zeros((20000, 2)))
    assert released.std() == pytest.approx(protection.theta_std(False), rel=0.03)


def test_the_identity_top_releases_its_theta_unclipped_with_noise_of_its_exact_sensitivity():
    """An identity top: one label moves a row's ϑ by exactly 1 (one logit) or √2 (softmax), so the
    noise is σ·Δ (not the clip's 2σC, twice as much at C = 1) and no clip bends ϑ; a clip smaller than
    Δ/2 keeps the clipped release (the tighter bound), and a top with parameters keeps the clip."""
    from vertical.nn.networks import MLPTop

    protection = LabelProtection.calibrated(2.0, 1e-5, 3, clip=1.0, seed=0)
    sigma = protection.noise_multiplier
    silent = LabelProtection(clip=0.1, noise_multiplier=0.0, rng=np.random.default_rng(0))
    for classes, delta in ((2, 1.0), (5, np.sqrt(2.0))):
        top = MLPTop(str(1 if classes == 2 else classes), classes)
        z = np.random.default_rng(1).normal(0, 3, size=(40000, top.k))
        y = np.random.default_rng(2).integers(0, classes, size=40000)
        clean, _ = top.step(z, y)
        noisy, _ = top.step(z, y, protection)
        assert (noisy - clean).std() == pytest.approx(sigma * delta, rel=0.02)  # σΔ, not 2σ
        exact = LabelProtection(clip=1.0, noise_multiplier=0.0, rng=np.random.default_rng(0))
        np.testing.assert_allclose(top.step(z, y, exact)[0], clean, atol=1e-6)  # unclipped (float32)
        bent, _ = top.step(z, y, silent)  # 2C = 0.2 < Δ: clipped to 0.1
        assert np.linalg.norm(bent, axis=1).max() == pytest.approx(0.1)
    parametrised = MLPTop("2-1", 2)
    noisy, _ = parametrised.step(np.zeros((20000, 2)), np.zeros(20000, dtype=int), protection)
    assert noisy.std() == pytest.approx(2 * sigma * 1.0 / np.sqrt(1 - protection.top_share), rel=0.03)


def test_image_strips_cut_pixel_columns():
    strips = image_strips(28, 28, 4)
    assert [s.size for s in strips] == [196] * 4
    assert np.array_equal(np.sort(np.concatenate(strips)), np.arange(784))
    assert set(strips[0] % 28) == set(range(7)) and set(strips[3] % 28) == set(range(21, 28))


def test_the_estimator_keeps_scikit_learns_contract():
    ds = load("digits", seed=0)
    model = VerticalMLPClassifier(parties=4, bottom="*-32-8", top="8-*", lr=3e-3, batch_size=32, epochs=6,
                                  max_staleness=2)
    assert clone(model).get_params() == model.get_params()
    labels = np.array([f"digit-{d}" for d in range(10)])
    assert model.fit(ds.X_train, labels[ds.y_train]) is model
    proba = model.predict_proba(ds.X_test)
    assert proba.shape == (ds.X_test.shape[0], 10) and np.allclose(proba.sum(axis=1), 1.0)
    assert np.array_equal(model.predict(ds.X_test), model.classes_[proba.argmax(axis=1)])
    assert model.score(ds.X_test, labels[ds.y_test]) > 0.85
    assert model.epsilon_ is None and len(model.history_) == 6

    cancer = load("breast-cancer", seed=0)
    binary = VerticalMLPClassifier(parties=3, bottom="*-8-4", top="4-*", lr=3e-3, batch_size=16, epochs=4,
                                   label_privacy="dp", epsilon=8.0)
    binary.fit(cancer.X_train, cancer.y_train)
    assert binary.predict_proba(cancer.X_test).shape == (cancer.X_test.shape[0], 2)
    assert binary.epsilon_ <= 8.0 and binary.noise_multiplier_ > 0
    with pytest.raises(ValueError, match="needs epsilon"):
        VerticalMLPClassifier(label_privacy="dp").fit(cancer.X_train, cancer.y_train)
    with pytest.raises(ValueError, match="features"):
        binary.predict_proba(cancer.X_test[:, :5])


def test_the_linear_path_never_imports_torch():
    """torch is the networks' optional extra: the linear runtime, the party-model layer it shares, and
    the estimators' import run without it."""
    code = ("import sys, vfl, vfl.estimator, parties.training, vertical.nn.linear, vertical.nn.simulate, "
            "vertical.nn.protection, vertical.nn.messages; from vfl import VerticalMLPClassifier; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(REPO_ROOT), "PATH": ""})
    assert out.stdout.strip() == "False"


def test_the_benchmark_writes_its_tables_and_plot(tmp_path):
    """``python -m experiments vnn`` end to end on the bundled data sets, one pass: every method has a
    row with its times, the privacy rows state σ, and --merge redoes one method keeping the rest."""
    import json

    from experiments.vnn import main

    main(["--datasets", "digits", "breast-cancer", "--epochs", "1", "--epsilon", "4", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    methods = {(r["dataset"], r["method"]) for r in result["rows"]}
    assert methods == {(d, m) for d in ("digits", "breast-cancer")
                       for m in ("vfb2-async", "split-sync", "central", "linear")}
    assert all(r["cpu_seconds_per_epoch"] > 0 for r in result["rows"] if r["method"] != "linear"
               or r["dataset"] == "digits")
    assert [r["mode"] for r in result["privacy"]] == ["plain", "dp ε=4"]
    assert result["privacy"][1]["noise_multiplier"] > 0 and (tmp_path / "accuracy.png").exists()
    main(["--datasets", "digits", "--methods", "linear", "--epochs", "1", "--merge", "--out", str(tmp_path)])
    merged = json.loads((tmp_path / "results.json").read_text())
    assert len(merged["rows"]) == len(result["rows"]) and len(merged["commands"]) == 2
    assert "| breast-cancer | dp ε=4 |" in (tmp_path / "table.md").read_text()
