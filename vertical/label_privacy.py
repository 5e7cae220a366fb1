"""ε-label differential privacy: randomized response on the labels (``--label-privacy dp``), and the
accountant of the Gaussian noise that ``--label-privacy he --epsilon`` adds to every ϑ it encrypts.

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


# --------------------------------------------------------------- Gaussian noise on ϑ, before encryption
#
# ``--label-privacy he --epsilon``: the dominator encrypts ϑ̃_i = ϑ_i + N(0, σ²) for every row of every
# batch (input perturbation), and every party, active ones included, steps with ϑ̃. Changing one label
# moves the logistic ϑ_i by exactly 1 (ϑ(z, +1) − ϑ(z, −1) = −σ(−z) − σ(z) = −1, for every z) and no
# other value of the batch, so each batch is the Gaussian mechanism with noise multiplier σ for its rows.
# For every other row it reveals nothing new, because the model it was computed at is built from
# earlier releases ϑ̃ only: that is why the active parties step with ϑ̃ too. Were the dominator's own
# block to step with the true ϑ, every later ϑ would depend on earlier labels through that block, and
# the releases would no longer compose per row.
#
# Why the noise is on ϑ and not on the decrypted batch gradients (the first version of this mode): a
# passive party chooses what it sends back for decryption, including the batch's own ciphertexts, or a
# combination that lifts ϑ far above any noise added after decryption. With the noise inside the
# ciphertexts, every value a passive party can get decrypted is a function of ϑ̃ and of its own
# choices: post-processing, so the guarantee holds whatever it sends. The accounting is unchanged: one
# release per row per pass, sensitivity 1 in units of ϑ where it was C in units of the gradient, the
# same σ per unit of sensitivity, so no row norm bounds enter it any more (nor can a party misstate one).
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
