"""Batched flat-vector models: gradients against autograd, layout, evaluation and input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from horizontal import MLP, LeastSquares, least_squares_optimum, softmax_regression


def reference_mlp_loss(model: MLP, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The same network built from torch.nn.functional, reading the documented flat layout."""
    h, offset = X, 0
    pairs = list(zip(model.sizes[:-1], model.sizes[1:], strict=True))
    for layer, (fan_in, fan_out) in enumerate(pairs):
        weight = w[offset:offset + fan_in * fan_out].view(fan_in, fan_out)
        offset += fan_in * fan_out
        bias = w[offset:offset + fan_out]
        offset += fan_out
        h = h @ weight + bias
        if layer < len(pairs) - 1:
            h = torch.relu(h)
    return torch.nn.functional.cross_entropy(h, y)


@pytest.mark.parametrize("model", [MLP(12, (7, 5), 4), softmax_regression(12, 3)], ids=["mlp", "softmax"])
def test_batched_gradients_match_autograd_per_client(model: MLP) -> None:
    gen = torch.Generator().manual_seed(0)
    S, B = 3, 6
    W = torch.stack([model.init(gen, torch.float64) for _ in range(S)])
    X = torch.randn(S, B, 12, generator=gen, dtype=torch.float64)
    y = torch.randint(0, model.n_classes, (S, B), generator=gen)
    loss, G = model.loss_and_grad(W, X, y)
    for s in range(S):
        w = W[s].clone().requires_grad_()
        ref = reference_mlp_loss(model, w, X[s], y[s])
        ref.backward()
        assert abs(float(loss[s]) - ref.item()) < 1e-12
        torch.testing.assert_close(G[s], w.grad, rtol=1e-10, atol=1e-12)


def test_papers_network_has_235146_parameters_and_torch_default_init_scale() -> None:
    model = MLP(784, (256, 128), 10)
    assert model.dim == 235_146
    w = model.init(torch.Generator().manual_seed(0))
    first_weights = w[: 784 * 256]
    assert w.dtype == torch.float32
    assert float(first_weights.abs().max()) <= 1 / 784**0.5
    assert float(first_weights.std()) == pytest.approx(1 / 784**0.5 / 3**0.5, rel=0.02)


def test_evaluate_reports_loss_and_accuracy_of_one_model() -> None:
    model = softmax_regression(2, 2)
    # weights make class = (x0 > x1): logits = x @ [[1, 0], [0, 1]]
    w = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    X = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.5]], dtype=torch.float64)
    y = torch.tensor([0, 1, 1])
    result = model.evaluate(w, X, y)
    assert result["accuracy"] == pytest.approx(2 / 3)
    expected = float(torch.nn.functional.cross_entropy(X, y))
    assert result["loss"] == pytest.approx(expected)


def test_least_squares_gradient_and_known_optimum() -> None:
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(30, 4)), rng.normal(size=30)
    parts = [np.arange(0, 10), np.arange(10, 30)]          # unequal sizes: clients still weigh 1/N
    x_star = least_squares_optimum(X, y, parts)
    model = LeastSquares(4)
    W = torch.as_tensor(np.stack([x_star, x_star]))
    Xs = torch.as_tensor(np.stack([X[parts[0]], X[parts[1][:10]]]))
    _, G = model.loss_and_grad(W, Xs, torch.as_tensor(np.stack([y[parts[0]], y[parts[1][:10]]])))
    grads = [X[p].T @ (X[p] @ x_star - y[p]) / len(p) for p in parts]
    np.testing.assert_allclose(sum(grads), 0.0, atol=1e-12)          # ∇f(x*) = 0 with f = mean_i f_i
    np.testing.assert_allclose(G[0].numpy(), grads[0], rtol=1e-12)   # full batch of client 0


def test_bad_data_is_a_clear_error() -> None:
    model = MLP(4, (3,), 3)
    with pytest.raises(ValueError, match=r"\(n, 4\)"):
        model.check_data(torch.zeros(5, 3), torch.zeros(5, dtype=torch.int64), "training data")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        model.check_data(torch.zeros(2, 4), torch.tensor([0, 3]), "test data")
    with pytest.raises(ValueError, match="NaN"):
        model.check_data(torch.full((2, 4), float("nan")), torch.tensor([0, 1]), "test data")
    with pytest.raises(TypeError, match="floating point"):
        LeastSquares(4).check_data(torch.zeros(2, 4), torch.tensor([0, 1]), "training data")
    with pytest.raises(ValueError, match="n_classes"):
        MLP(4, (3,), 1)


def _mlp_to_torch_layout(w: torch.Tensor, model: MLP) -> torch.Tensor:
    """MLP stores each weight as [fan_in, fan_out]; torch.nn.Linear, so TorchModel, as [fan_out, fan_in]."""
    parts = []
    for w_off, b_off, fan_in, fan_out in model._layers:
        parts += [w[w_off:b_off].reshape(fan_in, fan_out).T.reshape(-1), w[b_off:b_off + fan_out]]
    return torch.cat(parts)


def test_a_vmapped_torch_module_is_the_same_model_protocol_as_the_hand_written_mlp() -> None:
    """TorchModel (autograd through vmap) and MLP (hand-written backward) agree on loss, gradient and
    evaluation, and a flat algorithm (SCAFFOLD) follows the same trajectory on either."""
    from horizontal import FederatedData, FederatedSimulation, FLConfig, Scaffold
    from horizontal.models import torch_mlp

    hand, auto = MLP(12, (7,), 3), torch_mlp(12, (7,), 3)
    assert hand.dim == auto.dim
    gen = torch.Generator().manual_seed(0)
    W = torch.stack([hand.init(gen, torch.float64) for _ in range(4)])
    X = torch.randn(4, 9, 12, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 9), generator=gen)
    loss_hand, grad_hand = hand.loss_and_grad(W, X, y)
    W_auto = torch.stack([_mlp_to_torch_layout(w, hand) for w in W])
    loss_auto, grad_auto = auto.loss_and_grad(W_auto, X, y)
    torch.testing.assert_close(loss_auto, loss_hand, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_auto, torch.stack([_mlp_to_torch_layout(g, hand) for g in grad_hand]),
                               rtol=1e-12, atol=1e-12)
    rows, labels = X.reshape(-1, 12), y.reshape(-1)
    for key, value in hand.evaluate(W[0], rows, labels).items():
        assert auto.evaluate(W_auto[0], rows, labels)[key] == pytest.approx(value, rel=1e-12)
    with pytest.raises(ValueError, match="labels must lie in"):
        auto.check_data(rows, labels + 3, "client 0")

    data = FederatedData.from_partition(rows.numpy(), labels.numpy(), np.array_split(np.arange(36), 4),
                                        dtype=torch.float64)
    runs = {}
    for name, model, x0 in (("hand", hand, W[0]), ("auto", auto, W_auto[0])):
        sim = FederatedSimulation(Scaffold(), model, data, FLConfig(4, 2, 3, 0.1), batch_size=5, seed=1,
                                  x0=x0)
        sim.run(3)
        runs[name] = sim.server.tensors()["x"]
    expected = _mlp_to_torch_layout(runs["hand"], hand)
    torch.testing.assert_close(runs["auto"], expected, rtol=1e-10, atol=1e-12)
