"""``vfl export`` of a network party (``--model mlp``): its trained bottom network as named arrays.

A network party's part is the same two files as a linear party's (:mod:`parties.export`), with the
manifest's ``model`` set to ``"mlp"`` and, instead of the block ``w``, the layers of its bottom network
(the leader's part also holds the top): ``bottom/<i>/weight`` (out × in) and ``bottom/<i>/bias`` (out)
for its i-th linear layer, in the dtype it was trained in, with ReLU between layers and none after the
last. The top takes ``z = Σ_l h_l(x_l)``, applies ReLU first when it has layers, and gives one logit
(two classes: σ of it is the probability of the positive class) or C logits (softmax). The manifest
names the widths (``bottom``, and ``top`` with ``classes`` at the leader), so a reader knows every
array's shape before it reads any: names, shapes and dtype are checked from the headers first, then
every value is checked finite, as for a linear part and a checkpoint.

The part is computed here in numpy from those arrays alone, as anyone outside vfl would: each party's
raw columns scaled by its ``shift``/``scale``, through its layers in their dtype; the embeddings
summed; the leader's top. :func:`network_scores` gives what ``vfl predict`` writes for the same rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from vertical.nn.base import parse_spec

MODEL = "mlp"
#: a network's sum goes through the leader's top: the link of every network part
LINK = "top"
DTYPES = ("float32", "float64")
#: more parameters than a network part may hold (1 GiB of float32): an announced shape beyond is damage
MAX_PARAMETERS = 1 << 28

Layers = tuple[tuple[np.ndarray, np.ndarray], ...]


@dataclass(frozen=True)
class NetworkExport:
    """One network party's exported part: its bottom's layers (the leader's top's too), its scaling
    (None: ``--standardize off``) and its column schema."""

    party: int
    parties: int
    problem: str
    epochs: float
    bottom: Layers
    dtype: str = "float32"
    top: Layers | None = None
    classes: int | None = None
    standardize: str = "off"
    shift: np.ndarray | None = None
    scale: np.ndarray | None = None
    columns: np.ndarray | None = None
    feature_names: tuple[str, ...] | None = None
    id_column: str = "id"
    model = MODEL
    link = LINK

    @property
    def n_features(self) -> int:
        return int(self.bottom[0][0].shape[1])

    @property
    def k(self) -> int:
        return int(self.bottom[-1][0].shape[0])

    @property
    def widths(self) -> tuple[int, ...]:
        return widths_of(self.bottom)

    def embed(self, X) -> np.ndarray:
        """``h(x)`` of each row of this party's raw columns ``X`` (in the schema's order): ``(n, k)``."""
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"party {self.party}: its part takes {self.n_features} columns, got shape "
                             f"{X.shape}")
        x = X.toarray() if sp.issparse(X) else np.asarray(X, dtype=np.float64)
        if self.scale is not None:  # as training scaled its rows (vertical/standardize.apply_scaling)
            x = (np.asarray(x, dtype=np.float64) - self.shift) * (1.0 / self.scale)
        return _forward(self.bottom, x.astype(self.dtype), relu_first=False)

    def probabilities(self, z: np.ndarray) -> np.ndarray:
        """The leader's top on the summed embeddings ``z`` (n, k): class probabilities ``(n, C)``."""
        if self.top is None or self.classes is None:
            raise ValueError(f"party {self.party}'s part holds no top: the leader's (party 0's) does")
        from scipy.special import expit, softmax

        logits = _forward(self.top, np.asarray(z, dtype=self.dtype), relu_first=True)
        if self.classes == 2:
            positive = expit(logits[:, 0])
            return np.column_stack([1.0 - positive, positive])
        return softmax(logits, axis=1)


def _forward(layers: Layers, x: np.ndarray, *, relu_first: bool) -> np.ndarray:
    """``x`` through the linear layers, ReLU between them (and before the first when ``relu_first``),
    in the layers' dtype; returned as float64."""
    for index, (weight, bias) in enumerate(layers):
        if index or relu_first:
            x = np.maximum(x, 0)
        x = x @ weight.T + bias
    return np.asarray(x, dtype=np.float64)


def widths_of(layers: Layers) -> tuple[int, ...]:
    return (int(layers[0][0].shape[1]), *(int(w.shape[0]) for w, _ in layers)) if layers else ()


