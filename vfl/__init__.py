"""vfl: vertical federated learning (VFB²) on MPI, plus horizontal compressed FL.

Layers (imports point down only): ``experiments`` → ``parties`` → ``protocols`` → ``vfl``.
``vfl`` is the learning core and knows nothing of MPI; the estimators below start MPI jobs through
``parties``, imported only when they are used (see ``README.md``, "Design").
"""

__version__ = "0.1.0"

_ESTIMATORS = ("VerticalLogisticRegression", "VerticalLinearRegression")
__all__ = list(_ESTIMATORS)


def __getattr__(name: str):
    """``from vfl import VerticalLogisticRegression`` without importing scikit-learn at ``import vfl``."""
    if name in _ESTIMATORS:
        from vfl import estimator

        return getattr(estimator, name)
    raise AttributeError(f"module 'vfl' has no attribute {name!r}")
