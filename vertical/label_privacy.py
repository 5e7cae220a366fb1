"""ε-label differential privacy: randomized response on the labels (``--label-privacy dp``), and the
accountant of the Gaussian noise that ``--label-privacy he --epsilon`` adds to every batch gradient.

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


# ------------------------------------------------------------------ Gaussian noise on batch gradients
#
# ``--label-privacy he --epsilon``: every block's batch gradient X_Bᵀϑ_B gets N(0, (σC)²) noise per
# coordinate, where C bounds a full row's norm ‖x_i‖. Changing one label moves the logistic ϑ_i by
# exactly 1 (ϑ(z, +1) − ϑ(z, −1) = −σ(−z) − σ(z) = −1), so it moves the joint gradient by ‖x_i‖ ≤ C:
# each release is the Gaussian mechanism with noise multiplier σ for the rows of its batch. For every
# other row it reveals nothing new: the model it was computed at is itself built from earlier noisy
# releases (every party, active ones included, steps from the noisy gradient only).
#
# No amplification by subsampling: a passive party needs the row numbers of each batch to compute its
# block's gradient, so it knows which rows each release is about. A row's privacy loss is therefore the
# k-fold composition of the Gaussian mechanism over the k batches it is in, and the runtime draws the
# batches of each pass from one permutation of the rows (parties.runtime), so k is the number of passes.


def gaussian_epsilon(noise_multiplier: float, delta: float, releases: int) -> float:
    """ε at ``delta`` of ``releases`` Gaussian mechanisms of noise multiplier σ on one row's label (RDP
    accountant of Google's ``dp_accounting``, converted to (ε, δ))."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    if releases < 1:
        raise ValueError(f"releases must be at least 1, got {releases}")
    if not noise_multiplier > 0:
        raise ValueError(f"the noise multiplier must be positive, got {noise_multiplier}")
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), releases)
    return float(accountant.get_epsilon(delta))


def gaussian_noise_multiplier(epsilon: float, delta: float, releases: int) -> float:
    """The smallest noise multiplier σ (to 0.1 %) whose :func:`gaussian_epsilon` is at most ``epsilon``."""
    if not 0 < epsilon < math.inf:
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon}")
    low, high = 1e-3, 1.0
    while gaussian_epsilon(high, delta, releases) > epsilon:
        low, high = high, 2 * high
        if high > 1e8:
            raise ValueError(f"no noise multiplier below 1e8 reaches ε = {epsilon} at δ = {delta}")
    while high / low > 1.001:
        mid = math.sqrt(low * high)
        if gaussian_epsilon(mid, delta, releases) > epsilon:
            low = mid
        else:
            high = mid
    return high


# Row clipping (``--clip-quantile Q``): C is set by the largest row, so one outlier row sizes the noise
# of every release (D1's largest row has norm 105 against a median of 3.6). Each party may instead bound
# its block's rows at the Q-quantile of their norms, c_l, and compute its *gradients* from the rows
# scaled down to that norm, x_i^(l) · min(1, c_l / ‖x_i^(l)‖) (per-example clipping, as in DP-SGD, done
# per block because no party sees another's features). One label then moves the joint gradient by at
# most C = √(Σ_l c_l²). The forward pass, the model and predictions use the rows as they are; only the
# steps are biased, for the rows above their block's bound. The bounds come from features, not labels,
# so sharing them costs no label privacy.


def row_norm_bound(norms: np.ndarray, quantile: float = 1.0) -> float:
    """A block's row-norm bound c_l: the ``quantile`` of its rows' norms (an actual row's norm; 1 = the
    largest, no clipping)."""
    if not 0 < quantile <= 1:
        raise ValueError(f"the clipping quantile must lie in (0, 1], got {quantile}")
    norms = np.asarray(norms, dtype=np.float64)
    if norms.size == 0:
        return 0.0
    return float(np.quantile(norms, quantile, method="higher"))


def clip_scales(norms: np.ndarray, bound: float) -> np.ndarray:
    """Per-row factors min(1, bound / ‖x_i‖) that bring every row's norm to at most ``bound``."""
    norms = np.asarray(norms, dtype=np.float64)
    scale = np.ones_like(norms)
    np.divide(bound, norms, out=scale, where=norms > bound)
    return scale
