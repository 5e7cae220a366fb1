"""Label protection for vector ϑ: each row's ϑ clipped to norm C and Gaussian noise added, calibrated by
the RDP accountant of :mod:`vertical.label_privacy`.

What a passive party receives from a batch is ``ϑ̃_b = ϑ_b·min(1, C/‖ϑ_b‖) + N(0, s²I_k)`` per row, and
nothing else label-dependent. For that to be a Gaussian mechanism on the labels, everything ϑ is
computed from must itself depend on the labels only through such releases, or else a label would also
move every later ϑ through the model it trained. So in the protected mode:

* every bottom, the active party's own included, steps from ϑ̃, never from the clean ϑ;
* the top network steps by DP-SGD in the same release: each row's ∂ℓ_b/∂θ_top is clipped to norm
  ``C_top`` and the batch's sum of them gets Gaussian noise too.

One label moves its row's clipped ϑ by at most 2C and the top's clipped sum by at most 2C_top (two
vectors in a ball). Noise of std ``s = 2σC/√(1 − a)`` on ϑ and ``s_top = 2σC_top/√a`` on the top's
sum makes the joint release of a batch a Gaussian mechanism with noise multiplier σ, since
``(2C/s)² + (2C_top/s_top)² = 1/σ²``; ``a`` (``top_share``, default 0.1) is the top's part of that
budget. The top's noise lands on a sum over B rows and ϑ's on each row, so the top needs the smaller
part. A top without parameters leaves all of it to ϑ, and needs no clip at all: with the identity top,
ϑ_b = σ(z_b) − y_b (one logit) or p_b − e_{y_b} (softmax), where z_b comes from the earlier releases
alone, so one label moves its row's ϑ by exactly Δ = 1 or √2 (:func:`sensitivity_of_identity_top`),
less than the 2C a clip allows; ϑ is released unclipped with ``s = σΔ`` (where 2C < Δ, a small clip,
the clipped release stays the tighter one). With one logit that is half
the noise of ``2σC`` (C = 1) for the same ε: a passive party sees the same noise as before at about
half the ε (``experiments/results/README.md`` measures the attacks at each ε).
Batches are one permutation of the rows per pass, so a row is in exactly one release per
pass; a passive party knows which rows a batch holds (it needs them to step), so there is no
amplification by subsampling, and a row's loss is the composition over the passes: σ is what
:func:`~vertical.label_privacy.gaussian_noise_multiplier` gives for (ε, δ) and ``passes`` releases.
The model a passive party ends with is post-processing of what it received.

Not covered here (the runtime's business, phase 2): evaluation numbers and stop decisions, which the
leader computes from labels and broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vertical.label_privacy import gaussian_epsilon, gaussian_noise_multiplier


@dataclass
class LabelProtection:
    """Clip norms (C for each row's ϑ, ``top_clip`` for each row's top gradient), noise multiplier σ,
    the top's share of the budget and the noise's random generator (module docstring)."""

    clip: float
    noise_multiplier: float
    rng: np.random.Generator
    top_clip: float | None = None
    top_share: float = 0.1

    def __post_init__(self) -> None:
        if self.top_clip is None:
            self.top_clip = self.clip
        if not (np.isfinite(self.clip) and self.clip > 0 and np.isfinite(self.top_clip)
                and self.top_clip > 0):
            raise ValueError(f"the clip norms must be positive numbers, got {self.clip}, {self.top_clip}")
        if not (np.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"the noise multiplier must be a number >= 0, got {self.noise_multiplier}")
        if not 0 < self.top_share < 1:
            raise ValueError(f"top_share must lie in (0, 1), got {self.top_share}")

    @classmethod
    def calibrated(cls, epsilon: float, delta: float, passes: int, *, clip: float = 1.0,
                   top_clip: float | None = None, top_share: float = 0.1,
                   seed: int | np.random.Generator = 0) -> LabelProtection:
        """The protection that makes ``passes`` releases per row (ε, δ)-label-DP."""
        sigma = gaussian_noise_multiplier(epsilon, delta, passes)
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        return cls(clip=float(clip), noise_multiplier=sigma, rng=rng, top_clip=top_clip, top_share=top_share)

    def exact(self, sensitivity: float | None) -> float | None:
        """The top's exact sensitivity where it is the tighter bound (Δ ≤ 2C), else None: clip."""
        return sensitivity if sensitivity is not None and sensitivity <= 2.0 * self.clip else None

    def theta_std(self, top_has_parameters: bool, sensitivity: float | None = None) -> float:
        """Std of the noise on each coordinate of a row's ϑ: ``σ·Δ`` where the top states how far one
        label moves ϑ (the identity top, ``sensitivity``) and that beats the clip, else ``2σC`` over the
        ϑ's share of the budget."""
        if self.exact(sensitivity) is not None:
            return self.noise_multiplier * sensitivity
        share = 1.0 - self.top_share if top_has_parameters else 1.0
        return 2.0 * self.noise_multiplier * self.clip / np.sqrt(share)

    @property
    def top_std(self) -> float:
        """Std of the noise on each coordinate of the top's summed gradient."""
        return 2.0 * self.noise_multiplier * self.top_clip / np.sqrt(self.top_share)

    def epsilon(self, delta: float, passes: int) -> float:
        """ε at ``delta`` of ``passes`` releases per row at this noise multiplier."""
        return gaussian_epsilon(self.noise_multiplier, delta, passes)

    @staticmethod
    def scales(squared_norms: np.ndarray, bound: float) -> np.ndarray:
        """Per-row factors ``min(1, bound/‖v_b‖)`` from the rows' squared norms."""
        norms = np.sqrt(np.asarray(squared_norms, dtype=np.float64))
        scale = np.ones_like(norms)
        np.divide(bound, norms, out=scale, where=norms > bound)
        return scale

    def noise(self, shape, std: float) -> np.ndarray:
        return self.rng.normal(0.0, std, size=shape)

    def release(self, theta: np.ndarray, *, top_has_parameters: bool = False,
                sensitivity: float | None = None) -> np.ndarray:
        """ϑ̃: each row of ϑ clipped to C, plus noise; or, where the top gives ``sensitivity`` (the
        identity top, module docstring), ϑ unclipped plus noise of ``σ·sensitivity``."""
        theta = np.asarray(theta, dtype=np.float64)
        if self.exact(sensitivity) is None:
            theta = theta * self.scales(np.einsum("bk,bk->b", theta, theta), self.clip)[:, None]
        return theta + self.noise(theta.shape, self.theta_std(top_has_parameters, sensitivity))


