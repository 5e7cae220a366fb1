"""scikit-learn style estimators that train VFB² over real MPI parties: ``fit`` / ``predict`` / ``score``.

``fit(X, y)`` simulates a federation on one machine: the columns of ``X`` are split over ``parties``
parties (a seeded random partition, like ``vfl train --dataset``), each party gets its own file (labels
only in the active parties' files), and a real ``mpiexec`` job trains, exactly as ``vfl train
--party-files`` does. ``fit(folder)`` trains on per-party files that already exist (``vfl split``).

After fitting, ``coef_blocks_[p]`` is party p's block (in the units of ``X``) and ``columns_[p]`` its
column indices; ``coef_`` is the whole weight vector. Assembling it is possible only because this
simulation holds every block in one process: in a deployment each party keeps its own block and
``vfl predict`` scores rows through secure aggregation. ``predict``/``decision_function`` here compute
``X @ coef_ + intercept_`` locally, and ``to_onnx(path)`` writes that assembled model as ONNX
(:mod:`vfl.onnx_export`).

``gamma=None`` (the default) derives the step from the data as ``vfl train`` does without ``--gamma``
(``docs/usage.md``); ``gamma_`` is the step the fit used. ``standardize`` is ``vfl train
--standardize`` (default ``"on"``: each party divides each column by its typical non-zero magnitude); the
parties train on the scaled columns, and ``coef_`` (with ``intercept_``, non-zero only under
``"center"``) is the model in the units of ``X``, so ``decision_function(X)`` takes ``X`` as given. A fit
that ends above the loss of w = 0 warns (scikit-learn's ``ConvergenceWarning``).

The MPI layer is imported only inside ``fit``: importing the estimators starts no MPI.

``VerticalMLPClassifier`` trains a split neural network (``vertical/nn``, torch); in this phase its
``fit`` simulates the parties in one process (``docs/vertical-networks.md``). torch is imported only
when it is used.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.special import expit, log_expit
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted


class _VerticalEstimator(BaseEstimator):
    """Shared by the classifier and the regressor; ``_problem`` names the loss (``vertical.problems``)."""

    _problem: str
    _task: str

    def __init__(self, *, parties: int = 3, active: int = 1, algorithm: str = "svrg", lam: float = 1e-4,
                 gamma: float | None = None, epochs: float = 10.0, threads: int | None = None,
                 eval_every: float = 1.0, seed: int = 0, out: str | None = None,
                 verbose: bool = False, standardize: str = "on") -> None:
        self.parties = parties
        self.active = active
        self.algorithm = algorithm
        self.lam = lam
        self.gamma = gamma
        self.epochs = epochs
        self.threads = threads
        self.eval_every = eval_every
        self.seed = seed
        self.out = out
        self.verbose = verbose
        self.standardize = standardize

    # ------------------------------------------------------------------------------------------ fit

    def fit(self, X, y=None):
        """Train over MPI parties on ``X, y`` (simulated split) or on a folder of party files
        (``vfl split``'s, or ``party-<p>.csv`` files).

        The run's files (party files, checkpoints, metrics) go to ``out`` when given, and ``run_dir_``
        names that run; otherwise to a temporary folder, removed before ``fit`` returns (``run_dir_`` is
        then None): what the model needs is kept in memory.
        """
        if isinstance(X, str | Path) and y is not None:
            raise ValueError("with a folder of party files, the labels are in the active parties' "
                             "files: pass y=None")
        if self.out is not None:
            self._fit_in(Path(self.out), X, y)
            return self
        with tempfile.TemporaryDirectory(prefix="vfl-fit-") as work:
            self._fit_in(Path(work), X, y)
        self.run_dir_ = None
        return self

    def _fit_in(self, work: Path, X, y) -> None:
        if isinstance(X, str | Path):
            folder = Path(X)
            self._encode_from_files()
        else:
            folder = self._split(X, y, work / "parties")
        self._train(folder, work / "run")

    def _split(self, X, y, folder: Path) -> Path:
        from vertical.datasets import Dataset, split_to_party_files
        from vertical.partition import random_blocks

        X, y_checked = self._check_X_y(X, y)
        n = X.shape[0]
        empty = X[:0]
        ds = Dataset("in-memory", self._task, X, y_checked, empty, y_checked[:0], np.arange(n),
                     np.arange(n, n), seed=None)
        blocks = random_blocks(X.shape[1], self.parties, seed=self.seed)
        split_to_party_files(ds, blocks, list(range(self.active)), folder, partition_seed=self.seed,
                             overwrite=True, layout="folder")
        return folder

    def _train(self, folder: Path, run: Path) -> None:
        from parties.config import RunConfig
        from parties.launch import prepare, run_plan
        from parties.loading import read_scaling, scaling_path
        from parties.outcomes import EXIT_CODES
        from vertical.datasets import load_party_file
        from vertical.datasets.party_files import find_party_file

        config = RunConfig(parties=self.parties, active=self.active, party_files=str(folder),
                           problem=self._problem, lam=self.lam, algorithm=self.algorithm, gamma=self.gamma,
                           epochs=self.epochs, threads=self.threads, eval_every=self.eval_every,
                           seed=self.seed, out=str(run), overwrite=True, progress=self.verbose,
                           standardize=self.standardize)
        plan = prepare(config, echo=self.verbose)
        code = run_plan(plan, echo=self.verbose)
        if code != EXIT_CODES["ok"]:
            reason = next((k for k, v in EXIT_CODES.items() if v == code), "failed")
            raise RuntimeError(f"VFB² training {reason} (exit code {code}); the message above says why")
        folder = Path(plan.party_files)  # the files trained on (a CSV folder's converted copy)
        blocks, columns, intercept = [], [], 0.0
        for p in range(self.parties):
            with np.load(run / f"party-{p}.ckpt.npz") as z:
                w = z["w"].copy()
            if self.standardize != "off":  # trained on x/s (or (x − m)/s): w/s in the units of X
                scaling = read_scaling(scaling_path(plan, p), w.size, self.standardize)
                w = w / scaling.scale
                intercept -= float(w @ scaling.shift)
            blocks.append(w)
            columns.append(load_party_file(find_party_file(folder, p)).columns)
        self.coef_blocks_ = blocks
        self.columns_ = columns
        self.intercept_ = intercept
        self.n_features_in_ = int(sum(b.size for b in blocks))
        self.coef_ = np.zeros(self.n_features_in_)
        if all(c is not None for c in columns):
            for cols, w in zip(columns, blocks, strict=True):
                self.coef_[cols] = w
        self.history_ = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        result = json.loads((run / "result.json").read_text())
        self.gamma_ = float(result["gamma"])  # the step used: derived from the data when gamma is None
        if "warning" in result:  # ended above the loss of w = 0: the step was too long
            from sklearn.exceptions import ConvergenceWarning

            warnings.warn(result["warning"].removeprefix("warning: "), ConvergenceWarning, stacklevel=3)
        self.run_dir_ = run

    # ------------------------------------------------------------------------------------- predict

    def decision_function(self, X) -> np.ndarray:
        """Scores ``X @ coef_ + intercept_`` (the model's w·x, in the units of ``X``)."""
        check_is_fitted(self, "coef_")
        X = self._check_X(X)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} features, the model was fitted with {self.n_features_in_}")
        return np.asarray(X @ self.coef_, dtype=np.float64).ravel() + self.intercept_

    def to_onnx(self, path) -> Path:
        """Write the fitted model to ``path`` as ONNX (:mod:`vfl.onnx_export`; needs ``vfl[export]``)."""
        from vfl.onnx_export import linear_to_onnx

        check_is_fitted(self, "coef_")
        return linear_to_onnx(self, path)

    # ---------------------------------------------------------------------------------- validation

    @staticmethod
    def _check_X(X):
        if sp.issparse(X):
            X = sp.csr_matrix(X, dtype=np.float64)
            values = X.data
        else:
            X = np.asarray(X, dtype=np.float64)
            values = X
        if X.ndim != 2 or X.shape[0] == 0 or X.shape[1] == 0:
            raise ValueError(f"X must be a non-empty 2-D array, got shape {X.shape}")
        if not np.all(np.isfinite(values)):
            raise ValueError("X contains NaN or infinity")
        return X

    def _check_X_y(self, X, y):
        X = self._check_X(X)
        if y is None:
            raise ValueError("y is required when X is an array")
        y = np.asarray(y).ravel()
        if y.shape[0] != X.shape[0]:
            raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]} labels")
        if X.shape[1] < self.parties:
            raise ValueError(f"X has {X.shape[1]} features: cannot give each of {self.parties} parties one")
        return X, self._encode(y)

    def _encode(self, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _encode_from_files(self) -> None:
        """Party files hold labels already encoded for the problem (binary: −1/+1)."""


class VerticalLogisticRegression(ClassifierMixin, _VerticalEstimator):
    """Binary ℓ2-regularised logistic regression (the VFB² paper's problem (13)) over MPI parties."""

    _problem = "logistic"
    _task = "binary"

    def _encode(self, y):
        classes = np.unique(y)
        if classes.size != 2:
            raise ValueError(f"VerticalLogisticRegression is binary: y has {classes.size} classes")
        self.classes_ = classes
        return np.where(y == classes[1], 1.0, -1.0)

    def _encode_from_files(self) -> None:
        self.classes_ = np.array([-1.0, 1.0])

    def predict(self, X) -> np.ndarray:
        return self.classes_[(self.decision_function(X) >= 0).astype(int)]

    def predict_proba(self, X) -> np.ndarray:
        """``[n, 2]``: P(classes_[0] | x), P(classes_[1] | x) = 1 − σ(w·x), σ(w·x) (the logistic model the
        run fitted; scikit-learn's column order)."""
        positive = expit(self.decision_function(X))
        return np.column_stack([1.0 - positive, positive])

    def predict_log_proba(self, X) -> np.ndarray:
        """The log of :meth:`predict_proba`, computed without underflow for large scores."""
        z = self.decision_function(X)
        return np.column_stack([log_expit(-z), log_expit(z)])


class VerticalLinearRegression(RegressorMixin, _VerticalEstimator):
    """Least-squares regression (the paper's problem (17), ℓ2-regularised) over MPI parties."""

    _problem = "least-squares"
    _task = "regression"

    def _encode(self, y):
        y = np.asarray(y, dtype=np.float64)
        if not np.all(np.isfinite(y)):
            raise ValueError("y contains NaN or infinity")
        return y

    def predict(self, X) -> np.ndarray:
        return self.decision_function(X)


class VerticalMLPClassifier(ClassifierMixin, BaseEstimator):
    """A split neural network over vertically partitioned columns, trained by VFB²: each party's own
    MLP bottom, their sum (what the secure aggregation delivers), a top network and the loss at the
    active party, and every party stepping its bottom from the dispatched ϑ = ∂ℓ/∂z (``k`` per row).

    ``backend``: ``"simulate"`` (the default) plays the parties in one process
    (:func:`vertical.nn.simulate.simulate`: the asynchronous protocol step by step, with staleness
    bounded by ``max_staleness``) and starts no MPI job; ``"mpi"`` trains over real MPI parties, exactly
    as ``vfl train --model mlp`` (:mod:`vfl.mlp_runtime`: Adam in float32, ``max_staleness`` not used,
    the runtime's own asynchrony instead), and reads each party's trained network back.

    ``bottom`` is a spec string (``"*-64-16"``: the party's column count, hidden widths, the cut width
    k) or one per party; ``top`` runs from k to the logits (``"16-*"``; one width, e.g. ``"10"``, is an
    identity top). ``columns``: ``"random"`` (a seeded near-equal split, as the linear estimators),
    ``"contiguous"``, or one list of column indices per party. ``mode``: ``"async"`` (τ =
    ``max_staleness``) or ``"sync"`` (lock-step split learning).

    ``label_privacy="dp"`` clips each row's ϑ (jointly with the top's per-row gradient) to ``clip`` and
    adds Gaussian noise calibrated so that what a passive party receives over ``epochs`` passes is
    (``epsilon``, ``delta``)-label-DP (:mod:`vertical.nn.protection`; an identity top, e.g.
    ``top="1"``, needs no clip: its ϑ moves by exactly 1 or √2 with a label); ``epsilon_`` is the ε the
    accountant gives for the run. After ``fit``: ``bottoms_``, ``top_``, ``columns_``, ``classes_``,
    ``history_`` (per epoch: training loss, seconds). ``threads``: torch's intra-op threads while
    fitting and predicting (default 1: these layers are too small to gain from more, and on a busy
    machine threads that wait for each other cost far more than they give; None leaves torch's setting).
    """

    def __init__(self, *, parties: int = 4, bottom: str | list[str] = "*-64-16", top: str = "16-*",
                 columns: str | list = "random", optimizer: str = "adam", lr: float = 1e-3,
                 momentum: float = 0.0, batch_size: int = 64, epochs: int = 10, mode: str = "async",
                 max_staleness: int = 2, label_privacy: str = "none", epsilon: float | None = None,
                 delta: float = 1e-5, clip: float = 1.0, dtype: str = "float32", threads: int | None = 1,
                 seed: int = 0, verbose: bool = False, backend: str = "simulate") -> None:
        self.parties = parties
        self.bottom = bottom
        self.top = top
        self.columns = columns
        self.optimizer = optimizer
        self.lr = lr
        self.momentum = momentum
        self.batch_size = batch_size
        self.epochs = epochs
        self.mode = mode
        self.max_staleness = max_staleness
        self.label_privacy = label_privacy
        self.epsilon = epsilon
        self.delta = delta
        self.clip = clip
        self.dtype = dtype
        self.threads = threads
        self.seed = seed
        self.verbose = verbose
        self.backend = backend

    def _blocks(self, n_features: int) -> list[np.ndarray]:
        from vertical.partition import blocks_from_columns, contiguous_blocks, random_blocks

        if isinstance(self.columns, str):
            if self.columns == "random":
                return random_blocks(n_features, self.parties, seed=self.seed)
            if self.columns == "contiguous":
                return contiguous_blocks(n_features, self.parties)
            raise ValueError(f"columns must be 'random', 'contiguous' or one column list per party, "
                             f"got {self.columns!r}")
        blocks = blocks_from_columns(self.columns, n_features)
        if len(blocks) != self.parties:
            raise ValueError(f"columns lists {len(blocks)} parties, parties = {self.parties}")
        return blocks

    def _protection(self):
        from vertical.nn.protection import LabelProtection

        if self.label_privacy == "none":
            return None
        if self.label_privacy != "dp":
            raise ValueError(f"label_privacy must be 'none' or 'dp', got {self.label_privacy!r}")
        if self.epsilon is None:
            raise ValueError("label_privacy='dp' needs epsilon")
        return LabelProtection.calibrated(self.epsilon, self.delta, int(self.epochs), clip=self.clip,
                                          seed=np.random.default_rng([self.seed, 2]))

    def fit(self, X, y):
        """Train on ``(X, y)``: simulated VFB² in one process, or real MPI parties (``backend``)."""
        from vertical.nn.networks import OptimizerSpec, build_split_network, torch_threads
        from vertical.nn.simulate import simulate

        X = _VerticalEstimator._check_X(X)
        y = np.asarray(y).ravel()
        if y.shape[0] != X.shape[0]:
            raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]} labels")
        if int(self.epochs) != self.epochs or self.epochs < 1:
            raise ValueError(f"epochs must be a whole number >= 1, got {self.epochs}")
        self.classes_, labels = np.unique(y, return_inverse=True)
        if self.classes_.size < 2:
            raise ValueError(f"y has {self.classes_.size} class: a classifier needs at least 2")
        if X.shape[1] < self.parties:
            raise ValueError(f"X has {X.shape[1]} features: cannot give each of {self.parties} parties one")
        self.columns_ = self._blocks(X.shape[1])
        self.n_features_in_ = X.shape[1]
        if self.backend == "mpi":
            return self._fit_over_mpi(X, labels)
        if self.backend != "simulate":
            raise ValueError(f"backend must be 'simulate' or 'mpi', got {self.backend!r}")
        spec = OptimizerSpec(self.optimizer, self.lr, self.momentum)
        self.bottoms_, self.top_ = build_split_network(X, self.columns_, self.bottom, self.top,
                                                       self.classes_.size, optimizer=spec, seed=self.seed,
                                                       dtype=self.dtype)
        protection = self._protection()

        def report(epoch: int) -> dict:
            if self.verbose:
                print(f"[VerticalMLPClassifier] epoch {epoch}/{self.epochs}", flush=True)
            return {}

        with torch_threads(self.threads):
            result = simulate(self.bottoms_, self.top_, labels, epochs=int(self.epochs),
                              batch_size=self.batch_size, mode=self.mode, max_staleness=self.max_staleness,
                              seed=self.seed, protection=protection, evaluate=report)
        self.history_ = result.history
        self.noise_multiplier_ = None if protection is None else protection.noise_multiplier
        self.epsilon_ = None if protection is None else protection.epsilon(self.delta, int(self.epochs))
        return self

    def _fit_over_mpi(self, X, labels: np.ndarray):
        from vfl.mlp_runtime import fit_over_mpi, refusal

        if (why := refusal(self)) is not None:
            raise ValueError(why)
        with tempfile.TemporaryDirectory(prefix="vfl-mlp-fit-") as work:
            for name, value in fit_over_mpi(self, X, labels, self.columns_, Path(work)).items():
                setattr(self, name, value)
        return self

    def predict_proba(self, X) -> np.ndarray:
        """``[n, n_classes]`` class probabilities (scikit-learn's column order, ``classes_``)."""
        from vertical.nn.networks import torch_threads
        from vertical.nn.simulate import predict_proba

        check_is_fitted(self, "top_")
        X = _VerticalEstimator._check_X(X)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} features, the model was fitted with {self.n_features_in_}")
        with torch_threads(self.threads):
            return predict_proba(self.bottoms_, self.top_, [X[:, cols] for cols in self.columns_])

    def predict(self, X) -> np.ndarray:
        return self.classes_[self.predict_proba(X).argmax(axis=1)]

    def to_onnx(self, path) -> Path:
        """Write the fitted split network to ``path`` as ONNX (:mod:`vfl.onnx_export`; needs
        ``vfl[export]``)."""
        from vfl.onnx_export import mlp_to_onnx

        check_is_fitted(self, "top_")
        return mlp_to_onnx(self, path)
