"""Running model-written code safely: `run_code` for code rewards and the `python` tool.

    from verl.sandbox import run_code
    result = run_code("print(sum(range(10)))", timeout_s=5, memory_mb=256)
    result.status, result.stdout  # ("ok", "45\n")

Each run is a fresh subprocess with resource limits, a wall-clock timeout that kills its whole process tree,
a private working folder removed afterwards and an empty environment; where the host allows, also no
network, its own PID namespace and private /tmp (`isolation().describe()` says what this host gives).
"""

from verl.sandbox.isolation import FEATURES, Isolation, configure, isolation
from verl.sandbox.runner import SandboxResult, run_code

__all__ = ["FEATURES", "Isolation", "SandboxResult", "configure", "isolation", "run_code"]
