"""The named datasets: what each is, which files it needs, how it is split, and :func:`load`.

Shapes are the published ones (LIBSVM's pages, the UCI/Kaggle files, MANIFEST.md); a loaded file that
does not match is rejected. Paper aliases: D1..D6 of the VFB² paper (Table 1 and Appendix D).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from vertical.datasets import credit, embedded, idx
from vertical.datasets.base import Dataset, DatasetSpec
from vertical.datasets.libsvm import libsvm_loader, standin_loader
from vertical.datasets.paths import DatasetNotFoundError, candidate_paths, find_file
from vertical.datasets.synth import SHAPES as STANDIN_SHAPES
from vertical.datasets.synth import read_sidecar, standin_file_name
from vertical.datasets.validation import DataValidationError

SYSTEM_DATASET_DIRS = (Path("/usr/share/datasets"),)
"""Where Debian's ``dataset-fashion-mnist`` package (and its likes) install files."""


def _idx_files(folder: str) -> tuple[str, ...]:
    return tuple(f"{folder}/{name}" for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))


_SPECS = (
    DatasetSpec("a9a", "binary", "LIBSVM a9a (UCI Adult, binarised)", libsvm_loader(), ("a9a",),
                n_rows=32_561, n_features=123),
    DatasetSpec("w8a", "binary", "LIBSVM w8a (web page categories; has rows with no features)",
                libsvm_loader(), ("w8a",), n_rows=49_749, n_features=300),
    DatasetSpec("credit-card", "binary", "UCI default of credit card clients, one-hot encoded (paper D1)",
                credit.load_uci_credit_card, ("UCI_Credit_Card.csv",), n_rows=30_000, n_features=90,
                aliases=("d1", "uci-credit-card")),
    DatasetSpec("give-me-some-credit", "binary", "Kaggle GiveMeSomeCredit, one-hot encoded (paper D2)",
                credit.load_give_me_some_credit, ("cs-training.csv",), n_rows=150_000, n_features=92,
                aliases=("d2",), strict_features=False,
                notes="feature rule aims at the paper's 92 but is unverified on the real file"),
    DatasetSpec("news20", "binary", "LIBSVM news20.binary (paper D3)", libsvm_loader(), ("news20.binary",),
                n_rows=19_996, n_features=1_355_191, aliases=("d3",), stand_in="news20-standin"),
    DatasetSpec("webspam", "binary", "LIBSVM webspam, trigram version (paper D4)", libsvm_loader(),
                ("webspam_wc_normalized_trigram.svm",), n_rows=350_000, n_features=16_609_143,
                aliases=("d4",), stand_in="webspam-standin"),
    *(DatasetSpec(shape.name, "binary", f"SYNTHETIC stand-in for {shape.of} (`vfl synth {key}`; rows as "
                  f"written)", standin_loader, (standin_file_name(key),), n_rows=shape.n_rows,
                  n_features=shape.n_features, aliases=(f"{'d3' if key == 'news20' else 'd4'}-standin",))
      for key, shape in STANDIN_SHAPES.items()),
    DatasetSpec("e2006-tfidf", "regression", "LIBSVM E2006-tfidf (paper D5)", libsvm_loader(),
                ("E2006.train", "E2006.test"), n_rows=16_087, n_test_rows=3_308, n_features=150_360,
                aliases=("d5",)),
    DatasetSpec("yearpredictionmsd", "regression",
                "LIBSVM YearPredictionMSD, target min-max normalised to [0, 1], features max-abs scaled "
                "(paper D6)", libsvm_loader(normalise_target=True, scale_features=True),
                ("YearPredictionMSD", "YearPredictionMSD.t"), n_rows=463_715, n_test_rows=51_630,
                n_features=90, aliases=("d6",)),
    DatasetSpec("rcv1", "binary", "LIBSVM rcv1.binary, training file only", libsvm_loader(),
                ("rcv1_train.binary",), n_rows=20_242, n_features=47_236),
    DatasetSpec("real-sim", "binary", "LIBSVM real-sim", libsvm_loader(), ("real-sim",),
                n_rows=72_309, n_features=20_958),
    DatasetSpec("covtype", "binary", "LIBSVM covtype.binary (labels 1/2 mapped to -1/+1)",
                libsvm_loader(label_map={1.0: -1.0, 2.0: 1.0}), ("covtype.libsvm.binary",),
                n_rows=581_012, n_features=54),
    DatasetSpec("fashion-mnist", "multiclass", "Fashion-MNIST 28x28 images, 10 classes",
                idx.load_idx_image_dataset, _idx_files("fashion-mnist"), n_rows=60_000, n_test_rows=10_000,
                n_features=784, system_dirs=SYSTEM_DATASET_DIRS),
    DatasetSpec("mnist", "multiclass", "MNIST 28x28 digit images, 10 classes", idx.load_idx_image_dataset,
                _idx_files("mnist"), n_rows=60_000, n_test_rows=10_000, n_features=784,
                system_dirs=SYSTEM_DATASET_DIRS),
    DatasetSpec("breast-cancer", "binary", "scikit-learn's bundled Wisconsin breast cancer, standardised",
                embedded.load_breast_cancer, (), n_rows=569, n_features=30),
    DatasetSpec("diabetes", "regression", "scikit-learn's bundled diabetes", embedded.load_diabetes, (),
                n_rows=442, n_features=10),
    DatasetSpec("digits", "multiclass",
                "scikit-learn's bundled 8x8 digits in [0, 1] (horizontal-FL stand-in)",
                embedded.load_digits, (), n_rows=1_797, n_features=64),
)

