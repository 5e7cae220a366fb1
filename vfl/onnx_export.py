"""ONNX export of a fitted estimator, for scoring outside vfl (``onnxruntime``, or any ONNX runtime).

Only a simulation can do this: ``fit`` held every party's block or network in one process, so the
assembled model exists there. In a deployment each party exports its own part (``vfl export``,
:mod:`parties.export`) and no one holds the whole. The graphs take the full feature row ``X`` [n, d], in
the estimator's column order:

* linear (``VerticalLogisticRegression``, ``VerticalLinearRegression``): the parties' blocks, with
  ``--standardize``'s scaling folded in (``coef_`` = w/scale, ``intercept_`` = −Σ w·shift/scale), as one
  linear layer; outputs ``score`` [n] (w·x) and, for the classifier, ``probabilities`` [n, 2] (1 − σ, σ:
  scikit-learn's column order). float64, so the scores equal ``decision_function``'s.
* ``VerticalMLPClassifier``: each party's bottom network on its own columns (a ``Gather`` of
  ``columns_[p]``), the sum of the bottoms' outputs, the top network, then σ (two classes) or softmax;
  outputs ``logits`` and ``probabilities`` [n, n_classes]. In the estimator's ``dtype`` (float32 by
  default), so the scores equal ``predict_proba``'s to that precision.

``onnx`` is imported only here (``pip install 'vfl[export]'``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: the ONNX operator set the graphs use, and an IR version every current runtime reads
OPSET = 17
IR_VERSION = 8


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ImportError("to_onnx needs the onnx package: pip install 'vfl[export]' (onnx, onnxruntime)") \
            from None
    return onnx


class _Graph:
    """A growing list of nodes and initializers with fresh names (one graph's builder)."""

    def __init__(self, dtype: np.dtype) -> None:
        self.onnx = _onnx()
        self.dtype = np.dtype(dtype)
        self.nodes: list = []
        self.initializers: list = []
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def const(self, stem: str, value, dtype=None) -> str:
        name = self.name(stem)
        array = np.asarray(value, dtype=self.dtype if dtype is None else dtype)
        self.initializers.append(self.onnx.numpy_helper.from_array(array, name))
        return name

    def op(self, kind: str, inputs: list[str], stem: str | None = None, output: str | None = None,
           **attrs) -> str:
        out = output or self.name(stem or kind.lower())
        self.nodes.append(self.onnx.helper.make_node(kind, inputs, [out], **attrs))
        return out

    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray, stem: str) -> str:
        """x @ weightᵀ + bias, torch's ``nn.Linear`` layout (weight [out, in])."""
        product = self.op("MatMul", [x, self.const(f"{stem}_w", np.asarray(weight).T)])
        return self.op("Add", [product, self.const(f"{stem}_b", bias)])

    def save(self, path: str | Path, inputs: list, outputs: list, doc: str) -> Path:
        helper = self.onnx.helper
        graph = helper.make_graph(self.nodes, "vfl", inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="vfl", doc_string=doc)
        model.ir_version = IR_VERSION
        self.onnx.checker.check_model(model)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.onnx.save(model, str(path))
        return path

    def tensor(self, name: str, shape: list) -> object:
        elem = self.onnx.helper.np_dtype_to_tensor_dtype(self.dtype)
        return self.onnx.helper.make_tensor_value_info(name, elem, shape)


def _binary_probabilities(g: _Graph, logit: str) -> str:
    """[n] logits → [n, 2] (1 − σ, σ), scikit-learn's column order for a binary classifier."""
    positive = g.op("Unsqueeze", [g.op("Sigmoid", [logit]), g.const("axis", [1], np.int64)])
    negative = g.op("Sub", [g.const("one", 1.0), positive])
    return g.op("Concat", [negative, positive], output="probabilities", axis=1)


def linear_to_onnx(estimator, path: str | Path) -> Path:
    """The fitted linear estimator as one linear layer (float64); see the module docstring."""
    if any(c is None for c in estimator.columns_):
        raise ValueError("the parties' global columns are unknown (CSV party files): coef_ has no column "
                         "order to export")
    g = _Graph(np.float64)
    d = estimator.n_features_in_
    product = g.op("MatMul", ["X", g.const("coef", np.asarray(estimator.coef_).reshape(d, 1))])
    column = g.op("Add", [product, g.const("intercept", [estimator.intercept_])])
    score = g.op("Squeeze", [column, g.const("axis", [1], np.int64)], output="score")
    outputs = [g.tensor(score, ["n"])]
    if estimator._task == "binary":
        outputs.append(g.tensor(_binary_probabilities(g, score), ["n", 2]))
    doc = f"vfl {type(estimator).__name__}: {len(estimator.coef_blocks_)} parties' blocks as one layer"
    return g.save(path, [g.tensor("X", ["n", d])], outputs, doc)


def _sequential(g: _Graph, x: str, net, stem: str) -> str:
    """A torch ``nn.Sequential`` of ``Linear`` and ``ReLU`` layers (:func:`vertical.nn.networks.mlp`)."""
    for position, layer in enumerate(net):
        kind = type(layer).__name__
        if kind == "Linear":
            weight = layer.weight.detach().cpu().numpy()
            bias = layer.bias.detach().cpu().numpy()
            x = g.linear(x, weight, bias, f"{stem}{position}")
        elif kind == "ReLU":
            x = g.op("Relu", [x])
        else:
            raise ValueError(f"{stem}: a {kind} layer has no ONNX export here (Linear and ReLU only)")
    return x


def mlp_to_onnx(estimator, path: str | Path) -> Path:
    """The fitted split network, bottoms on their column slices, summed, then the top; see the module
    docstring."""
    from vertical.nn.networks import MLPBottom, MLPTop

    top = estimator.top_
    if not isinstance(top, MLPTop) or not all(isinstance(b, MLPBottom) for b in estimator.bottoms_):
        raise ValueError("only MLP bottoms and an MLP top have an ONNX export")
    g = _Graph(np.dtype(str(top.dtype).removeprefix("torch.")))
    cut = None
    for p, (bottom, columns) in enumerate(zip(estimator.bottoms_, estimator.columns_, strict=True)):
        own = g.op("Gather", ["X", g.const(f"columns{p}", columns, np.int64)], axis=1)
        h = _sequential(g, own, bottom.net, f"party{p}_")
        cut = h if cut is None else g.op("Add", [cut, h])
    logits = g.op("Identity", [_sequential(g, cut, top.net, "top")], output="logits")
    if top.binary:
        probabilities = _binary_probabilities(g, g.op("Squeeze", [logits, g.const("axis", [1], np.int64)]))
    else:
        probabilities = g.op("Softmax", [logits], output="probabilities", axis=1)
    n_logits = 1 if top.binary else top.n_classes
    outputs = [g.tensor(logits, ["n", n_logits]), g.tensor(probabilities, ["n", top.n_classes])]
    doc = f"vfl VerticalMLPClassifier: {len(estimator.bottoms_)} parties' bottoms, their sum, the top"
    return g.save(path, [g.tensor("X", ["n", estimator.n_features_in_])], outputs, doc)
