"""'Did you mean' hints for config keys and values."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, candidates: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest candidate, or an empty string."""
    options = list(candidates)
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    if not match:
        lowered = {o.lower(): o for o in options}
        match = [lowered[m] for m in difflib.get_close_matches(word.lower(), lowered, n=1)]
    return f"; did you mean {match[0]!r}?" if match else ""