_BY_NAME = {key: spec for spec in _SPECS for key in (spec.name, *spec.aliases)}


@dataclass(frozen=True)
class DatasetInfo:
    """One line of ``vfl datasets``: what a dataset is and whether its files are here.

    ``where``: the folder holding the first file when present, ``"bundled"`` for embedded data, else
    ``None``.
    """

    name: str
    aliases: tuple[str, ...]
    task: str
    shape: tuple[int, int]
    split: str
    files: tuple[str, ...]
    present: bool
    where: str | None
    description: str


def get_spec(name: str) -> DatasetSpec:
    """The spec of a dataset by name or alias (case-insensitive); unknown -> ValueError with the list."""
    spec = _BY_NAME.get(name.strip().lower())
    if spec is None:
        known = ", ".join(sorted(_BY_NAME))
        raise ValueError(f"unknown dataset {name!r}; known names and aliases: {known}")
    return spec


def _locate_files(spec: DatasetSpec, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    return [find_file(name, dataset=spec.name, data_dir=data_dir, system_dirs=spec.system_dirs)
            for name in spec.files]


def resolve_name(name: str, data_dir: str | os.PathLike[str] | None = None) -> str:
    """The registered name a run will use: ``name``'s own, or its stand-in's (``news20`` →
    ``news20-standin``) when the real file is absent and ``vfl synth`` wrote a stand-in. The real
    file always wins; a run on a stand-in carries the stand-in's name, so its results say so.
    """
    return _resolve_spec(name, data_dir).name


def _resolve_spec(name: str, data_dir: str | os.PathLike[str] | None) -> DatasetSpec:
    spec = get_spec(name)
    if spec.stand_in is None:
        return spec
    try:
        _locate_files(spec, data_dir)
        return spec
    except DatasetNotFoundError as missing:
        stand_in = get_spec(spec.stand_in)
        try:
            _locate_files(stand_in, data_dir)
        except DatasetNotFoundError:
            raise missing from None
        warnings.warn(f"dataset {spec.name!r}: the real file is not here; using the synthetic stand-in "
                      f"{stand_in.name!r} (results are labelled stand-in)", stacklevel=3)
        return stand_in


def list_datasets(data_dir: str | os.PathLike[str] | None = None) -> list[DatasetInfo]:
    """Every registered dataset, with whether its files are present (nothing is loaded)."""
    infos = []
    for spec in _SPECS:
        rows = spec.n_rows + (spec.n_test_rows or 0)
        where: str | None = "bundled" if not spec.files else None
        if spec.files:
            found = [next((p for p in candidate_paths(name, data_dir=data_dir, system_dirs=spec.system_dirs)
                           if p.is_file()), None) for name in spec.files]
            if all(found):
                where = str(found[0].parent)
                if spec.loader is standin_loader:  # a stand-in has the rows it was written with
                    rows = _standin_rows(found[0], rows)
        infos.append(DatasetInfo(spec.name, spec.aliases, spec.task, (rows, spec.n_features), spec.split,
                                 spec.files, where is not None, where, spec.description))
    return infos


def _standin_rows(path: Path, default: int) -> int:
    try:
        return int(read_sidecar(path)["n_rows"])
    except DataValidationError:
        return default


def load(name: str, seed: int = 0, data_dir: str | os.PathLike[str] | None = None) -> Dataset:
    """Load a registered dataset, split into train/test (seeded 80/20 unless a test file is given).

    Raises :class:`~vertical.datasets.paths.DatasetNotFoundError` naming the missing file and every folder
    searched, and :class:`~vertical.datasets.validation.DataValidationError` for a file that does not match
    its published shape or holds invalid values.
    """
    spec = _resolve_spec(name, data_dir)
    dataset = spec.loader(spec, _locate_files(spec, data_dir), int(seed))
    if dataset.n_features != spec.n_features:
        message = (f"dataset {spec.name!r}: {dataset.n_features} features after preprocessing, expected "
                   f"{spec.n_features}")
        if spec.strict_features:
            raise DataValidationError(message)
        warnings.warn(f"{message} ({spec.notes})", stacklevel=2)
    return dataset

