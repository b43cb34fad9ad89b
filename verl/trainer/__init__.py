"""The trainers. Rooms, lowest first (tests/test_layers.py enforces the order): `forward` and `build`; `rl`;
`checks`; `compose`; `offline`; then the entry points here (`rl_trainer`, `entry`, `eval_run`, the volcengine/verl
paths `main_ppo` and `fsdp_sft_trainer`, the public `fsdp_config`). Sampling lives in `verl.rollout`."""
