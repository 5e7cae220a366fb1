"""Fixed-point ring encoding, CSPRNG masks, and the paper's real-valued masking."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy import stats

from protocols.masking import FixedPointRing, Keystream, PrecisionWarning, RealValued, as_real_vector


def _top_bits_uniform_pvalue(words: np.ndarray, bits: int = 4) -> float:
    counts = np.bincount((words >> np.uint64(64 - bits)).astype(np.int64), minlength=1 << bits)
    return float(stats.chisquare(counts).pvalue)


def test_ring_roundtrip_is_within_half_a_resolution_step() -> None:
    ring = FixedPointRing(fraction_bits=20)
    values = np.random.default_rng(0).normal(scale=1e3, size=10_000)
    words, bad = ring.encode(values, num_parties=4)
    assert bad == 0 and words.dtype == np.uint64
    decoded = ring.unmask(words, np.zeros_like(words))
    assert np.abs(decoded - values).max() <= ring.resolution / 2


def test_masks_cancel_exactly_through_wraparound() -> None:
    ring, keystream, q = FixedPointRing(), Keystream(), 6
    values = np.random.default_rng(1).normal(size=(q, 500))
    masked_total = np.zeros(500, np.uint64)
    mask_total = np.zeros(500, np.uint64)
    for row in values:
        words, _ = ring.encode(row, q)
        masks = keystream.words(500)
        ring.accumulate(words, masks)  # o + δ: wraps modulo 2**64 almost surely
        ring.accumulate(masked_total, words)
        ring.accumulate(mask_total, masks)
    encoded_sum = sum(ring.encode(row, q)[0].view(np.int64) for row in values)
    assert np.array_equal((masked_total - mask_total).view(np.int64), encoded_sum)
    assert np.abs(ring.unmask(masked_total, mask_total) - values.sum(axis=0)).max() <= q * ring.resolution / 2


def test_values_beyond_the_safe_range_or_not_finite_are_counted_not_wrapped() -> None:
    ring, q = FixedPointRing(fraction_bits=32), 8
    limit = ring.max_abs(q)
    assert limit == pytest.approx(2**62 / 2**32 / q)
    words, bad = ring.encode(np.array([limit, -limit, 1.01 * limit, np.nan, -np.inf, 1.0]), q)
    assert bad == 3
    assert np.array_equal(words[2:5], np.zeros(3, np.uint64))
    # q addends at the limit still sum without wrapping
    total = (words[0] * np.uint64(q)).view(np.int64)
    assert total > 0


def test_fraction_bits_are_validated() -> None:
    with pytest.raises(ValueError, match="fraction_bits"):
        FixedPointRing(fraction_bits=64)
    with pytest.raises(ValueError, match="scale"):
        RealValued(scale=0.0)


def test_keystream_words_are_fresh_and_uniform() -> None:
    first, second = Keystream(), Keystream()
    a, b, c = first.words(4096), first.words(4096), second.words(4096)
    assert len(np.unique(np.concatenate([a, b, c]))) == 3 * 4096
    assert _top_bits_uniform_pvalue(np.concatenate([a, b, c])) > 1e-4
    assert 0.45 < np.unpackbits(a.view(np.uint8)).mean() < 0.55


def test_buffered_small_draws_and_large_draws_never_repeat_a_word() -> None:
    keystream = Keystream()
    buffered = Keystream.BUFFER_WORDS
    draws = [keystream.words(1) for _ in range(3 * buffered // 2)]  # crosses a buffer refill
    draws += [keystream.words(buffered - 1), keystream.words(buffered), keystream.words(7)]  # skip; direct
    words = np.concatenate(draws)
    assert len(np.unique(words)) == words.size
    singles = np.concatenate(draws[:-3])
    assert _top_bits_uniform_pvalue(singles) > 1e-4
    assert 0.45 < np.unpackbits(singles.view(np.uint8)).mean() < 0.55


@pytest.mark.filterwarnings("ignore::protocols.masking.PrecisionWarning")  # 0.5 * step rounds to 0
@pytest.mark.parametrize("n", [1, 3, 8, 9, 20_000])
def test_share_is_the_encoding_plus_fresh_masks_on_every_code_path(n: int) -> None:
    """Up to 8 values take a scalar Python path, more go through numpy in chunks of 8192; all must
    produce the same words."""
    ring, keystream, q = FixedPointRing(fraction_bits=32), Keystream(), 4
    limit, step = ring.max_abs(q), ring.resolution
    awkward = [0.5 * step, 1.5 * step, -2.5 * step, limit, -limit, 1.01 * limit, np.nan, np.inf, -3.75, 1e5]
    values = np.resize(np.array(awkward), n)
    masked, masks = np.empty(n, np.uint64), np.empty(n, np.uint64)
    bad = ring.share(values, q, keystream, masked, masks)
    encoded, expected_bad = ring.encode(values, q)
    assert bad == expected_bad == int(np.count_nonzero(~(np.abs(values) <= limit)))
    assert np.array_equal(masked - masks, encoded)  # modulo 2**64
    # masks are fresh per call: the same values shared twice give unrelated words
    again_masked, again_masks = np.empty(n, np.uint64), np.empty(n, np.uint64)
    ring.share(values, q, keystream, again_masked, again_masks)
    assert not np.any(again_masks == masks) and not np.any(again_masked == masked)


@pytest.mark.parametrize("n", [1, 8, 9, 20_000])
def test_unmask_decodes_twos_complement_differences_on_every_code_path(n: int) -> None:
    ring = FixedPointRing(fraction_bits=20)
    rng = np.random.default_rng(n)
    masked = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    masks = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    extremes = np.array([0, 2**63, 2**64 - 1, 5], dtype=np.uint64)  # differences 0, -2**63, -1, 5 (mod 2**64)
    masked[:min(n, 4)] = extremes[:n]
    masks[:min(n, 4)] = 0
    expected = np.ldexp((masked - masks).view(np.int64).astype(np.float64), -20)
    decoded = ring.unmask(masked, masks)
    assert decoded.dtype == np.float64 and np.array_equal(decoded, expected)


def test_single_value_shares_of_a_constant_look_uniform() -> None:
    ring, keystream = FixedPointRing(), Keystream()
    value = np.array([12345.678])
    masked = np.empty((20_000, 1), np.uint64)
    masks = np.empty(1, np.uint64)
    for row in masked:
        ring.share(value, 3, keystream, row, masks)
    assert _top_bits_uniform_pvalue(masked.ravel()) > 1e-4


def test_masked_words_hide_a_constant_value() -> None:
    ring, keystream = FixedPointRing(), Keystream()
    words, _ = ring.encode(np.full(20_000, 12345.678), num_parties=3)
    ring.accumulate(words, keystream.words(words.size))
    assert _top_bits_uniform_pvalue(words) > 1e-4
    # without masks the same words are one constant: the test can tell
    plain, _ = ring.encode(np.full(20_000, 12345.678), num_parties=3)
    assert _top_bits_uniform_pvalue(plain) < 1e-12


def test_real_valued_masks_are_gaussian_with_the_chosen_scale_and_cancel_approximately() -> None:
    scheme, keystream = RealValued(scale=100.0), Keystream()
    masks = np.empty(50_001, np.uint64)
    scheme.draw_masks(keystream, masks)
    gaussian = masks.view(np.float64)
    assert abs(gaussian.std() - 100.0) < 2.0 and abs(gaussian.mean()) < 2.0
    assert stats.kstest(gaussian / 100.0, "norm").pvalue > 1e-4
    values = np.linspace(-5, 5, 50_001)
    words, bad = scheme.encode(values, num_parties=2)
    scheme.accumulate(words, masks)
    assert bad == 0
    assert np.abs(scheme.unmask(words, masks) - values).max() < 1e-12


# ------------------------------------------------------------------------- precision (hardening issue)


@pytest.mark.parametrize("q", range(2, 17))
def test_the_stated_error_bound_holds_including_the_final_float64_rounding(q: int) -> None:
    """|z - Σo| <= error_bound(q, |Σo|), measured against the exact (rational) sum, for values from the
    resolution up to the largest allowed. Large sums need the 2**-53 |Σo| term: q * resolution / 2 alone
    (the old bound) is exceeded there."""
    from fractions import Fraction

    ring, keystream, batch = FixedPointRing(), Keystream(), 400
    rng = np.random.default_rng(q)
    exponents = rng.uniform(np.log2(ring.resolution), np.log2(ring.max_abs(q)), size=(q, batch))
    values = rng.choice([-1.0, 1.0], size=(q, batch)) * 2.0**exponents
    total_masked, total_masks = np.zeros(batch, np.uint64), np.zeros(batch, np.uint64)
    for party in values:
        masked, masks = np.empty(batch, np.uint64), np.empty(batch, np.uint64)
        assert ring.share(party, q, keystream, masked, masks) == 0
        ring.accumulate(total_masked, masked)
        ring.accumulate(total_masks, masks)
    z = ring.unmask(total_masked, total_masks)
    exceeds_old_bound = 0
    for j in range(batch):
        exact = sum((Fraction(v) for v in values[:, j]), Fraction(0))
        error = abs(Fraction(z[j]) - exact)
        assert error <= Fraction(ring.error_bound(q, float(abs(exact)))) * (1 + Fraction(1, 10**9)), j
        exceeds_old_bound += error > Fraction(q * ring.resolution / 2)
    assert exceeds_old_bound > 0  # the final rounding is real, not a technicality


def test_the_error_bound_formula() -> None:
    ring = FixedPointRing(32)
    assert ring.error_bound(8, 0.0) == pytest.approx(8 * 2.0**-33 * (1 + 2.0**-53))
    assert ring.error_bound(8, 1e7) == pytest.approx(8 * 2.0**-33 + 1e7 * 2.0**-53)


def test_values_below_the_resolution_warn_instead_of_vanishing_silently() -> None:
    ring, keystream, q = FixedPointRing(32), Keystream(), 4
    for n in (3, 20):  # the scalar and the vectorised path
        values = np.full(n, 1e-12)
        values[0] = 0.0  # an exact zero is not an underflow
        masked, masks = np.empty(n, np.uint64), np.empty(n, np.uint64)
        with pytest.warns(PrecisionWarning, match=rf"^{n - 1} nonzero value\(s\) are smaller than half the "
                                                  rf"fixed-point resolution 2\*\*-32"):
            ring.share(values, q, keystream, masked, masks)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        ring.share(np.array([0.0, 1e-9, -0.0]), q, keystream, np.empty(3, np.uint64), np.empty(3, np.uint64))


def test_for_range_picks_the_finest_scale_that_holds_the_declared_range() -> None:
    ring = FixedPointRing.for_range(10.0, num_parties=8)
    assert ring.fraction_bits == 55
    assert ring.max_abs(8) >= 10.0 and FixedPointRing(ring.fraction_bits + 1).max_abs(8) < 10.0
    keystream = Keystream()
    values = np.array([1e-12, -3e-13, 10.0])
    masked, masks = np.empty(3, np.uint64), np.empty(3, np.uint64)
    assert ring.share(values, 8, keystream, masked, masks) == 0  # no warning: represented
    decoded = ring.unmask(masked, masks)
    assert np.all(np.abs(decoded - values) <= ring.resolution / 2)
    assert np.abs(decoded[:2] / values[:2] - 1).max() < 1e-3
    with pytest.raises(ValueError, match="positive finite"):
        FixedPointRing.for_range(np.inf, 4)


def test_complex_values_are_refused_not_truncated() -> None:
    with pytest.raises(TypeError, match=r"complex .* imaginary part"):
        as_real_vector(np.array([1.0 + 2.0j]))
    with pytest.raises(TypeError, match="real numbers"):
        as_real_vector(np.array(["1.0"]))
    assert as_real_vector([1, 2]).dtype == np.float64


@pytest.mark.parametrize("cipher", ["aes-128-ctr", "chacha20"])
def test_both_keystream_ciphers_give_fresh_uniform_words(cipher):
    from protocols.masking import Keystream

    a, b = Keystream(cipher), Keystream(cipher)
    words = a.words(1 << 16)
    assert not np.array_equal(words[:64], b.words(64))  # keyed from os.urandom, per party
    bits = np.unpackbits(words.view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.005
    assert np.unique(words).size == words.size
    small = [a.word() for _ in range(100)]
    assert len(set(small)) == 100 and not set(small) & set(words.tolist())
    with pytest.raises(ValueError, match="unknown keystream cipher"):
        Keystream("rc4")
