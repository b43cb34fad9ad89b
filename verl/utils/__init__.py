"""Shared helpers: dtype spellings and `load_hf_model` (import from `verl.utils.hf_loader`)."""
