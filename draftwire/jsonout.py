"""JSON as the standard has it, for every JSON the project prints or serves: Python's json writes NaN and
Infinity, which no JSON parser takes, so a non-finite float is written as null."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float in it (dicts, lists, tuples) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs) -> str:
    """json.dumps of `value` with non-finite floats as null: always valid JSON."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
