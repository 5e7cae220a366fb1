"""``vfl plot`` and the plotting conventions of ``experiments/`` (docs/plots.md): one legend per figure,
a fixed colour per method on every panel, labelled axes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.figure
import pytest

from vfl.cli import main
from vfl.plotting import figure, read_metrics


def make_run(folder: Path, records: list[dict], config: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def records(n: int, scale: float) -> list[dict]:
    return [{"epoch": 0.5 * i, "time": 1.5 * i, "updates": 100 * i, "loss": 0.7 - 0.1 * scale * i,
             "suboptimality": 0.3 / (1 + i) ** 2, "test_accuracy": 0.6 + 0.05 * i} for i in range(n)]


def test_vfl_plot_two_runs_png_and_csv(tmp_path, capsys):
    a = make_run(tmp_path / "20261124-090746-breast-cancer", records(4, 1.0),
                 {"dataset": "breast-cancer", "algorithm": "svrg", "mode": "async"})
    b = make_run(tmp_path / "20261124-091000-breast-cancer", records(3, 0.5))
    assert main(["plot", str(a), str(b), "--x", "epoch"]) == 0
    png = a / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for run, n in ((a, 4), (b, 3)):
        with open(run / "metrics.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert len(rows) == n
        assert list(rows[0])[:6] == ["epoch", "time", "updates", "loss", "suboptimality", "test_accuracy"]
        assert float(rows[-1]["time"]) == pytest.approx(1.5 * (n - 1))
    out = tmp_path / "both.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.exists()
    assert "wrote" in capsys.readouterr().out


def test_vfl_plot_figure_one_legend_fixed_colours(tmp_path):
    data = [("run-a (svrg/async)", records(4, 1.0)), ("run-b", records(3, 0.5))]
    fig = figure(data, "time")
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["run-a (svrg/async)", "run-b"]
    assert len(fig.axes) == 3   # loss, sub-optimality, accuracy (no RMSE in these runs)
    assert fig.axes[1].get_yscale() == "log"
    for ax in fig.axes:
        assert ax.get_xlabel() == "training time (s)" and ax.get_ylabel()
    assert len(_colours_by_label(fig)) == 2   # each run: one colour on every panel


def _one_line_error(capsys, argv: list[str], *fragments: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("vfl plot: error:")
    for fragment in fragments:
        assert fragment in err


def test_vfl_plot_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    _one_line_error(capsys, ["plot", str(tmp_path / "nothing")], "nothing", "no metrics.jsonl")
    make_run(tmp_path / "empty", [])
    _one_line_error(capsys, ["plot", str(tmp_path / "empty")], "empty", "metrics.jsonl", "empty")
    bad = make_run(tmp_path / "bad", records(2, 1.0))
    with open(bad / "metrics.jsonl", "a") as handle:
        handle.write('{"epoch": 1.0, "loss": \n')
    _one_line_error(capsys, ["plot", str(bad)], f"{bad / 'metrics.jsonl'}:3:")
    good = make_run(tmp_path / "good", records(2, 1.0))
    _one_line_error(capsys, ["plot", str(good), str(tmp_path / "nothing")], "no metrics.jsonl")
    assert not (good / "metrics.png").exists()   # nothing drawn when one run is unreadable
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3"):
        read_metrics(bad)


# ------------------------------------------------------------------------ experiments' figures


def _colours_by_label(fig) -> dict[str, set]:
    found: dict[str, set] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                found.setdefault(line.get_label(), set()).add(matplotlib.colors.to_hex(line.get_color()))
    return found


def _check_conventions(figures: list) -> None:
    assert figures
    for fig in figures:
        assert len(fig.legends) == 1, "one figure-level legend"
        assert all(ax.get_legend() is None for ax in fig.axes), "no per-panel legend"
        colours = _colours_by_label(fig)
        assert all(len(c) == 1 for c in colours.values()), f"a label with several colours: {colours}"
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), f"unlabelled axis on {ax.get_title()!r}"


@pytest.fixture(autouse=True)
def _no_figure_left_open():
    """Figures a test draws (or keeps open to inspect) are closed after it: pyplot would keep them for
    the rest of the session, and warn in whichever later test opens the 21st."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture
def saved_figures(monkeypatch):
    """Every Figure an experiment saves, kept open for inspection (the PNG is not written)."""
    figures: list = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "close", lambda *a, **k: None)
    return figures


