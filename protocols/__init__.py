"""What crosses the wire: transports, secure aggregation, (ϑ, i) dispatch, compression codecs.

This package moves and masks numbers; it knows nothing of learning. The secure inner-product
aggregation (VFB² Algorithm 1) is usable on its own::

    from protocols import secure_inner_product
    z = secure_inner_product(comm, w_local, X_local, indices, root=0)   # collective; z at the root

See ``docs/secure-aggregation.md``. ``protocols.compression`` (horizontal FL codecs) needs torch
and is imported on its own.
"""

import importlib

#: each public name and the module that defines it: imported on first use (PEP 562), so a process that
#: needs only ``protocols.errors`` (a rank's exit path) does not load SciPy with the aggregation
_HOMES = {
    "AggregationNode": "protocols.aggregation",
    "ProtocolError": "protocols.errors", "ProtocolViolation": "protocols.errors",
    "AggregationOverflowError": "protocols.masking", "FixedPointRing": "protocols.masking",
    "PrecisionWarning": "protocols.masking", "RealValued": "protocols.masking",
    "SecureAggregator": "protocols.secure_aggregation",
    "secure_inner_product": "protocols.secure_aggregation", "secure_sum": "protocols.secure_aggregation",
    "InsecureTreePairError": "protocols.trees", "TreePair": "protocols.trees",
    "build_all_tree_pairs": "protocols.trees",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'protocols' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = [
    "AggregationNode",
    "AggregationOverflowError",
    "FixedPointRing",
    "InsecureTreePairError",
    "PrecisionWarning",
    "ProtocolError",
    "ProtocolViolation",
    "RealValued",
    "SecureAggregator",
    "TreePair",
    "build_all_tree_pairs",
    "secure_inner_product",
    "secure_sum",
]
