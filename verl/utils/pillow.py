"""Pillow is optional (the `vision` extra): only image rows and vision-language models need it, so
`import verl` never imports it, and code that does need it asks `require_pillow` for a clear install hint."""

from __future__ import annotations

from typing import Any

from verl.errors import ModelError, VerlError, install_hint

INSTALL_HINT = install_hint("pillow", "vision")


def has_pillow() -> bool:
    import importlib.util

    return importlib.util.find_spec("PIL") is not None


def require_pillow(where: str, error: type[VerlError] = ModelError) -> Any:
    """The `PIL.Image` module, or `error` saying who needs Pillow (`where`) and how to install it."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise error(f"{where} needs Pillow to read and process images, and it is not installed. Fix: "
                    f"{INSTALL_HINT}.") from exc
    return Image


__all__ = ["INSTALL_HINT", "has_pillow", "require_pillow"]
