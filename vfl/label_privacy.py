"""ε-label differential privacy by randomized response on the training labels.

Why randomized response: in VFB² every label-dependent number another party sees (ϑ on each update,
the full ϑ vectors, the stop decisions) is computed from the labels the active party trains with. If
those labels are a randomized response of the true ones, everything that follows is post-processing,
so the whole run is ε-label-DP (Ghazi et al., "Deep learning with label differential privacy", 2021,
give this baseline). For binary labels, keeping each label with probability e^ε / (1 + e^ε) and
flipping it otherwise is ε-DP per label, and it is the optimal mechanism for that (Warner's, as
analysed by Kairouz et al. 2016); no accountant is needed because the mechanism is applied once.

What it costs: the model learns from noisy labels. For symmetric noise the Bayes classifier is
unchanged (flipping with rate ρ < 1/2 keeps sign(P(y=1|x) − 1/2)), so accuracy degrades gracefully,
but the loss and the probabilities are those of the noisy problem.

Regression targets would need a different mechanism (e.g. Laplace noise on clipped targets); binary
classification only for now.
"""

from __future__ import annotations

import math

import numpy as np


def flip_probability(epsilon: float) -> float:
    """Probability that randomized response flips a binary label: 1 / (1 + e^ε)."""
    if not epsilon > 0 or math.isinf(epsilon):
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon}")
    return 1.0 / (1.0 + math.exp(epsilon))


def randomized_response(y: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """Labels in {−1, +1}, each flipped independently with probability 1 / (1 + e^ε)."""
    y = np.asarray(y, dtype=np.float64)
    if not np.all(np.isin(y, (-1.0, 1.0))):
        raise ValueError("randomized response needs binary labels in {-1, +1}")
    flip = rng.random(y.size) < flip_probability(epsilon)
    return np.where(flip, -y, y)
