"""Memory sizes at the API boundary: "60GB", "1.5 GiB", "512mb" or an int of bytes -> int bytes.

Sizes are parsed once, where the user hands them in; everything inside remat is an int of bytes.
Decimal units are powers of ten (GB = 1e9, as device vendors count), binary units
powers of two (GiB = 2**30). A size with a fraction of a byte is rounded down: a budget is a
capacity, and rounding it down keeps every plan that fits it feasible.
"""
from __future__ import annotations

import numbers
import re
from decimal import Decimal, InvalidOperation

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}

ACCEPTED = ('an int of bytes, or a string: a number (decimals allowed) and an optional unit, '
            'any case, a space allowed: "60GB" (1e9 bytes), "60GiB" (2**30), "1.5 GB", "512MiB", '
            '"64KB", "1000B"; units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB')

# Sizes are int64 everywhere below (the CP-SAT model, JSON problem files): a budget that does not
# fit one cannot be planned for, and no device holds 9.2 EB.
LIMIT = 2**63

_SIZE = re.compile(r"^\s*(?P<number>[+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?|inf(?:inity)?|nan))"
                   r"\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: int | str, *, allow_zero: bool = False) -> int:
    """The number of bytes that `value` names. Raises ValueError, quoting `value` and listing the
    accepted forms, for anything malformed, zero (unless `allow_zero`), negative, non-finite or
    2**63 bytes and more, and for bools and floats (write "1.5GB", or an int)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (numbers.Integral, bool)):
        raise ValueError(
            f"memory size {value!r} is a float, which cannot hold every byte count exactly: "
            f"give an int of bytes or a string like '60GB'")
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise ValueError(f"cannot read {value!r} as a memory size; give {ACCEPTED}")
    if isinstance(value, numbers.Integral):
        number, unit = Decimal(int(value)), 1
    else:
        number, unit = _split(value)
    if not number.is_finite():
        raise ValueError(f"memory size {value!r} is not finite; give {ACCEPTED}")
    if number < 0 or (number == 0 and not allow_zero):
        what = "negative" if number < 0 else "zero"
        raise ValueError(f"memory size {value!r} is {what}; give a positive size: {ACCEPTED}")
    size = int(number * unit)  # int() of a Decimal truncates: rounds a capacity down
    if size == 0 and not allow_zero:
        raise ValueError(f"memory size {value!r} is less than one byte; give {ACCEPTED}")
    if size >= LIMIT:
        raise ValueError(f"memory size {value!r} is {size:.3g} bytes, not below 2**63 "
                         f"({LIMIT:.3g}): remat counts bytes in 64-bit integers, and no device "
                         f"holds that much; give a real device's size, e.g. '80GB'")
    return size


def _split(text: str) -> tuple[Decimal, int]:
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"cannot read {text!r} as a memory size; give {ACCEPTED}")
    unit = match["unit"].lower() or "b"
    if unit not in UNITS:
        raise ValueError(f"unknown unit {match['unit']!r} in memory size {text!r}; give {ACCEPTED}")
    try:
        number = Decimal(match["number"])
    except InvalidOperation:
        raise ValueError(f"cannot read {text!r} as a memory size; give {ACCEPTED}") from None
    return number, UNITS[unit]


def format_size(size: int | float, *, signed: bool = False) -> str:
    """`size` bytes for people, in decimal units (as budgets are usually given): "107.3 GB"."""
    sign = "-" if size < 0 else ("+" if signed and size > 0 else "")
    size = abs(size)
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale:
            return f"{sign}{size / scale:.2f} {unit}"
    return f"{sign}{int(size)} B"
