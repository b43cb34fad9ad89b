"""Turning what a run wrote into values a browser can take: finite numbers, bounded text, strict JSON.

Python's json writes NaN and Infinity, which JavaScript's JSON.parse refuses, and a model's response can be a
megabyte long; every row passes through here on its way to the page, so neither reaches it.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

TABLE_CLIP = 4000  # characters of a text cell in the samples table
TURN_CLIP = 20000  # characters of one episode turn


def num(value: Any) -> float | None:
    """A finite float, or None (missing, NaN, infinite, a bool, a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_text(value: Any) -> str:
    """Text to show for any JSON value: strings as they are, anything else as its JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} … ({len(text) - limit} more characters)"


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None, so `json.dumps(allow_nan=False)` accepts it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON (no NaN) of `obj`, compact."""
    return json.dumps(json_safe(obj), allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def embed_json(obj: Any) -> str:
    """JSON safe inside an HTML <script> element: no `<`, `>` or `&` (a `</script>` in a response cannot close
    the element), and no U+2028/U+2029."""
    return (dumps(obj).replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def prompt_hash(prompt: str) -> int:
    """A 64-bit key of the prompt's text: rows with the same key show side by side."""
    digest = hashlib.blake2b(prompt.encode("utf-8", errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


__all__ = ["TABLE_CLIP", "TURN_CLIP", "as_int", "as_text", "clip", "dumps", "embed_json", "json_safe", "num",
           "prompt_hash"]
