"""volcengine/verl compatibility: its entry points (`main_ppo`, `fsdp_sft_trainer`, the DAPO recipe's
`main_dapo` through `verl compat`) answered with `verl train` command lines (`command`), and its key and
name tables (`keys`), which the config loader also reads to answer a verl key with ours.

Nothing is imported here: `verl.config` reads `keys` while it is itself being imported, so importing
`command` (which needs `verl.config`) from this file would be circular.
"""
