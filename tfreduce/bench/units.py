"""Byte counts on the command line and in tables: ``"4MiB"`` <-> 4194304."""

import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text):
    """Parses a byte count such as ``"4MiB"``, ``"1MB"``, ``"65536"`` or ``"0"``.

    KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2; case does not matter.

    Args:
      text: str.

    Returns:
      int, bytes.

    Raises:
      ValueError: if ``text`` is not a number with an optional unit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a byte count; write e.g. 65536, 64KiB, 4MiB or 1MB")
    return int(round(float(match.group(1)) * _UNITS[match.group(2)]))


def format_bytes(num):
    """``4194304 -> "4MiB"``, ``1000000 -> "1MB"``, ``1536 -> "1.5KiB"``.

    A binary unit when ``num`` is a multiple of a quarter of it, else a
    decimal unit with three significant digits.

    Args:
      num: int >= 0, bytes.

    Returns:
      str, the count with its unit ("B" below 1 KB).
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= size and num % (size // 4) == 0:
            return f"{num / size:g}{unit}"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num >= size:
            return f"{num / size:.3g}{unit}"
    return f"{num}B"