def trained_part(source, own, shift, scale) -> NetworkExport:
    """Party ``source.rank``'s part (a :class:`parties.export_source.PartySource`, its own party file
    ``own`` and scaling): its trained network's layers."""
    from parties.model_options import bottom_specs
    from parties.party_model import load_trained_network

    spec = bottom_specs(source.bottom, source.parties)[source.rank]
    labels = (own.y_train, own.y_test) if source.active else None
    part = load_trained_network(source.folder, source.rank, own.n_features, source.epochs, spec,
                                source.top, labels)
    top = None if part.top is None else _layers(part.top.net)
    return NetworkExport(source.rank, source.parties, source.problem, source.epochs, _layers(part.model.net),
                         str(part.model.dtype).removeprefix("torch."), top,
                         None if part.top is None else part.top.n_classes, source.standardize, shift,
                         scale, None if own.columns is None else np.asarray(own.columns, dtype=np.int64),
                         own.feature_names)


def _layers(net) -> Layers:
    """The ``(weight, bias)`` of each linear layer of a torch ``Sequential``, in order, as numpy."""
    from torch import nn

    return tuple((m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy())
                 for m in net if isinstance(m, nn.Linear))


def arrays(part: NetworkExport) -> dict[str, np.ndarray]:
    """The part's layers as the npz's named arrays."""
    named = {}
    for prefix, layers in (("bottom", part.bottom), ("top", part.top or ())):
        for index, (weight, bias) in enumerate(layers):
            named[f"{prefix}/{index}/weight"], named[f"{prefix}/{index}/bias"] = weight, bias
    return named


def manifest_fields(part: NetworkExport) -> dict:
    fields = {"bottom": _spec(part.widths), "k": part.k, "dtype": part.dtype}
    if part.top is not None:
        fields |= {"top": _spec(widths_of(part.top) or (part.k,)), "classes": part.classes}
    return fields


def _spec(widths: tuple[int, ...]) -> str:
    return "-".join(str(w) for w in widths)


def expected_arrays(manifest: dict) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every layer array a network part's manifest announces, with its shape and dtype; a
    ``ValueError`` when its network fields are missing, out of range or disagree."""
    m = manifest
    bottom = _widths(m.get("bottom"), "bottom")
    if not (m.get("link") == LINK and m.get("dtype") in DTYPES and len(bottom) >= 2
            and bottom[0] == m["n_features"] and bottom[-1] == m.get("k")):
        raise ValueError("its network fields (link, dtype, bottom, k) are missing or disagree")
    expected = _layer_shapes("bottom", bottom)
    if "top" in m or "classes" in m:
        classes = m.get("classes")
        if not (isinstance(classes, int) and not isinstance(classes, bool) and 2 <= classes <= 1 << 16):
            raise ValueError("its top has no class count of 2 or more")
        top = _widths(m.get("top"), "top")
        if top[0] != bottom[-1] or top[-1] != (1 if classes == 2 else classes):
            raise ValueError(f"its top {m['top']!r} does not take k = {bottom[-1]} to the logits of "
                             f"{classes} classes")
        expected |= _layer_shapes("top", top)
    if sum(int(np.prod(shape)) for shape in expected.values()) > MAX_PARAMETERS:
        raise ValueError(f"its network announces more than {MAX_PARAMETERS:,} parameters")
    dtype = np.dtype(m["dtype"])
    return {name: (shape, dtype) for name, shape in expected.items()}


def _widths(spec: object, what: str) -> tuple[int, ...]:
    if not isinstance(spec, str) or len(spec) > 1024:
        raise ValueError(f"its {what} widths are missing")
    return parse_spec(spec, what=what)


def _layer_shapes(prefix: str, widths: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        shapes[f"{prefix}/{index}/weight"], shapes[f"{prefix}/{index}/bias"] = (fan_out, fan_in), (fan_out,)
    return shapes


def from_arrays(manifest: dict, named: dict[str, np.ndarray], common: dict) -> NetworkExport:
    """The part from its checked manifest and arrays (``common``: the fields every part has)."""
    def layers(prefix: str) -> Layers:
        count = len(parse_spec(manifest[prefix], what=prefix)) - 1
        return tuple((named[f"{prefix}/{i}/weight"], named[f"{prefix}/{i}/bias"]) for i in range(count))

    has_top = "classes" in manifest
    return NetworkExport(bottom=layers("bottom"), dtype=manifest["dtype"],
                         top=layers("top") if has_top else None,
                         classes=manifest["classes"] if has_top else None, **common)


def network_scores(parts, blocks) -> np.ndarray:
    """What ``vfl predict`` writes for the rows of the parties' raw column blocks (aligned by id): the
    top's logit of the positive class (two classes), else the class probabilities ``(n, C)``."""
    from parties.predict import network_outputs

    if parts[0].top is None:
        raise ValueError("party 0's part holds no top: it is not a leader's network part")
    z = np.sum([part.embed(X) for part, X in zip(parts, blocks, strict=True)], axis=0)
    return network_outputs(parts[0].probabilities(z))
