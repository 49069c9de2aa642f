"""Sizes in bytes as text: SI prefixes are decimal, IEC prefixes binary.

:func:`parse_size` reads a number and an optional unit, any case: ``B`` or none (bytes), ``kB`` to
``TB`` (powers of 10^3), ``KiB`` to ``TiB`` (powers of 2^10); ``K``, ``M``, ``G``, ``T`` without
``B`` are refused as ambiguous, naming both readings; the result is a whole number of bytes from 0
to 2^63 - 1. :func:`format_size` writes a size exactly, with at most three decimals, in the first
unit that fits (the largest binary unit, the largest decimal one, the smaller binary and decimal
ones, else bytes), up to GiB and GB; :func:`parse_size` reads every label back to the same number.

Design notes: docs/CLI.md#units
"""

from __future__ import annotations

import re
from decimal import Decimal, localcontext

#: Units a size may be written with (upper case) and their bytes.
DECIMAL_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
BINARY_UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
UNITS = {"": 1, "B": 1, **DECIMAL_UNITS, **BINARY_UNITS}
#: Prefixes without a B: 'K' could be 1024 or 1000 (binary unit, its bytes, decimal unit, its bytes).
AMBIGUOUS = {"K": ("KiB", "2^10", "kB", "10^3"), "M": ("MiB", "2^20", "MB", "10^6"),
             "G": ("GiB", "2^30", "GB", "10^9"), "T": ("TiB", "2^40", "TB", "10^12")}

#: The largest size read (bytes): a tensor's byte count is an int64.
MAX_SIZE = (1 << 63) - 1

#: Labels, largest first (GiB / GB at most: 3 TiB reads '3072GiB').
_BINARY_LABELS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_DECIMAL_LABELS = (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))
_EXAMPLES = "examples: 4096, 16KiB, 1.5MiB, 3MB, 100kB"

_SIZE = re.compile(r"\s*([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text) -> int:
    """Bytes of ``text`` (see the module docstring): '3MB' -> 3000000, '16KiB' -> 16384,
    '4096' -> 4096. A ValueError naming ``text`` for anything else."""
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise ValueError(f"cannot read {text!r} as a size in bytes ({_EXAMPLES})")
    number, unit = match.group(1), match.group(2).upper()
    if unit in AMBIGUOUS:
        binary, binary_bytes, decimal, decimal_bytes = AMBIGUOUS[unit]
        raise ValueError(f"{text!r} is ambiguous: write {number}{binary} ({binary_bytes} bytes each) or "
                         f"{number}{decimal} ({decimal_bytes} bytes each)")
    if unit not in UNITS:
        raise ValueError(f"{text!r} has an unknown unit {match.group(2)!r} (units: B, kB, MB, GB, TB "
                         f"(decimal), KiB, MiB, GiB, TiB (binary))")
    value = _exact(Decimal(number), UNITS[unit])
    if value < 0:
        raise ValueError(f"{text!r} is negative: a size is >= 0 bytes")
    if value > MAX_SIZE:
        raise ValueError(f"{text!r} is over {MAX_SIZE} bytes (2^63 - 1, the largest tensor size)")
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _exact(number: Decimal, scale: int) -> Decimal:
    """``number * scale`` exactly; a number beyond +-10^40 as 10^40 (over any limit), a non-zero
    one below 10^-40 as 10^-40 (not whole)."""
    if number.is_zero():
        return Decimal(0)
    if abs(number.adjusted()) > 40:
        return number.copy_sign(Decimal(10) ** (40 if number.adjusted() > 0 else -40))
    with localcontext() as context:
        context.prec = len(number.as_tuple().digits) + 60
        return number * scale


def format_size(nbytes: int) -> str:
    """``nbytes`` as a label :func:`parse_size` reads back exactly: 4096 -> '4KiB',
    1572864 -> '1.5MiB', 3000000 -> '3MB', 6000 -> '6kB', 1023 -> '1023B'."""
    n = int(nbytes)
    if n < 0:
        raise ValueError(f"a size is >= 0 bytes, got {nbytes!r}")
    if n >= 1 << 10:
        binary = [label for label in _BINARY_LABELS if label[1] <= n]
        decimal = [label for label in _DECIMAL_LABELS if label[1] <= n]
        # each kind's own unit first (1.5MiB, 2.048MB), then smaller ones (1025KiB, 1234.567kB)
        for unit, scale in binary[:1] + decimal[:1] + binary[1:] + decimal[1:]:
            if (n * 1000) % scale == 0:  # exact with at most three decimals
                return f"{(Decimal(n) / scale).normalize():f}{unit}"
    return f"{n}B"
