"""Smoke tests of the horizontal-FL paper reproductions: each ``--quick`` run end to end on the real
Fashion-MNIST (skipped when absent), asserting on the files a user reads and on the numbers that carry
the papers' claims at this tiny scale: measured compression ratios, the K + 1 gradients and two uplink
vectors of ISCA, consistent control variates, and FedAvg's IID/non-IID gap. Both quick runs together
take about a minute and a half on two quiet cores.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from experiments import hfl_isca, hfl_scafcom
from experiments.hfl_scafcom import (
    LR_GLOBAL_GRID,
    LR_LOCAL_GRID,
    Experiment,
    RunResult,
    RunSpec,
    family_learning_rates,
    markdown_table,
    rank_learning_rates,
    run_with_fallback,
)
from tests.conftest import requires_dataset

D = 235_146          # parameters of the papers' MLP 784-256-128-10


def test_rounds_to_target_and_final_accuracy_helpers() -> None:
    records = [{"round": 1, "uplink_bits": 10, "round_seconds": 0.1},
               {"round": 2, "uplink_bits": 20, "round_seconds": 0.1, "test_accuracy": 0.5, "train_loss": 1.0},
               {"round": 3, "uplink_bits": 30, "round_seconds": 0.1},
               {"round": 4, "uplink_bits": 40, "round_seconds": 0.1, "test_accuracy": 0.7, "train_loss": 0.5}]
    result = RunResult(RunSpec("a", "A", "fedavg", "a"), 0.1, 1.0, records)
    assert result.reach(0.6) == (4, 40) and result.reach(0.5) == (2, 20) and result.reach(0.9) is None
    assert result.final_accuracy == pytest.approx(0.6)
    summary = result.summary(clients_per_round=2, dim=10, target=0.6)
    assert summary["uplink_bits_per_client_round"] == 5 and summary["compression_vs_32bit"] == 64
    assert summary["rounds_to_target"] == 4
    assert math.isnan(RunResult(result.spec, 0.1, 1.0, records, diverged_at=3).final_accuracy)
    assert markdown_table(["a", "b"], [[1, "x"]]).splitlines() == ["| a | b |", "|---|---|", "| 1 | x |"]


def _evaluated_run(spec: RunSpec, lr_local: float, lr_global: float, diverged_at: int | None) -> RunResult:
    records = [{"round": 10, "uplink_bits": 1, "round_seconds": 0.1, "test_accuracy": 0.8, "train_loss": 0.5}]
    return RunResult(spec, lr_local, lr_global, records, diverged_at)


class FakeRuns:
    """Stands in for ``Experiment.run``: diverges (at round 212) for the pairs in ``diverging``."""

    def __init__(self, diverging: set[tuple[float, float]]) -> None:
        self.diverging = diverging
        self.calls: list[tuple[str, float, float, str]] = []

    def __call__(self, spec: RunSpec, lr_local: float, lr_global: float, rounds: int, *, name: str
                 ) -> RunResult:
        self.calls.append((spec.key, lr_local, lr_global, name))
        diverged_at = 212 if (lr_local, lr_global) in self.diverging else None
        return _evaluated_run(spec, lr_local, lr_global, diverged_at)


def test_a_diverged_final_run_falls_back_to_the_next_best_pair_and_says_so() -> None:
    spec = RunSpec("scaffold", "SCAFFOLD", "scaffold", "scaffold")
    ranked = [(0.1, 1.0), (0.03, 3.0), (0.03, 1.0)]
    runs = FakeRuns({(0.1, 1.0)})
    result = run_with_fallback(runs, spec, ranked, rounds=300)
    assert runs.calls == [("scaffold", 0.1, 1.0, "scaffold"), ("scaffold", 0.03, 3.0, "scaffold_l0.03_g3")]
    assert (result.lr_local, result.lr_global, result.diverged_at) == (0.03, 3.0, None)
    assert result.final_accuracy == pytest.approx(0.8)
    assert result.lr_label == "(0.03, 3); diverged first: (0.1, 1) at round 212"
    assert result.summary(10, 100)["diverged_lr_choices"] == "(0.1, 1) at round 212"
    # no divergence: one run, nothing to report; every pair diverges: the last one is reported as diverged
    stable = run_with_fallback(FakeRuns(set()), spec, ranked, rounds=300)
    assert stable.lr_label == "(0.1, 1)" and stable.summary(10, 100)["diverged_lr_choices"] == ""
    hopeless = run_with_fallback(FakeRuns(set(ranked)), spec, ranked, rounds=300)
    assert hopeless.diverged_at == 212 and math.isnan(hopeless.final_accuracy)
    assert hopeless.lr_label == "(0.03, 1); diverged first: (0.1, 1) at round 212; (0.03, 3) at round 212"
    with pytest.raises(ValueError, match="no learning-rate pair"):
        run_with_fallback(runs, spec, [], rounds=300)


def test_tuning_ranks_the_pairs_that_did_not_diverge_best_first() -> None:
    rows = [{"lr_local": 0.03, "lr_global": 1.0, "final_test_accuracy": 0.5},
            {"lr_local": 0.1, "lr_global": 1.0, "final_test_accuracy": math.nan},
            {"lr_local": 0.1, "lr_global": 3.0, "final_test_accuracy": 0.7},
            {"lr_local": 0.3, "lr_global": 1.0, "final_test_accuracy": 0.5}]
    assert rank_learning_rates(rows) == [(0.1, 3.0), (0.03, 1.0), (0.3, 1.0)]


class FakeTuner(Experiment):
    """An ``Experiment`` without data whose ``tune`` records which runs it was asked to tune."""

    def __init__(self) -> None:
        self.tuned: list[str] = []

    def tune(self, spec: RunSpec, lr_locals, lr_globals, rounds: int):  # type: ignore[no-untyped-def]
        assert (tuple(lr_locals), tuple(lr_globals), rounds) == (LR_LOCAL_GRID, LR_GLOBAL_GRID, 50)
        self.tuned.append(spec.key)
        return [(0.1, 1.0), (0.03, 1.0)], [{"family": spec.key}]


def test_each_family_is_tuned_once_on_its_named_member_and_shared() -> None:
    specs = [RunSpec("scallion-4bit", "S4", "scallion", "scallion-2bit"),
             RunSpec("scallion-2bit", "S2", "scallion", "scallion-2bit"),
             RunSpec("fedavg", "F", "fedavg", "fedavg")]
    tuner = FakeTuner()
    candidates, rows = family_learning_rates(specs, tuner, 50, lambda spec: (9.0, 9.0))
    assert tuner.tuned == ["scallion-2bit", "fedavg"]
    assert candidates == {"scallion-2bit": [(0.1, 1.0), (0.03, 1.0)], "fedavg": [(0.1, 1.0), (0.03, 1.0)]}
    assert rows == [{"family": "scallion-2bit"}, {"family": "fedavg"}]
    untuned, no_rows = family_learning_rates(specs, tuner, 0, lambda spec: (0.2, float(len(spec.key))))
    assert untuned == {"scallion-2bit": [(0.2, 13.0)], "fedavg": [(0.2, 6.0)]} and no_rows == []
    with pytest.raises(ValueError, match="not one of the runs"):
        family_learning_rates(specs[:1], tuner, 0, lambda spec: (0.1, 1.0))


@pytest.fixture(scope="module")
def scafcom_quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("hfl-scafcom")
    assert hfl_scafcom.main(["--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def isca_quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("hfl-isca")
    assert hfl_isca.main(["--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.data
@requires_dataset("fashion-mnist")
def test_scafcom_quick_reports_measured_compression_and_learning(scafcom_quick: tuple[Path, dict]) -> None:
    out, summary = scafcom_quick
    for name in ("results.md", "summary.csv", "fig2.png", "fig3.png", "fig4.png",
                 "metrics/scafcom-top0.01-beta0.2.csv", "metrics/scaffold.jsonl"):
        assert (out / name).stat().st_size > 0, name
    runs = summary["runs"]
    assert set(runs) == {"scaffold", "fedavg", "scafcom-top0.01-beta0.2", "fed-ef-top0.01",
                         "scallion-2bit-alpha0.1", "fedcomgate-2bit"}
    rounds, S, K = 10, 20, 10
    for run in runs.values():
        assert run["rounds"] == rounds and run["gradient_evaluations"] == rounds * S * K
        assert 0.12 < run["final_test_accuracy"] <= 1.0, run["run"]       # learning: above chance (0.1)
    assert runs["scaffold"]["final_test_accuracy"] > 0.35 and runs["fedavg"]["final_test_accuracy"] > 0.35
    assert runs["scaffold"]["compression_vs_32bit"] == pytest.approx(1.0, rel=1e-12)
    # Top-1 % sends 1 % of the values plus their positions: 20-100x fewer bits (the paper's headline range)
    assert 20 < runs["scafcom-top0.01-beta0.2"]["compression_vs_32bit"] < 100
    assert runs["scallion-2bit-alpha0.1"]["compression_vs_32bit"] > 50      # dithering also sparsifies
    for key in ("scaffold", "scafcom-top0.01-beta0.2", "scallion-2bit-alpha0.1"):
        assert runs[key]["control_invariant_gap"] < 1e-5, key                  # c = mean c_i (float32)
    ratio = summary["uplink_ratio_scaffold_over_scafcom"]
    assert ratio == pytest.approx(runs["scafcom-top0.01-beta0.2"]["compression_vs_32bit"], rel=1e-9)
    text = (out / "results.md").read_text()
    assert "MNIST absent" in text and "Headline" in text and "REDUCED" in text
    with (out / "summary.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(runs)


@pytest.mark.data
@requires_dataset("fashion-mnist")
def test_isca_quick_shows_the_extra_gradient_two_uplinks_and_fedavg_split_gap(
        isca_quick: tuple[Path, dict]) -> None:
    out, summary = isca_quick
    for name in ("results.md", "summary.csv", "fig1_4.png", "fig2_5.png", "iid/metrics/isca.csv",
                 "shards/metrics/iscam-2bit.jsonl"):
        assert (out / name).stat().st_size > 0, name
    runs = {(r["split"], r["run"]): r for r in summary["runs"]}
    assert len(runs) == 2 * 6
    rounds, S, K = 15, 10, 5
    for split in ("iid", "shards"):
        isca, scaffold = runs[split, "isca"], runs[split, "scaffold"]
        assert isca["gradient_evaluations"] == rounds * S * (K + 1)
        assert scaffold["gradient_evaluations"] == rounds * S * K
        assert isca["uplink_bits_per_client_round"] == 2 * 32 * D
        assert scaffold["uplink_bits_per_client_round"] == 32 * D
        assert runs[split, "iscam-2bit"]["compression_vs_32bit"] > 20
        for key in ("isca", "iscam-2bit", "scaffold", "scallion-2bit"):
            assert runs[split, key]["control_invariant_gap"] < 1e-5, (split, key)
        for run in (isca, scaffold, runs[split, "iscam-2bit"]):  # it learns: chance is 0.1 (10 classes)
            assert run["final_test_accuracy"] > 0.2, (split, run["run"])
    # client drift: FedAvg is clearly better on IID than on one-class shards
    assert summary["split_gaps"]["fedavg"] > 0.05
    text = (out / "results.md").read_text()
    assert "MNIST absent" in text and "Headline (ISCA consistent" in text


def test_a_feature_nan_or_infinity_anywhere_is_refused_by_the_data_check() -> None:
    """The data check reads the smallest and largest feature (horizontal/rounds.py ``all_finite``): a NaN
    or ±inf in any position, a strided view's included, is still found; finite data and no rows pass."""
    import torch

    from horizontal.models import MLP

    model = MLP(6, (), 3)
    y = torch.zeros(5, dtype=torch.int64)
    model.check_data(torch.zeros(5, 6), y, "train")
    model.check_data(torch.zeros(0, 6), y[:0], "train")
    for value in (math.nan, math.inf, -math.inf):
        X = torch.zeros(5, 12)
        X[3, 7] = value
        with pytest.raises(ValueError, match="train: features contain NaN or infinity"):
            model.check_data(X[:, 1::2], y, "train")