def test_fedbat_curves_one_colour_per_method_and_one_legend(tmp_path, saved_figures):
    fedbat = pytest.importorskip("experiments.fedbat_table1")
    accuracy = {"fedavg": (0.7, 0.8), "signsgd": (0.1, 0.1), "fedbat": (0.6, 0.75)}
    orders = {"iid": ["signsgd", "fedavg", "fedbat"], "noniid1": ["fedavg", "signsgd", "fedbat"],
              "noniid2": ["fedbat", "fedavg", "signsgd"]}   # row order differs between panels
    rows = []
    (tmp_path / "runs").mkdir()
    for split, methods in orders.items():
        for method in methods:
            run = fedbat.Run(method, 100, split)
            lines = [{"round": r, "test_accuracy": a} for r, a in zip((5, 10), accuracy[method], strict=True)]
            (tmp_path / "runs" / f"{run.tag}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            rows.append({"method": method, "n_clients": 100, "split": split, "rho": 6.0, "phi": 0.5,
                         "seed": 0, "final_accuracy": 100 * accuracy[method][1],
                         "best_accuracy": 100 * accuracy[method][1], "diverged": ""})
    fedbat.plot(rows, fedbat.Scale(), tmp_path)
    _check_conventions(saved_figures)
    # the line labelled fedavg ends at FedAvg's accuracy on every panel
    for ax in saved_figures[0].axes:
        fedavg = [line for line in ax.get_lines() if line.get_label() == "fedavg"]
        assert [line.get_ydata()[-1] for line in fedavg] == [pytest.approx(80.0)]


def test_fedbat_replot_from_committed_results(tmp_path, saved_figures):
    fedbat = pytest.importorskip("experiments.fedbat_table1")
    committed = Path(__file__).resolve().parents[1] / "experiments" / "results" / "fedbat"
    for name in ("results.csv", "tables.md"):
        (tmp_path / name).write_text((committed / name).read_text())
    assert fedbat.replot(tmp_path) == ["final_accuracy.png", "ablations.png"]
    _check_conventions(saved_figures)


def test_vfb2_async_colour_per_optimiser_and_mode(tmp_path, saved_figures):
    vfb2_async = pytest.importorskip("experiments.vfb2_async")
    committed = Path(__file__).resolve().parents[1] / "experiments" / "results" / "vfb2_async_sgd_saga"
    (tmp_path / "runs.csv").write_text((committed / "runs.csv").read_text())
    vfb2_async.replot(tmp_path)
    _check_conventions(saved_figures)
    colours = _colours_by_label(saved_figures[0])
    async_sync = [label for label in colours if label != "target 1e-3"]
    assert len({next(iter(colours[label])) for label in async_sync}) == len(async_sync) == 4


def test_vfb2_lr_sweep_one_colour_per_step_size(tmp_path, saved_figures):
    sweep = pytest.importorskip("experiments.vfb2_lr_sweep")
    committed = Path(__file__).resolve().parents[1] / "experiments" / "results" / "vfb2_lr_sweep"
    (tmp_path / "sweep.csv").write_text((committed / "sweep.csv").read_text())
    assert len(sweep.replot(tmp_path)) == 3
    _check_conventions(saved_figures)


COMMITTED = Path(__file__).resolve().parents[1] / "experiments" / "results"


def _lines(fig, label: str) -> list:
    return [line for ax in fig.axes for line in ax.get_lines() if line.get_label() == label]


def test_vfb2_scalability_replot_one_colour_per_mode(tmp_path, saved_figures):
    scalability = pytest.importorskip("experiments.vfb2_scalability")
    committed = COMMITTED / "vfb2_scalability" / "scalability.csv"
    (tmp_path / "scalability.csv").write_text(committed.read_text())
    scalability.replot(tmp_path)
    _check_conventions(saved_figures)
    (fig,) = saved_figures
    asynchronous = _lines(fig, "VFB²-SVRG (async)")
    assert len(asynchronous) == 2   # speedup and update rate: the same label, the same colour
    with open(tmp_path / "scalability.csv", newline="") as handle:
        rate = [float(r["updates_per_s"]) for r in csv.DictReader(handle) if r["mode"] == "async"]
    assert list(asynchronous[1].get_ydata()) == pytest.approx(rate)


