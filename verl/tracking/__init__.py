"""Where metrics go: console, JSONL in the run directory, TensorBoard, wandb."""

from verl.tracking.tracker import Tracker, read_metrics

__all__ = ["Tracker", "read_metrics"]
