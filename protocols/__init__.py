"""What crosses the wire: transports, secure aggregation, (ϑ, i) dispatch, compression codecs.

This package moves and masks numbers; it knows nothing of learning. The secure inner-product
aggregation (VFB² Algorithm 1) is usable on its own::

    from protocols import secure_inner_product
    z = secure_inner_product(comm, w_local, X_local, indices, root=0)   # collective; z at the root

See ``docs/secure-aggregation.md``. ``protocols.compression`` (horizontal FL codecs) needs torch
and is imported on its own.
"""

from protocols.aggregation import AggregationNode
from protocols.errors import ProtocolError, ProtocolViolation
from protocols.masking import AggregationOverflowError, FixedPointRing, PrecisionWarning, RealValued
from protocols.secure_aggregation import SecureAggregator, secure_inner_product, secure_sum
from protocols.trees import InsecureTreePairError, TreePair, build_all_tree_pairs

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
