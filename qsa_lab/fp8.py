"""The FP8 codecs under their public name (the face; the code is qsa_lab.model.fp8).

    decode(codes, fmt) -> float32   codes uint8 of any shape, fmt "e4m3" | "e5m2"; bit-exact on all 256 codes
    encode(x, fmt) -> uint8         round to nearest even, saturating (a finite value never becomes NaN)
"""
from qsa_lab.model.fp8 import (FORMATS, INF_CODES, MAX_FINITE, NAN_CODES, code_table, decode, encode,  # noqa: F401
                               is_nan_code, nan_byte_fraction, table)

__all__ = ["FORMATS", "NAN_CODES", "INF_CODES", "MAX_FINITE", "decode", "encode", "table", "code_table",
           "is_nan_code", "nan_byte_fraction"]
