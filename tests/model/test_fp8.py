import math

import ml_dtypes
import numpy as np
import pytest
import torch

from qsa_lab.model import fp8

TORCH_DT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ML_DT = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
CODES = torch.arange(256, dtype=torch.uint8)


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_decode_matches_torch_and_ml_dtypes_on_all_codes(fmt):
    ours = fp8.decode(CODES, fmt)
    theirs_t = CODES.view(TORCH_DT[fmt]).float()
    theirs_m = torch.from_numpy(CODES.numpy().view(ML_DT[fmt]).astype(np.float32))
    for theirs in (theirs_t, theirs_m):
        assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
        fin = ~torch.isnan(ours)
        assert torch.equal(ours[fin], theirs[fin])
        # -0.0 keeps its sign
        assert torch.equal(torch.signbit(ours[fin]), torch.signbit(theirs[fin]))


def test_nan_codes_are_the_documented_ones():
    assert torch.nonzero(torch.isnan(fp8.decode(CODES, "e4m3"))).flatten().tolist() == [0x7F, 0xFF]
    assert torch.nonzero(torch.isnan(fp8.decode(CODES, "e5m2"))).flatten().tolist() == [0x7D, 0x7E, 0x7F,
                                                                                          0xFD, 0xFE, 0xFF]
    assert fp8.decode(torch.tensor([0x7E], dtype=torch.uint8), "e4m3").item() == 448.0


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_encode_roundtrips_every_finite_code(fmt):
    vals = fp8.decode(CODES, fmt)
    fin = torch.isfinite(vals)
    assert torch.equal(fp8.encode(vals[fin], fmt), CODES[fin])


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_encode_saturates_and_never_makes_nan(fmt):
    big = torch.tensor([1e6, -1e6, 3.4e38, -3.4e38, fp8.MAX_FINITE[fmt] * 1.2])
    codes = fp8.encode(big, fmt)
    assert not torch.isnan(fp8.decode(codes, fmt)).any()
    assert fp8.decode(codes, fmt).abs().eq(fp8.MAX_FINITE[fmt]).all()


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_encode_is_round_to_nearest_even_like_torch(fmt):
    gen = torch.Generator().manual_seed(1)
    lim = fp8.MAX_FINITE[fmt]
    x = torch.cat([torch.randn(20000, generator=gen) * s for s in (1e-3, 0.1, 1, 30, lim / 4)])
    x = x.clamp(-lim, lim)
    # midpoints between neighbouring codes exercise the tie rule
    pos = fp8.table(fmt)[: (0x7F if fmt == "e4m3" else 0x7C)]
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([x, mids, -mids])
    assert torch.equal(fp8.encode(x, fmt), x.to(TORCH_DT[fmt]).view(torch.uint8))


def test_code_table_and_rates():
    df = fp8.code_table("e4m3")
    assert len(df) == 256 and set(df[df.kind == "nan"].code) == {0x7F, 0xFF}
    assert fp8.nan_byte_fraction(CODES, "e4m3") == pytest.approx(2 / 256)
    vals = (torch.randn(200000, generator=torch.Generator().manual_seed(0))).half()
    rates = fp8.fp16_byte_nan_rates(vals)
    assert rates["high"] < 1e-3                      # high bytes of finite fp16 almost never 0x7F/0xFF
    assert abs(rates["low"] - 2 / 256) < 4 * math.sqrt(2 / 256 / 200000)
    with pytest.raises(ValueError, match="fmt"):
        fp8.decode(CODES, "e3m4")
    with pytest.raises(TypeError, match="uint8"):
        fp8.decode(CODES.int(), "e4m3")


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_fast_encode_equals_search_encode(fmt):
    """encode's torch-cast path gives encode_search's codes: every float16 and bfloat16 value,
    and every float32 rounding decision (each 16-bit prefix with the low bits that sit on and
    either side of a midpoint between codes), plus random float32 bit patterns."""
    assert fp8._cast_agrees(fmt)
    every16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dt in (torch.float16, torch.bfloat16):
        x = every16.view(dt)
        assert torch.equal(fp8.encode(x, fmt), fp8.encode_search(x, fmt)), dt
    prefix = torch.arange(65536, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 2, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF])
    pattern = (prefix.unsqueeze(1) | low).flatten()
    gen = torch.Generator().manual_seed(1)
    pattern = torch.cat([pattern, torch.randint(0, 1 << 32, (1 << 20,), generator=gen, dtype=torch.int64)])
    x = (pattern - ((pattern >> 31) << 32)).to(torch.int32).view(torch.float32)
    assert torch.equal(fp8.encode(x, fmt), fp8.encode_search(x, fmt))
    assert torch.equal(fp8.encode(fp8.rounding_boundaries(fmt), fmt), fp8.encode_search(fp8.rounding_boundaries(fmt), fmt))


def test_largest_finite_from_bits_equals_by_value():
    """validate_case's scale check reads the largest finite value from the bits (no decode):
    the same number as decoding and taking max |finite|, on every single code / fp16 value and
    on random arrays (with NaN, Inf, empty)."""
    from qsa_lab.model.case import _largest_finite

    def by_value(t):
        t = t.float().abs()
        t = t[torch.isfinite(t)]
        return float(t.max()) if t.numel() else 0.0

    every16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for fmt in fp8.FORMATS:
        for c in range(256):
            assert _largest_finite(CODES[c:c + 1], fmt) == by_value(fp8.decode(CODES[c:c + 1], fmt)), (fmt, c)
    assert all(_largest_finite(every16[i:i + 1], "fp16") == by_value(every16[i:i + 1]) for i in range(0, 65536, 7))
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(0, 40, (1,), generator=gen))
        codes = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64).to(torch.uint8)
        for fmt in fp8.FORMATS:
            assert _largest_finite(codes, fmt) == by_value(fp8.decode(codes, fmt))
        h = torch.randint(-32768, 32768, (n,), generator=gen, dtype=torch.int64).to(torch.int16).view(torch.float16)
        assert _largest_finite(h, "fp16") == by_value(h)
