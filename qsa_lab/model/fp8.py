"""FP8 codecs (E4M3 "fn" and E5M2), bit-exact, in plain torch ops.

decode(codes, fmt) -> float32, encode(x, fmt) -> uint8 (round to nearest even,
saturating to the largest finite value, so a finite value never becomes NaN).
The 256-code tables are built once by decoding the bit fields and every other
function reads them, so there is one definition of each format.
"""
from __future__ import annotations

import functools
import math

import torch

FORMATS = ("e4m3", "e5m2")

# (exponent bits, mantissa bits, exponent bias)
_LAYOUT = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}

#: codes that decode to NaN. E4M3fn has no infinities: only S.1111.111 is NaN.
NAN_CODES = {"e4m3": (0x7F, 0xFF), "e5m2": (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)}
INF_CODES = {"e4m3": (), "e5m2": (0x7C, 0xFC)}
MAX_FINITE = {"e4m3": 448.0, "e5m2": 57344.0}


def check_format(fmt: str, name: str = "fmt") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"{name} must be one of {FORMATS}, got {fmt!r}")
    return fmt


def _decode_code(code: int, fmt: str) -> float:
    ebits, mbits, bias = _LAYOUT[fmt]
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> mbits) & ((1 << ebits) - 1)
    man = code & ((1 << mbits) - 1)
    if (code & 0x7F) in [c & 0x7F for c in NAN_CODES[fmt]]:
        return math.nan
    if (code & 0x7F) in [c & 0x7F for c in INF_CODES[fmt]]:
        return sign * math.inf
    if exp == 0:  # subnormal
        return sign * man * 2.0 ** (1 - bias - mbits)
    return sign * (1 + man / (1 << mbits)) * 2.0 ** (exp - bias)


_TABLES = {f: torch.tensor([_decode_code(c, f) for c in range(256)], dtype=torch.float32) for f in FORMATS}


def table(fmt: str) -> torch.Tensor:
    """[256] float32: the value of every code (a copy)."""
    return _TABLES[check_format(fmt)].clone()


def decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """codes: uint8 tensor of any shape -> float32 tensor of the same shape."""
    check_format(fmt)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    lut = _TABLES[fmt].to(codes.device)
    return lut.index_select(0, codes.int().reshape(-1)).view(codes.shape)  # int32 indices: half the bytes of int64


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round x (any float tensor) to the nearest code, ties to even mantissa.

    Finite values saturate to +-MAX_FINITE; NaN maps to the positive NaN code
    (0x7F) and +-inf to +-MAX_FINITE for e4m3 / +-inf for e5m2.

    float32 / float16 / bfloat16 go through torch's own float8 cast (one rounding from float32,
    with the saturation, NaN and Inf rules above applied around it) once that cast has given
    the codes of encode_search on every rounding boundary of the format (each midpoint between
    neighbouring codes and the float32 values either side of it); other dtypes, or a torch whose
    cast differs there, use encode_search. tests/model/test_fp8.py checks the two agree on every
    float16 and bfloat16 value and on every float32 rounding boundary.
    """
    check_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point tensor")
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16) and _cast_agrees(fmt):
        return _encode_cast(x, fmt)
    return encode_search(x, fmt)


_NATIVE = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def _encode_cast(x: torch.Tensor, fmt: str) -> torch.Tensor:
    mx = MAX_FINITE[fmt]
    xf = x.detach().float()
    y = xf.clamp(-mx, mx)                                # saturate (NaN stays NaN)
    if fmt == "e5m2":
        y = torch.where(torch.isinf(xf), xf, y)          # +-inf keeps its code
    code = y.to(getattr(torch, _NATIVE[fmt])).view(torch.uint8)
    return torch.where(torch.isnan(xf), torch.tensor(0x7F, dtype=torch.uint8, device=x.device), code)


def rounding_boundaries(fmt: str) -> torch.Tensor:
    """float32: every midpoint between neighbouring finite values of the format, the float32
    values one step either side of each, the codes' own values, both signs, +-0, +-inf, NaN and
    values past MAX_FINITE: where a rounding rule can go wrong."""
    vals = _TABLES[check_format(fmt)]
    pos = vals[(vals >= 0) & torch.isfinite(vals)].double().sort().values
    mids = ((pos[1:] + pos[:-1]) / 2).float()
    pts = torch.cat([mids, torch.nextafter(mids, torch.tensor(torch.inf)), torch.nextafter(mids, torch.tensor(0.0)),
                     pos.float(), torch.tensor([MAX_FINITE[fmt] * f for f in (1.0625, 1.125, 1.5, 2.0, 1e6)]),
                     torch.tensor([0.0, torch.finfo(torch.float32).tiny, 1e-30, torch.inf])])
    return torch.cat([pts, -pts, torch.tensor([torch.nan, -torch.nan])])


@functools.lru_cache(maxsize=None)
def _cast_agrees(fmt: str) -> bool:
    if not hasattr(torch, _NATIVE[fmt]):
        return False
    x = rounding_boundaries(fmt)
    try:
        return torch.equal(_encode_cast(x, fmt), encode_search(x, fmt))
    except (RuntimeError, TypeError):  # a torch without this cast on the CPU
        return False


def encode_search(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """encode by search over the code table in float64 (exact for every float dtype): the
    definition the fast path is checked against."""
    check_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point tensor")
    lut = _TABLES[fmt].to(x.device, torch.float64)
    # the non-negative finite codes in increasing value order are 0x00..0x7E (e4m3) / 0x7B (e5m2)
    n_pos = 0x7F if fmt == "e4m3" else 0x7C
    pos = lut[:n_pos]
    xd = x.detach().to(torch.float64)
    mag = xd.abs().clamp(max=MAX_FINITE[fmt])
    hi = torch.searchsorted(pos, mag.contiguous()).clamp(max=n_pos - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - pos[lo], pos[hi] - mag
    # ties go to the even code: an even code has an even mantissa, and codes are consecutive
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(take_hi, hi, lo)
    if fmt == "e5m2":
        code = torch.where(xd.abs() == math.inf, torch.full_like(code, 0x7C), code)
    code = code | (torch.signbit(xd).long() << 7)
    code = torch.where(torch.isnan(xd), torch.full_like(code, 0x7F), code)
    return code.to(torch.uint8)


def is_nan_code(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Bool mask of codes that decode to NaN."""
    return torch.isnan(decode(codes, fmt))


def nan_byte_fraction(codes: torch.Tensor, fmt: str) -> float:
    """Fraction of bytes that decode to NaN."""
    return float(is_nan_code(codes, fmt).float().mean()) if codes.numel() else 0.0


def code_table(fmt: str):
    """The 256-code table as a pandas DataFrame (code, hex, sign, exponent, mantissa, value, kind)."""
    import pandas as pd

    ebits, mbits, _ = _LAYOUT[check_format(fmt)]
    vals = _TABLES[fmt].tolist()
    rows = []
    for c, v in enumerate(vals):
        kind = "nan" if math.isnan(v) else "inf" if math.isinf(v) else (
            "zero" if v == 0 else "subnormal" if (c >> mbits) & ((1 << ebits) - 1) == 0 else "normal")
        rows.append({"code": c, "hex": f"0x{c:02X}", "sign": c >> 7,
                     "exponent": (c >> mbits) & ((1 << ebits) - 1), "mantissa": c & ((1 << mbits) - 1),
                     "value": v, "kind": kind})
    return pd.DataFrame(rows)


def fp16_byte_nan_rates(values: torch.Tensor, fmt: str = "e4m3") -> dict:
    """Why fp16 state lands on NaN codes: NaN fraction of its low and high bytes.

    values: fp16 tensor. Returns {"low": f, "high": f, "all": f}.
    """
    if values.dtype != torch.float16:
        raise TypeError("values must be float16")
    b = values.contiguous().view(torch.uint8).reshape(-1, 2)  # little endian: [low, high]
    return {"low": nan_byte_fraction(b[:, 0], fmt), "high": nan_byte_fraction(b[:, 1], fmt),
            "all": nan_byte_fraction(b.reshape(-1), fmt)}
