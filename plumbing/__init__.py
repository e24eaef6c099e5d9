"""The run's plumbing, shared by every training script: Run (run.py) and its rooms."""
from plumbing.run import Run, lr_schedule

__all__ = ["Run", "lr_schedule"]
