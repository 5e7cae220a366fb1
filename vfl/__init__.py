"""vfl: vertical federated learning (VFB²) on MPI, plus horizontal compressed FL.

This package is what a user calls: the ``vfl`` command line, the scikit-learn estimators and the plots
of a run folder. Layers, imports pointing down only (``tests/test_import_layers.py`` checks them):
``vfl`` → ``parties`` (processes) → ``vertical`` (the vertical learning core), ``horizontal`` (the
horizontal core) and ``protocols`` (the wire), which import none of each other. The estimators start
MPI jobs through ``parties``, imported only when they are used (``docs/design.md``).
"""

__version__ = "0.1.0"

_ESTIMATORS = ("VerticalLogisticRegression", "VerticalLinearRegression", "VerticalMLPClassifier")
__all__ = list(_ESTIMATORS)


def __getattr__(name: str):
    """``from vfl import VerticalLogisticRegression`` without importing scikit-learn at ``import vfl``."""
    if name in _ESTIMATORS:
        from vfl import estimator

        return getattr(estimator, name)
    raise AttributeError(f"module 'vfl' has no attribute {name!r}")