@dataclass
class RowNoise:
    """``--theta-noise per-row``: one Gaussian draw per training row, added to every ϑ of that row for
    the whole run. Only for a top without parameters (the identity), where ϑ_i = p_i − e_{y_i} (softmax)
    or σ(z_i) − y_i (one logit), and p_i is computed from what the parties learnt from earlier releases.

    Why one draw is enough: each release of row i is (a function of the earlier releases) − e_{y_i} + n_i.
    A party that could compute that function, the worst case, learns from all of a run's releases of the
    row exactly one sample of −e_{y_i} + n_i: a single Gaussian mechanism of sensitivity
    ‖e_y − e_{y'}‖ = √2 (1 for one logit), so ε is that of one release, whatever the passes. Fresh noise
    every pass (:class:`LabelProtection`) has the same sensitivity but composes over the passes. The attacker
    ends with about the same either way (fresh noise averages over a row's passes, one draw does not):
    on a9a the direction attack's AUC is 0.569 at per-row ε = 2 and 0.563–0.580 at fresh ε = 2
    (experiments/results/README.md), and fresh noise cost less accuracy.

    A top with parameters breaks the argument: its Jacobian changes between releases, so the
    difference of two releases of a row would carry the label without noise. The launcher refuses that
    combination (``parties/config.py``).
    """

    table: np.ndarray  # (n_rows, k): the noise of each row, kept by the label holder alone
    std: float

    @classmethod
    def drawn(cls, n_rows: int, k: int, noise_multiplier: float, rng: np.random.Generator) -> RowNoise:
        std = noise_multiplier * sensitivity_of_identity_top(k)
        return cls(rng.normal(0.0, std, size=(n_rows, k)), std)

    def release(self, theta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """ϑ̃ of ``rows``: ϑ plus each row's own noise, unclipped (clipping would move a row's releases
        by label-dependent amounts)."""
        return np.asarray(theta, dtype=np.float64) + self.table[rows]


def sensitivity_of_identity_top(k: int) -> float:
    """How far one label moves a row's ϑ under an identity top: 1 with one logit (σ(z) − y, y ∈ {0, 1}),
    √2 with k softmax logits (p − e_y)."""
    return 1.0 if k == 1 else float(np.sqrt(2.0))
