"""Shared low-level helpers (dtype spellings, position ids); `hf_loader` re-exports `verl.models.hf_loader`."""
