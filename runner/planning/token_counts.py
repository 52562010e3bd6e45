"""Token counts as people write them on a command line: `614400`, `614_400`, `6.144e5`, `614.4K`, `26B`.

One parser for every option that takes a count of tokens (`launch --extend-to`, `pilot-grid --budgets`);
each caller states its own bounds. Exact: decimal arithmetic, so `614.4K` is 614,400, never 614,399.99.
"""

from __future__ import annotations

import re
from decimal import Decimal

_COUNT = re.compile(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:e[+]?[0-9]{1,3})?)\s*([kmbgt]?)\s*", re.IGNORECASE)
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def token_count(text: str) -> Decimal | None:
    """The number `text` writes (a suffix K, M, B or G, T multiplies it), exactly; None where it writes none.
    The exponent has at most three digits, so the product stays within decimal's range."""
    m = _COUNT.fullmatch(text)
    return Decimal(m.group(1).replace("_", "")) * _SUFFIX[m.group(2).lower()] if m else None
