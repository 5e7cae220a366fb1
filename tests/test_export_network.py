"""``vfl export`` of a network party: its layers as named arrays, read back with every name, shape and
dtype checked from the headers before any array is read; the part computes what the party's torch
network computes. (Equality with ``vfl predict`` on a real run: ``tests/test_vertical_nn_runtime.py``.)"""

from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest

from parties.export import PartyExport, read_part, read_parts, write_part
from parties.export_network import NetworkExport


def _layers(*widths: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    return tuple((rng.normal(size=(b, a)).astype(np.float32), rng.normal(size=b).astype(np.float32))
                 for a, b in itertools.pairwise(widths))


def _leader(**changes) -> NetworkExport:
    fields = {"party": 0, "parties": 2, "problem": "logistic", "epochs": 2.0, "bottom": _layers(3, 4, 2),
              "top": _layers(2, 5, 1, seed=1), "classes": 2, "standardize": "on", "shift": np.zeros(3),
              "scale": np.array([2.0, 1.0, 4.0]), "columns": np.array([0, 2, 5])}
    return NetworkExport(**(fields | changes))


def test_a_network_part_round_trips_and_computes_what_its_torch_network_does(tmp_path):
    torch = pytest.importorskip("torch")
    from parties.export_network import _layers as layers_of
    from vertical.nn.networks import MLPBottom, MLPTop

    torch.set_num_threads(1)
    bottom = MLPBottom(np.zeros((1, 3)), "*-4-2", optimizer=None, seed=3)
    top = MLPTop("*-5-*", 3, k=2, optimizer=None, seed=4)
    json_path, _ = write_part(_leader(bottom=layers_of(bottom.net), top=layers_of(top.net), classes=3),
                              tmp_path)
    manifest = json.loads(json_path.read_text())
    assert (manifest["model"], manifest["bottom"], manifest["top"], manifest["classes"]) == ("mlp", "3-4-2",
                                                                                           "2-5-3", 3)
    assert manifest["link"] == "top" and manifest["dtype"] == "float32" and manifest["n_features"] == 3
    back = read_part(tmp_path, 0)
    assert isinstance(back, NetworkExport) and back.widths == (3, 4, 2)
    assert back.bottom[0][0].dtype == np.float32
    X = np.random.default_rng(5).normal(size=(6, 3))
    h = back.embed(X)  # raw columns: the part scales them as training did
    np.testing.assert_allclose(h, bottom.embed(X / [2.0, 1.0, 4.0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(back.probabilities(h), top.predict_proba(h), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("damage, says", [
    ("widths", "bottom/0/weight is not of shape"),
    ("k", "network fields"),
    ("classes", "does not take k = 2 to the logits of 4 classes"),
    ("dtype", "dtype float64"),
    ("huge", "more than 268,435,456 parameters"),
    ("nan", "holds NaN"),
    ("missing", "top/1/bias"),
    ("star", r"'\*' only stands first or last"),
])
def test_a_damaged_network_part_is_refused_in_one_line(tmp_path, damage, says):
    json_path, npz_path = write_part(_leader(), tmp_path)
    manifest = json.loads(json_path.read_text())
    changes = {"widths": {"bottom": "3-5-2"}, "k": {"k": 3}, "classes": {"classes": 4},
               "dtype": {"dtype": "float64"}, "huge": {"bottom": "3-100000-100000-2"},
               "star": {"bottom": "*-4-2"}}
    manifest |= changes.get(damage, {})
    if damage in ("nan", "missing"):
        with np.load(npz_path) as z:
            arrays = dict(z)
        if damage == "nan":
            arrays["bottom/1/bias"] = np.array([np.nan, 0.0], dtype=np.float32)
        else:
            del arrays["top/1/bias"]
        np.savez(npz_path, **arrays)
        manifest["arrays_sha256"] = hashlib.sha256(npz_path.read_bytes()).hexdigest()
    json_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=says) as err:
        read_part(tmp_path, 0)
    assert "party-0.export" in str(err.value) and "\n" not in str(err.value)


def test_network_and_linear_parts_do_not_make_one_model(tmp_path):
    write_part(_leader(), tmp_path)
    write_part(PartyExport(1, 2, "logistic", 2.0, np.ones(3)), tmp_path)
    with pytest.raises(ValueError, match="another model"):
        read_parts(tmp_path)
    write_part(_leader(party=1, top=None, classes=None, bottom=_layers(4, 3), shift=np.zeros(4),
                       scale=np.ones(4), columns=None), tmp_path)  # its k is 3, the leader's 2
    with pytest.raises(ValueError, match="another model"):
        read_parts(tmp_path)
