"""One spelling table for dtypes, and the checks of a dtype against the device it will run on.

Configs, the CLI and the Python API all accept "bf16", "bfloat16", torch.bfloat16, ...; resolving them in
one place means a typo fails the same way everywhere, with the list of accepted names.
"""

from __future__ import annotations

import torch

from verl.errors import ConfigError, ModelError
from verl.utils.suggest import did_you_mean

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "full": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}

_SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def resolve_dtype(value: str | torch.dtype, *, where: str = "dtype") -> torch.dtype:
    """Turn a dtype spelling ("bf16", "torch.float32", torch.float16, ...) into a floating torch.dtype.

    ``where`` names the config key or argument in the error message.
    """
    if isinstance(value, torch.dtype):
        if value not in _SHORT_NAMES:
            raise ConfigError(f"{where}={value} is not a floating-point dtype a model can be loaded in; "
                              "use one of bf16, fp16, fp32.")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where}={value!r} must be a string such as 'bf16' or a torch.dtype, "
                          f"not {type(value).__name__}.")
    key = value.strip().lower().removeprefix("torch.")
    if key in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    hint = did_you_mean(key, _DTYPE_NAMES)
    raise ConfigError(f"{where}={value!r} is not a known dtype.{hint} Accepted: "
                      f"{', '.join(sorted(_DTYPE_NAMES))}.")


def dtype_name(dtype: torch.dtype) -> str:
    """The short name used in reports and configs ("bf16", "fp32", ...)."""
    return _SHORT_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def canonical_dtype_name(value: str | torch.dtype, *, where: str = "dtype") -> str:
    """'bf16' -> 'bfloat16': the torch spelling, so dtypes written with different aliases compare equal."""
    return str(resolve_dtype(value, where=where)).removeprefix("torch.")


def is_dtype_name(value: object) -> bool:
    """Whether ``value`` is a spelling resolve_dtype accepts, for validators that raise their own error."""
    try:
        resolve_dtype(value, where="dtype")  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


def dtype_aliases() -> list[str]:
    """Every accepted spelling, sorted: for error messages that list the choices."""
    return sorted(_DTYPE_NAMES)


def bytes_per_element(value: str | torch.dtype, *, where: str = "dtype") -> int:
    """Bytes one parameter takes in this dtype (memory estimates)."""
    return resolve_dtype(value, where=where).itemsize


def check_dtype_for_device(dtype: torch.dtype, device_type: str, *, where: str = "dtype") -> None:
    """Refuse dtypes the device cannot run well, before minutes are spent loading weights.

    fp16 on CPU is refused because many CPU kernels lack fp16 and the rest are slower than fp32; bf16 on a
    CUDA GPU without bf16 support (pre-Ampere) is refused because it is emulated or fails.
    """
    if device_type == "cpu" and dtype == torch.float16:
        raise ModelError(f"{where}=fp16 was requested for a model on CPU, where fp16 matmuls are unsupported or "
                         "very slow. Fix: use dtype 'fp32' (or 'bf16') on CPU, or run on a CUDA GPU.")
    if (device_type == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available()
            and not torch.cuda.is_bf16_supported()):
        name = torch.cuda.get_device_name()
        raise ModelError(f"{where}=bf16 was requested but {name} does not support bfloat16 (it needs compute "
                         "capability 8.0+, e.g. A100/H100/RTX 30xx). Fix: use dtype 'fp16' (with loss "
                         "scaling) or 'fp32'.")


__all__ = ["resolve_dtype", "dtype_name", "canonical_dtype_name", "is_dtype_name", "dtype_aliases",
           "bytes_per_element", "check_dtype_for_device"]