def test_feddro_replot_from_committed_results(tmp_path, saved_figures):
    feddro = pytest.importorskip("experiments.feddro_fmnist")   # needs torch
    for name in ("main.csv", "period.csv", "summary.json"):
        (tmp_path / name).write_text((COMMITTED / "feddro" / name).read_text())
    assert [p.name for p in feddro.replot(tmp_path)] == ["main.png", "period.png"]
    _check_conventions(saved_figures)
    main_fig, period_fig = saved_figures
    # the line labelled FedDRO ends, on the test panel, at FedDRO's mean final test accuracy in main.csv
    with open(tmp_path / "main.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["method"].startswith("FedDRO") and r["lr"] == "0.01"]
    last = max(int(r["model_rounds"]) for r in rows)
    final = [float(r["test_accuracy"]) for r in rows if int(r["model_rounds"]) == last]
    (feddro_test,) = [line for line in main_fig.axes[1].get_lines() if line.get_label().startswith("FedDRO")]
    assert feddro_test.get_ydata()[-1] == pytest.approx(100 * sum(final) / len(final))
    assert len(_colours_by_label(period_fig)) == 6   # one colour per period I, on both splits


def test_feddro_toy_p1_one_panel_per_step_size_and_the_committed_finals(tmp_path, saved_figures):
    toy = pytest.importorskip("experiments.feddro_toy")   # needs torch
    paths = toy.p1_paths((0.1,))
    stored = json.loads((COMMITTED / "feddro" / "toy_results.json").read_text())["p1"]
    for (name, eta), path in paths.items():
        assert path[-1] == pytest.approx(stored[f"{name}|{eta}"]["final"], abs=1e-9)
    toy.plot_p1(paths, tmp_path / "toy_p1.png")
    _check_conventions(saved_figures)
    assert set(_colours_by_label(saved_figures[0])) == {*toy.COLOURS, "x̄ = 0.5"}


def test_hfl_scafcom_replot_fixed_colours_and_diverged_runs_named(tmp_path, saved_figures):
    import shutil

    scafcom = pytest.importorskip("experiments.hfl_scafcom")   # needs torch
    source = COMMITTED / "hfl_scafcom"
    for name in ("summary.csv", "summary.json"):
        shutil.copy(source / name, tmp_path / name)
    shutil.copytree(source / "metrics", tmp_path / "metrics")
    assert [p.name for p in scafcom.replot(tmp_path)] == ["fig2.png", "fig3.png", "fig4.png"]
    _check_conventions(saved_figures)
    fig2, fig3, fig4 = saved_figures
    for fig in (fig2, fig3):   # the baseline has one colour in every figure
        assert _colours_by_label(fig)["SCAFFOLD (32-bit)"] == {"#000000"}
    legend = [t.get_text() for t in fig4.legends[0].get_texts()]
    assert "SCALLION 2-bit α=1 (diverged at round 7, before any evaluation)" in legend
    colours = [next(iter(c)) for c in _colours_by_label(fig4).values()]
    assert len(set(colours)) == len(colours) == 9   # β and α runs: no two lines share a colour


def test_hfl_isca_replot_names_a_method_once_where_it_diverged_in_both_splits(tmp_path, saved_figures):
    import shutil

    isca = pytest.importorskip("experiments.hfl_isca")   # needs torch
    source = COMMITTED / "hfl_isca"
    for name in ("summary.csv", "summary.json"):
        shutil.copy(source / name, tmp_path / name)
    for split in ("iid", "shards"):
        shutil.copytree(source / split / "metrics", tmp_path / split / "metrics")
    assert [p.name for p in isca.replot(tmp_path)] == ["fig1_4.png", "fig2_5.png", "fig3_6.png"]
    _check_conventions(saved_figures)
    legend = [t.get_text() for t in saved_figures[1].legends[0].get_texts()]
    assert legend == ["ISCAM 2-bit", "SCALLION 2-bit",
                      "FedCOMGATE 2-bit (diverged IID at round 112; non-IID at round 80)"]


def test_vfl_plot_draws_a_horizontal_run_against_rounds(tmp_path, capsys):
    """``python -m parties.hfl`` records rounds, not training time: the plot takes rounds by default
    (it used to stop with numpy's "number sections must be larger than 0")."""
    hfl = [{"round": r, "round_seconds": 0.1, "uplink_bits": 1e6 * r, "train_loss": 2.3 / r,
            "test_accuracy": 0.1 + 0.1 * r, "algorithm": "fedavg"} for r in range(1, 5)]
    run = make_run(tmp_path / "hfl", hfl)
    assert main(["plot", str(run)]) == 0
    fig = figure([("hfl", hfl)], "round")
    assert [ax.get_ylabel() for ax in fig.axes] == ["training loss", "test accuracy (%)"]
    assert all(ax.get_xlabel() == "rounds" for ax in fig.axes)
    assert main(["plot", str(run), "--x", "epoch"]) == 2
    assert "no loss, sub-optimality or test metric recorded with 'epoch'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plot", "split"])
def test_an_out_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path, capsys, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    run = make_run(tmp_path / "run", records(3, 1.0))
    argv = ([command, str(run), "--out", str(blocker / "metrics.png")] if command == "plot"
            else [command, "breast-cancer", "-n", "2", "--out", str(blocker / "parties")])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vfl {command}: error: ") and "Not a directory" in err and "\n" not in err
