"""The built-in demos: `verl train` with no config runs the arithmetic one (`arithmetic`); the tool-use demo
(`tool`) runs from `examples/tool_calculator.yaml`. Each is a recipe on top of the public trainers."""
