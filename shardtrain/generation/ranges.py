"""The values each numeric flag of ``shardtrain generate`` and ``shardtrain eval`` accepts.

Checked before any process starts, so a bad value is one line naming the flag and its range instead
of a traceback from every rank once the checkpoint has loaded (``--top-p 0`` leaves no token to
sample) or a quietly empty run (``--max-new-tokens 0``). A test walks both parsers and fails on a
numeric flag that is missing here.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from shardtrain.errors import ConfigError


@dataclass(frozen=True)
class Range:
    low: int
    high: float = math.inf
    low_open: bool = False  # (low, high] rather than [low, high]

    def __contains__(self, value: float) -> bool:
        # Written so that NaN is outside every range, and so is infinity (--temperature inf sampled
        # uniform noise)
        # (an int is finite, and may be too large for a float to hold: found by review)
        return ((self.low < value if self.low_open else self.low <= value) and value <= self.high
                and (isinstance(value, int) or math.isfinite(value)))

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"


GENERATE_RANGES = {
    "--max-new-tokens": Range(1),
    "--temperature": Range(0),
    "--top-k": Range(0),
    "--top-p": Range(0, 1, low_open=True),
    "--seed": Range(0, 2**63 - 1),  # torch's generators take 64 bits; prompt i uses seed + i
    "--devices": Range(1),
}

EVAL_RANGES = {
    "--samples": Range(1),
    "--seq-len": Range(1),
    "--batch-size": Range(1),
    "--devices": Range(1),
}


def check_ranges(args: argparse.Namespace, ranges: dict[str, Range]) -> None:
    """Raise ConfigError for the first flag in ``args`` outside its range."""
    for flag, allowed in ranges.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and value not in allowed:  # None: not given, taken from the checkpoint
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            infinite = isinstance(value, float) and math.isinf(value)
            raise ConfigError(f"{flag} {shown} must be {'finite' if infinite else allowed}")


def check_sampling(args: argparse.Namespace) -> None:
    """``--top-k``, ``--top-p`` and ``--seed`` shape sampling, which ``--temperature 0`` (greedy, the
    default) does not do: given with it they would change nothing (found by review)."""
    given = [flag for flag, unset in (("--top-k", args.top_k == 0), ("--top-p", args.top_p == 1.0),
                                      ("--seed", args.seed == 0)) if not unset]
    if args.temperature == 0 and given:
        one = len(given) == 1
        raise ConfigError(f"{', '.join(given)} shape{'s' if one else ''} sampling, and --temperature 0 (the "
                          f"default) picks the most likely token: {'it' if one else 'they'} would change "
                          f"nothing; give --temperature above 0 to sample, or drop {'it' if one else 'them'}")
