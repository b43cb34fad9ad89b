"""`verl.models.sharded_load` in one process: a model built on the meta device with its weights
deferred, then materialised, is bit for bit the one `from_pretrained` loads (tied head, rotary buffers,
generation config); files it cannot read that way (.bin) give the old whole load."""

import shutil

import torch

from verl.models.hf_loader import load_hf_model_with_report
from verl.models.sharded_load import bytes_read, is_deferred, materialise, safetensors_index
from verl.models.tiny import build_tiny_model


def _everything(model):
    return {**{f"p:{k}": v for k, v in model.named_parameters()}, **{f"b:{k}": v for k, v in model.named_buffers()}}


def test_deferred_then_materialised_equals_from_pretrained():
    path = build_tiny_model(hidden_size=48, num_layers=1)
    want, _, _ = load_hf_model_with_report(path, torch_dtype="bf16", device="cpu")
    got, _, report = load_hf_model_with_report(path, torch_dtype="bf16", device="cpu", defer=True)
    assert is_deferred(got) and report.device == "cpu" and report.dtype == "bf16"
    before = bytes_read()
    materialise(got, "cpu")
    stored = safetensors_index(path)
    assert bytes_read() - before == sum(torch.Size(s.shape).numel() * 4 for s in stored.values())  # each once
    assert not is_deferred(got) and got.lm_head.weight is got.model.embed_tokens.weight
    a, b = _everything(got), _everything(want)
    assert a.keys() == b.keys()
    for key, value in b.items():
        assert a[key].dtype == value.dtype and torch.equal(a[key], value), key
    assert got.generation_config.to_dict() == want.generation_config.to_dict()
    assert got.config.to_dict() == want.config.to_dict()


def test_bin_weights_load_whole(tmp_path):
    path = build_tiny_model(hidden_size=48, num_layers=1)
    folder = tmp_path / "bin"
    shutil.copytree(path, folder)
    model, _, _ = load_hf_model_with_report(str(folder), torch_dtype="fp32", device="cpu")
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    assert safetensors_index(folder) is None
    loaded, _, _ = load_hf_model_with_report(str(folder), torch_dtype="fp32", device="cpu", defer=True)
    assert not is_deferred(loaded) and not any(p.is_meta for p in loaded.parameters())
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_file_that_is_not_safetensors_falls_back_to_the_loader_that_says_so(tmp_path):
    """A header length past the file's end (any non-safetensors bytes): no index, so the whole-model loader
    runs and reports the broken file (it was a MemoryError reading a 'header' of petabytes)."""
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    assert safetensors_index(tmp_path) is None
