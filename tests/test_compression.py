"""Compression codecs: wire formats, the properties the theory assumes (Monte Carlo), batching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protocols.compression import COMPRESSORS, Compressor, Payload, get_compressor
from protocols.compression.base import HEADER_NBYTES
from protocols.compression.packing import field_nbytes, index_width, pack_uint_rows, unpack_uint_rows

FLOAT_BYTES = {torch.float32: 4, torch.float64: 8}


def generators(count: int, offset: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(offset + i) for i in range(count)]


def all_compressors(d: int) -> dict[str, Compressor]:
    """One instance of every codec, configured for vectors of length d."""
    return {
        "identity": get_compressor("identity"),
        "rand-k": get_compressor("rand-k", fraction=0.1),
        "top-r": get_compressor("top-r", r=0.05),
        "dithering-2": get_compressor("dithering", bits=2),
        "dithering-levels-3": get_compressor("dithering", levels=3),
        "sign": get_compressor("sign"),
        "scaled-sign": get_compressor("scaled-sign"),
        "grouped-sign": get_compressor("grouped-sign", groups=[d // 3, d - d // 3] if d >= 3 else [d]),
        "scaled-unbiased": get_compressor("scaled-unbiased", inner=get_compressor("dithering", bits=2)),
    }


def draws(compressor: Compressor, x: torch.Tensor, count: int, offset: int = 0) -> torch.Tensor:
    """``count`` independent compressions of x (one generator each), as rows."""
    X_hat, _ = compressor.roundtrip_batch(x.expand(count, -1), generators(count, offset))
    return X_hat


def assert_unbiased(samples: torch.Tensor, x: torch.Tensor, z_max: float = 5.0) -> None:
    """Every coordinate's sample mean lies within z_max standard errors of x.

    A coordinate that almost never rounds up has a sample standard error near 0, so the error is
    floored at a tenth of the average one: that still flags any bias of the size of a level.
    """
    mean = samples.mean(dim=0)
    standard_error = samples.std(dim=0) / math.sqrt(samples.shape[0])
    z = (mean - x).abs() / standard_error.clamp(min=0.1 * float(standard_error.mean()))
    assert z.max() < z_max, f"max z-score {z.max():.1f}"


# --- registry and validation ---------------------------------------------------------------------

def test_registry_names_and_unknown_name_lists_them() -> None:
    assert set(COMPRESSORS) >= {"identity", "rand-k", "top-r", "dithering", "sign", "scaled-sign",
                                "grouped-sign", "scaled-unbiased"}
    with pytest.raises(ValueError, match="top-r"):
        get_compressor("top-k")


@pytest.mark.parametrize(("name", "params"), [
    ("top-r", {"r": 0.0}), ("top-r", {"r": 1.5}), ("top-r", {"r": float("nan")}), ("top-r", {}),
    ("dithering", {"bits": 0}), ("dithering", {"bits": 2.5}), ("dithering", {"bits": 2, "levels": 4}),
    ("dithering", {"levels": 0}), ("rand-k", {"k": 0}), ("rand-k", {"fraction": 1.2}), ("rand-k", {}),
    ("grouped-sign", {"groups": []}), ("grouped-sign", {"groups": [3, 0]}), ("identity", {"r": 0.1}),
    ("scaled-unbiased", {"inner": get_compressor("top-r", r=0.1)}),
    ("scaled-unbiased", {"inner": get_compressor("dithering", bits=2), "omega": -1.0}),
])
def test_bad_parameters_are_clear_value_errors(name: str, params: dict) -> None:
    with pytest.raises(ValueError):
        get_compressor(name, **params)


@pytest.mark.parametrize("bad", [
    torch.zeros(2, 3), torch.zeros(()), torch.zeros(0), torch.arange(5),
    torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("inf")]), [1.0, 2.0],
])
def test_bad_inputs_are_clear_value_errors(bad: object) -> None:
    with pytest.raises(ValueError):
        get_compressor("top-r", r=0.5).compress(bad, torch.Generator())  # type: ignore[arg-type]


def test_size_dependent_parameters_are_checked_against_d() -> None:
    x = torch.randn(10)
    with pytest.raises(ValueError, match="k = 11"):
        get_compressor("rand-k", k=11).compress(x, torch.Generator())
    with pytest.raises(ValueError, match="cover 9"):
        get_compressor("grouped-sign", groups=[4, 5]).compress(x)
    with pytest.raises(ValueError, match="Generator"):
        get_compressor("dithering", bits=2).compress(x)
    with pytest.raises(ValueError, match="one generator per row"):
        get_compressor("dithering", bits=2).roundtrip_batch(torch.randn(3, 10), generators(2))


def test_foreign_or_corrupt_payloads_are_rejected() -> None:
    x = torch.randn(100)
    top = get_compressor("top-r", r=0.1)
    payload = top.compress(x)
    with pytest.raises(ValueError, match="codec id"):
        get_compressor("sign").decompress(payload)
    with pytest.raises(ValueError, match="expects"):
        get_compressor("top-r", r=0.2).decompress(payload)  # a differently configured receiver
    with pytest.raises(ValueError, match="expects"):
        top.decompress(Payload(payload.data[:-1]))
    with pytest.raises(ValueError, match="header"):
        top.decompress(Payload(b"\x02"))


def test_theory_constants() -> None:
    d = 235_146
    assert get_compressor("top-r", r=0.01).q2(d) == pytest.approx(1 - 2351 / d)
    assert get_compressor("top-r", r=0.29).q2(100) == pytest.approx(0.71)  # ⌊0.29·100⌋ = 29, not 28
    assert get_compressor("dithering", bits=2).omega(d) == pytest.approx(math.sqrt(d) / 4)  # 121.2
    assert get_compressor("dithering", bits=4).omega(d) == pytest.approx(math.sqrt(d) / 16)  # 30.3
    assert get_compressor("dithering", bits=4).omega(100) == pytest.approx(100 / 256)
    assert get_compressor("rand-k", k=10).omega(1000) == pytest.approx(99.0)
    assert get_compressor("scaled-sign").q2(d) == pytest.approx(1 - 1 / d)
    assert get_compressor("grouped-sign", groups=[3, 7]).q2(10) == pytest.approx(1 - 1 / 7)
    assert get_compressor("identity").omega(d) == 0.0
    scaled = get_compressor("scaled-unbiased", inner=get_compressor("dithering", bits=2))
    assert scaled.q2(d) == pytest.approx(121.23 / 122.23, rel=1e-3)
    assert not scaled.unbiased and scaled.contractive
    with pytest.raises(ValueError, match="biased"):
        get_compressor("top-r", r=0.1).omega(d)
    with pytest.raises(ValueError, match="ScaledUnbiased"):
        get_compressor("dithering", bits=2).q2(d)
    with pytest.raises(ValueError, match="not contractive"):
        get_compressor("sign").q2(d)


# --- round trips, formats and sizes --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [1, 7, 300])
def test_round_trip_shape_dtype_and_bit_count(dtype: torch.dtype, d: int) -> None:
    x = torch.randn(d, dtype=dtype)
    for name, compressor in all_compressors(d).items():
        payload = compressor.compress(x, torch.Generator().manual_seed(1))
        assert isinstance(payload.data, bytes) and payload.nbits == 8 * len(payload.data)
        x_hat = compressor.decompress(payload)
        assert x_hat.shape == x.shape and x_hat.dtype == dtype, name
        assert torch.isfinite(x_hat).all(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_vector_gives_zero_without_nan(dtype: torch.dtype) -> None:
    x = torch.zeros(50, dtype=dtype)
    for name, compressor in all_compressors(50).items():
        x_hat = compressor.decompress(compressor.compress(x, torch.Generator()))
        expected = torch.ones_like(x) if name == "sign" else x  # plain sign sends sign(0) as +1
        assert torch.equal(x_hat, expected), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identity_is_lossless_and_costs_the_raw_floats(dtype: torch.dtype) -> None:
    x = torch.randn(123, dtype=dtype)
    identity = get_compressor("identity")
    payload = identity.compress(x)
    assert torch.equal(identity.decompress(payload), x)
    assert len(payload.data) == HEADER_NBYTES + 123 * FLOAT_BYTES[dtype]


def test_top_r_keeps_exactly_the_largest_magnitudes_unscaled() -> None:
    top = get_compressor("top-r", r=0.05)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2000, generator=g) * torch.rand(2000, generator=g) ** 4  # heavy-tailed
        x_hat = top.decompress(top.compress(x))
        kept = x_hat != 0
        assert int(kept.sum()) == 100
        assert torch.equal(x_hat[kept], x[kept])
        assert x[kept].abs().min() >= x[~kept].abs().max()
        assert (x_hat - x).pow(2).sum() <= top.q2(2000) * x.pow(2).sum()


def test_top_r_breaks_ties_towards_the_lowest_index() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -3.0, 3.0, 0.5, 3.0])
    x_hat = get_compressor("top-r", r=0.375).decompress(get_compressor("top-r", r=0.375).compress(x))
    assert torch.equal(x_hat, torch.tensor([0.0, -3.0, 0.0, 3.0, -3.0, 0.0, 0.0, 0.0]))
    ones = torch.ones(100_000)  # all tied: the sampled threshold passes everything, first k kept
    x_hat = get_compressor("top-r", r=0.01).decompress(get_compressor("top-r", r=0.01).compress(ones))
    assert torch.equal(x_hat.nonzero().flatten(), torch.arange(1000))
    levels = torch.randint(-3, 4, (50_000,), generator=torch.Generator().manual_seed(0)).float()
    x_hat = get_compressor("top-r", r=0.01).decompress(get_compressor("top-r", r=0.01).compress(levels))
    assert torch.equal(x_hat.nonzero().flatten(), (levels.abs() == 3).nonzero().flatten()[:500])


def test_top_r_threshold_sampling_falls_back_when_the_sample_misleads() -> None:
    # The strided sample sees only zeros; the large entries sit between sample points.
    d, top = 200_000, get_compressor("top-r", r=0.001)
    x = torch.zeros(d)
    x[1::48] = torch.linspace(1.0, 2.0, len(range(1, d, 48)))
    x_hat = top.decompress(top.compress(x))
    kept = x_hat.nonzero().flatten()
    assert len(kept) == 200 and x[kept].min() >= x[x_hat == 0].max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_payload_sizes_follow_the_format(dtype: torch.dtype) -> None:
    d, x = 5000, torch.randn(5000, dtype=dtype)
    top = get_compressor("top-r", r=0.01)
    assert len(top.compress(x).data) == HEADER_NBYTES + field_nbytes(50, 13) + 50 * FLOAT_BYTES[dtype]
    rand = get_compressor("rand-k", k=64)
    assert len(rand.compress(x, torch.Generator()).data) == (HEADER_NBYTES + field_nbytes(64, 13)
                                                              + 64 * FLOAT_BYTES[dtype])
    assert index_width(d) == 13 and index_width(235_146) == 18 and index_width(1) == 1


def test_integer_fields_are_packed_least_significant_bit_first_and_round_trip() -> None:
    rng = np.random.default_rng(0)
    cases = [(width, count) for width in range(1, 33) for count in (1, 7, 63, 64, 65, 300)]
    cases += [(1, 70_001), (18, 70_001), (32, 70_001)]  # longer than the packer's cached bit layout
    for width, count in cases:  # counts around the 64-bit word boundaries of the packer
        values = rng.integers(0, 2**width, size=(3, count))
        packed = pack_uint_rows(values, width)
        bits = (values[:, :, None] >> np.arange(width)) & 1  # value i's bit j is bit i·width + j
        expected = np.packbits(bits.reshape(3, -1).astype(np.uint8), axis=1, bitorder="little")
        assert np.array_equal(packed, expected), (width, count)
        assert np.array_equal(unpack_uint_rows(packed, count, width), values), (width, count)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_dithering_payload_is_the_smaller_of_dense_and_sparse(bits: int) -> None:
    dithering = get_compressor("dithering", bits=bits)
    for d in (200, 20_000):  # dense wins for the small d at 4 bits, sparse for the large d
        x = torch.randn(d)
        payload = dithering.compress(x, torch.Generator().manual_seed(d))
        nnz = int(dithering.decompress(payload).count_nonzero())
        dense = field_nbytes(d, 1) + field_nbytes(d, bits + 1)
        sparse = 4 + field_nbytes(nnz, index_width(d)) + field_nbytes(nnz, 1) + field_nbytes(nnz, bits)
        assert len(payload.data) == HEADER_NBYTES + 4 + min(dense, sparse)


def test_sign_payload_sizes() -> None:
    x = torch.randn(1001)
    assert len(get_compressor("sign").compress(x).data) == HEADER_NBYTES + 126
    assert len(get_compressor("scaled-sign").compress(x).data) == HEADER_NBYTES + 4 + 126
    grouped = get_compressor("grouped-sign", groups=[1, 500, 500])
    assert len(grouped.compress(x.double()).data) == HEADER_NBYTES + 3 * 8 + 126


def test_messages_at_the_papers_size_are_much_smaller_than_raw_floats() -> None:
    d = 235_146
    x = torch.randn(d) * torch.rand(d)
    raw_bits = 32 * d
    top = get_compressor("top-r", r=0.01).compress(x)
    assert top.nbits == 8 * (HEADER_NBYTES + field_nbytes(2351, 18) + 4 * 2351)  # ≈ 64× smaller
    dithered = get_compressor("dithering", bits=2).compress(x, torch.Generator())
    assert dithered.nbits < raw_bits / 100
    assert get_compressor("scaled-sign").compress(x).nbits < raw_bits / 31


def test_grouped_sign_matches_its_contraction_identity() -> None:
    sizes = [10, 200, 37, 1]
    grouped = get_compressor("grouped-sign", groups=sizes)
    for seed in range(5):
        x = torch.randn(sum(sizes), dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        x[::7] = 0.0
        x_hat = grouped.decompress(grouped.compress(x))
        error = (x_hat - x).pow(2).sum()
        blocks = torch.split(x, sizes)
        assert error == pytest.approx(x.pow(2).sum() - sum(b.abs().sum() ** 2 / len(b) for b in blocks))
        assert error <= grouped.q2(len(x)) * x.pow(2).sum()
        for block, block_hat in zip(blocks, torch.split(x_hat, sizes), strict=True):
            assert torch.allclose(block_hat.abs(), block.abs().mean().expand_as(block))


def test_plain_and_scaled_sign_values() -> None:
    x = torch.tensor([0.5, -2.0, 0.0, 1.5])
    assert torch.equal(get_compressor("sign").decompress(get_compressor("sign").compress(x)),
                       torch.tensor([1.0, -1.0, 1.0, 1.0]))
    scaled = get_compressor("scaled-sign")
    assert torch.equal(scaled.decompress(scaled.compress(x)), torch.tensor([1.0, -1.0, 1.0, 1.0]))


# --- the properties the theory assumes (Monte Carlo) ---------------------------------------------

@pytest.mark.parametrize(("params", "expected_ratio"), [
    ({"bits": 1}, 11.7), ({"bits": 2}, 5.36), ({"bits": 4}, 0.65), ({"levels": 3}, None),
])
def test_dithering_is_unbiased_with_variance_under_omega(params: dict, expected_ratio: float | None) -> None:
    d, count = 1000, 2000
    dithering = get_compressor("dithering", **params)
    x = torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    samples = draws(dithering, x, count)
    assert_unbiased(samples, x)
    ratio = float((samples - x).pow(2).sum(dim=1).mean() / x.pow(2).sum())
    assert ratio <= dithering.omega(d)
    if expected_ratio is not None:  # an independent reference run: d = 1000, Gaussian x
        assert ratio == pytest.approx(expected_ratio, rel=0.1)


def test_dithering_output_lies_on_the_level_grid_and_keeps_signs() -> None:
    x = torch.randn(500, dtype=torch.float64)
    samples = draws(get_compressor("dithering", bits=2), x, 20)
    levels = samples / (x.norm() / 4)
    assert torch.allclose(levels, levels.round(), atol=1e-9) and levels.abs().max() <= 4
    assert (samples * x >= 0).all()


def test_float32_dithering_is_unbiased() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(3))
    assert_unbiased(draws(get_compressor("dithering", bits=4), x, 4000), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dithering_rounds_up_with_probabilities_finer_than_its_random_byte(dtype: torch.dtype) -> None:
    # Each entry's uniform is a random byte plus low bits drawn only where the byte leaves the outcome
    # open: rounding probabilities far below 1/256 and within 1/1024 of 1 must still come out right.
    dithering = get_compressor("dithering", bits=2)  # s = 4 and ‖x‖ = 4: u_k = |x_k|
    tiny, n_tiny = 2.0**-12, 50_000
    x = torch.full((n_tiny + 1,), tiny, dtype=torch.float64)
    x[0] = math.sqrt(16 - n_tiny * tiny**2)
    round_ups = int((draws(dithering, x.to(dtype), 40)[:, 1:] != 0).sum())
    expected = 40 * n_tiny * tiny  # 488; a byte-only draw would give 0
    assert abs(round_ups - expected) < 5 * math.sqrt(expected)
    dithering = get_compressor("dithering", bits=4)  # s = 16 and ‖x‖ = 16: u_k = |x_k|
    near_one, n_near = 1 - 2.0**-10, 200
    x = torch.full((n_near + 1,), near_one, dtype=torch.float64)
    x[0] = math.sqrt(256 - n_near * near_one**2)
    stay_down = int((draws(dithering, x.to(dtype), 1000)[:, 1:] == 0).sum())
    expected = 1000 * n_near * 2.0**-10  # 195; a byte-only draw would give 4x as many
    assert abs(stay_down - expected) < 5 * math.sqrt(expected)


def test_rand_k_is_unbiased_with_exact_variance() -> None:
    d, k, count = 200, 20, 6000
    rand = get_compressor("rand-k", k=k)
    x = torch.randn(d, dtype=torch.float64)
    samples = draws(rand, x, count)
    assert ((samples != 0).sum(dim=1) == k).all()
    assert_unbiased(samples, x)
    ratio = float((samples - x).pow(2).sum(dim=1).mean() / x.pow(2).sum())
    assert ratio == pytest.approx(rand.omega(d), rel=0.05)


def test_rand_k_with_most_entries_kept_uses_uniform_subsets() -> None:
    rand = get_compressor("rand-k", fraction=0.75)
    x = torch.randn(40, dtype=torch.float64)
    samples = draws(rand, x, 4000)
    inclusion = (samples != 0).double().mean(dim=0)
    assert torch.allclose(inclusion, torch.full((40,), 0.75, dtype=torch.float64), atol=0.04)
    assert_unbiased(samples, x)


def test_biased_compressors_fail_the_unbiasedness_check() -> None:
    x = torch.randn(100, dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_unbiased(draws(get_compressor("top-r", r=0.1), x, 50) + 1e-3 * torch.randn(50, 100), x)


def test_scaled_unbiased_is_contractive_and_scales_the_inner_output() -> None:
    d, count = 1000, 1000
    inner = get_compressor("dithering", bits=2)
    scaled = get_compressor("scaled-unbiased", inner=inner)
    x = torch.randn(d, dtype=torch.float64)
    samples = draws(scaled, x, count)
    assert torch.allclose(samples, draws(inner, x, count) / (1 + inner.omega(d)))
    assert float((samples - x).pow(2).sum(dim=1).mean()) <= scaled.q2(d) * float(x.pow(2).sum())
    custom = get_compressor("scaled-unbiased", inner=inner, omega=1.0)
    assert custom.q2(d) == 0.5
    assert torch.allclose(draws(custom, x, 3), draws(inner, x, 3) / 2)


# --- batching, randomness and independence --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_roundtrip_batch_equals_row_by_row_and_consumes_the_same_randomness(dtype: torch.dtype) -> None:
    S, d = 6, 3001
    X = torch.randn(S, d, dtype=dtype) * torch.rand(S, 1, dtype=dtype)
    X[2] = 0.0
    for name, compressor in all_compressors(d).items():
        batch_generators, row_generators = generators(S, 10), generators(S, 10)
        X_hat, nbits = compressor.roundtrip_batch(X, batch_generators)
        payloads = [compressor.compress(X[s], row_generators[s]) for s in range(S)]
        assert torch.equal(X_hat, torch.stack([compressor.decompress(p) for p in payloads])), name
        assert nbits == [p.nbits for p in payloads], name
        for batch_g, row_g in zip(batch_generators, row_generators, strict=True):
            assert torch.equal(torch.rand(3, generator=batch_g), torch.rand(3, generator=row_g)), name


def test_same_seed_reproduces_and_other_seeds_are_independent() -> None:
    d, count = 400, 3000
    dithering = get_compressor("dithering", bits=2)
    x = torch.randn(d, dtype=torch.float64)
    first = dithering.compress(x, torch.Generator().manual_seed(5))
    assert first.data == dithering.compress(x, torch.Generator().manual_seed(5)).data
    errors_a = draws(dithering, x, count, offset=0) - x
    errors_b = draws(dithering, x, count, offset=count) - x  # other clients' streams
    correlation = (errors_a * errors_b).sum(dim=1) / (errors_a.norm(dim=1) * errors_b.norm(dim=1))
    assert abs(float(correlation.mean())) < 4 / math.sqrt(count)
    same_stream = (errors_a * errors_a).sum(dim=1) / errors_a.norm(dim=1) ** 2
    assert float(same_stream.mean()) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["dithering-2", "rand-k"])
def test_scale_equivariance_under_the_same_draws(name: str) -> None:
    d = 2000
    compressor = all_compressors(d)[name]
    x = torch.randn(d, dtype=torch.float64)
    base = compressor.decompress(compressor.compress(x, torch.Generator().manual_seed(3)))
    for beta in (0.25, 8.0):  # powers of two: bit-exact
        scaled = compressor.decompress(compressor.compress(beta * x, torch.Generator().manual_seed(3)))
        assert torch.equal(scaled, beta * base)
    scaled = compressor.decompress(compressor.compress(3.7 * x, torch.Generator().manual_seed(3)))
    assert torch.allclose(scaled, 3.7 * base, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("dtype", "values"), [
    (torch.float32, (3.0, -0.1, 7e-30, -1e30, 1e-44)), (torch.float64, (1e-300, -1e300, 0.3)),
])
def test_dithering_of_a_one_hot_vector_is_exact_even_where_squares_under_or_overflow(
        dtype: torch.dtype, values: tuple[float, ...]) -> None:
    dithering = get_compressor("dithering", bits=2)
    for value in values:
        x = torch.zeros(64, dtype=dtype)
        x[5] = value
        assert torch.equal(dithering.decompress(dithering.compress(x, torch.Generator())), x), value


def test_dithering_of_tiny_vectors_is_unbiased_and_rejects_unsendable_norms() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(4)) * 1e-30  # float32 squares underflow
    assert_unbiased(draws(get_compressor("dithering", bits=2), x, 2000), x)
    with pytest.raises(ValueError, match="range"):
        get_compressor("dithering", bits=2).compress(torch.full((4,), 3e38), torch.Generator())
