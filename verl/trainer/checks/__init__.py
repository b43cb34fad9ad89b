"""Start-up checks, run before any model loads: the device mapping, sources, LoRA, memory and sizes."""
