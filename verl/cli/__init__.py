"""The `verl` command line (`python -m verl.cli` works too, e.g. under torchrun)."""
