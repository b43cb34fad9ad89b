"""The one dtype table: every layer that names a dtype resolves it here, so spellings agree everywhere."""

import pytest
import torch

from verl.config.fsdp import FSDPConfig, MixedPrecisionSpec
from verl.errors import ConfigError
from verl.utils.dtype import bytes_per_element, canonical_dtype_name, dtype_aliases, is_dtype_name


@pytest.mark.parametrize(("alias", "canonical"), [("bf16", "bfloat16"), ("half", "float16"), ("FP32", "float32"),
                                                  ("torch.float64", "float64"), (torch.bfloat16, "bfloat16")])
def test_canonical_name_is_the_torch_spelling(alias, canonical):
    assert canonical_dtype_name(alias) == canonical


def test_bytes_per_element_follow_torch():
    assert [bytes_per_element(n) for n in ("fp32", "bf16", "fp16", "double")] == [4, 2, 2, 8]


def test_unknown_name_names_the_key():
    with pytest.raises(ConfigError, match=r"critic dtype='fp8' is not a known dtype"):
        canonical_dtype_name("fp8", where="critic dtype")
    assert not is_dtype_name("fp8") and not is_dtype_name(3) and is_dtype_name("bf16")
    assert "bf16" in dtype_aliases() and "bfloat16" in dtype_aliases()


def test_fsdp_mixed_precision_reads_the_same_table():
    cfg = FSDPConfig(mixed_precision=MixedPrecisionSpec(param_dtype="BF16", reduce_dtype="torch.float32"))
    assert cfg.mixed_precision_dtypes() == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="unknown dtype 'bf61'"):
        MixedPrecisionSpec(param_dtype="bf61")
