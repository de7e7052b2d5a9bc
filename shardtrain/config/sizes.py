"""Byte sizes as people write them (``5GB``, ``500MB``, ``2GiB``) and as reports print them, and
counts of things as reports print them."""

from __future__ import annotations

import re

from shardtrain.errors import ConfigError

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.I)
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9,
         "T": 10**12}


def parse_size(text: str, option: str = "size") -> int:
    """Bytes, at least one: every size given is a bound or an amount, where 0 read as "none" (an
    unlimited shard size) would do the opposite of what was asked without a word."""
    match = SIZE.match(str(text))
    if not match or match.group(2).upper() not in UNITS:
        raise ConfigError(f"{option} {text!r} is not a size like 5GB, 500MB or 2GiB")
    size = int(float(match.group(1)) * UNITS[match.group(2).upper()])
    if size < 1:
        raise ConfigError(f"{option} {text!r} must be more than 0")
    if not match.group(2) and size < 2**20:
        # A number alone is bytes: --device-memory 80 planned for 80 bytes (found by review)
        raise ConfigError(f"{option} {text!r} has no unit, and read as bytes it is under 1 MiB; write it "
                          f"with one, like {text}GB, {text}GiB or {text}B")
    return size


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def counted(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless there is one (``1 micro-batch``, ``4 micro-batches``);
    English's regular plurals only (not "-y" -> "-ies")."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}es" if noun.endswith(("ch", "sh", "s", "x")) else f"{n} {noun}s"
