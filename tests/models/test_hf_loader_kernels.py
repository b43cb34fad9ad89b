"""Models load on their own torch layers: no Hub kernels (code fetched from the Hub) and no re-kernelization at
every train()/eval() switch, which transformers >= 5 does by default."""

from __future__ import annotations

import torch

from verl.models.hf_loader import load_hf_model


def test_loaded_models_keep_their_torch_layers_across_mode_switches(tiny_path, monkeypatch):
    model, _ = load_hf_model(tiny_path, torch_dtype=torch.float32, for_training=True)
    assert not getattr(model, "use_kernels", False)
    if hasattr(model, "set_use_kernels"):  # transformers with Hub kernels: a switch must not kernelize again
        calls = []
        monkeypatch.setattr(type(model), "set_use_kernels", lambda self, *a, **k: calls.append(a))
        model.eval()
        model.train()
        assert calls == []
