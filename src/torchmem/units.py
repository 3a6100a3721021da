"""Sizes: the only place where bytes become text and text becomes bytes.

Everything inside torchmem counts in bytes (plain ``int``). Whole megabytes appear only
where the seed APIs promise them (:func:`b2mb`), and human-readable sizes only in
renderers (:func:`readable_size`).
"""

from __future__ import annotations

import math
import re

MB = 2**20
"""One megabyte as the seed APIs (fastai, ipyexperiments) count it: 1,048,576 bytes (a MiB)."""

_UNITS = ("B", "K", "M", "G", "T", "P")
_FACTORS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_SIZE = re.compile(
    r"""^\s*
    (?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)
    \s*
    (?:(?P<prefix>[kmgtp])(?:i?b)?|b)?
    \s*$""",
    re.IGNORECASE | re.VERBOSE,
)


def b2mb(num: float) -> int:
    """Bytes to whole megabytes (MiB), truncated toward zero: ``int(num / 2**20)``.

    This is the seeds' definition, kept exactly: ``b2mb(2**20 - 1) == 0`` and
    ``b2mb(-1.5 * 2**20) == -1``.
    """
    return int(num / MB)


def readable_size(num_bytes: float) -> str:
    """Format a byte count the way pytorch_memlab prints it: base 1024, two decimals.

    Units are ``B K M G T P``; the unit steps up once the value reaches 1024 of the
    current one: ``0.00B``, ``512.00B``, ``1000.00B``, ``1.00K``, ``2.00M``, ``1.00G``,
    ``-4.00M``. NaN formats as an empty string (an empty cell in a table).
    """
    if isinstance(num_bytes, float) and math.isnan(num_bytes):
        return ""
    value = num_bytes
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{value:.2f}{unit}"
        value /= 1024
    return f"{value:.2f}{_UNITS[-1]}"


def parse_size(size: int | float | str) -> int:
    """Turn a user-given size into bytes.

    Accepts a non-negative whole number of bytes (``4096``, ``2**30``) or a string: a
    number, optionally followed by a unit, in any case, with or without a space:
    ``"4096"``, ``"4096B"``, ``"500MB"``, ``"1.5 GiB"``, ``"24G"``, ``"512k"``.

    Every prefix is 1024-based, whether written ``K``/``KB``/``KiB``, ``M``/``MB``/``MiB``,
    ``G``/``GB``/``GiB``, ``T``/``TB``/``TiB`` or ``P``/``PB``/``PiB``: torchmem, like the
    tools it replaces, means MiB by "MB". Fractions are rounded to the nearest byte.

    Raises:
        ValueError: for anything else (negative sizes, unknown units, booleans, NaN),
            naming the bad value.
    """
    if isinstance(size, bool):
        raise ValueError(f"invalid size {size!r}: expected bytes or a string like '500MB'")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"invalid size {size!r}: sizes cannot be negative")
        return size
    if isinstance(size, float):
        if not (math.isfinite(size) and size.is_integer()) or size < 0:
            raise ValueError(
                f"invalid size {size!r}: expected a non-negative whole number of bytes"
            )
        return int(size)
    if isinstance(size, str):
        match = _SIZE.match(size)
        if match is None:
            raise ValueError(
                f"invalid size {size!r}: expected a number and an optional unit "
                "(B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB, P/PB/PiB), e.g. '500MB' or '1.5 GiB'"
            )
        nbytes = float(match["number"]) * _FACTORS[(match["prefix"] or "").lower()]
        if not math.isfinite(nbytes):
            raise ValueError(f"invalid size {size!r}: the number is too large")
        return round(nbytes)
    raise ValueError(
        f"invalid size {size!r} of type {type(size).__name__}: expected int bytes or a string"
    )
