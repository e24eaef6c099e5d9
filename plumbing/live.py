"""
--report_to tensorboard: each row Run.log appends to metrics.jsonl, as TensorBoard scalars in the
same folder (`tensorboard --logdir out`); the package imported only when asked for.
"""
import importlib.util

TRACKERS = ("none", "tensorboard")


def check(report_to):
    """None, or the one line saying why `report_to` cannot be used here."""
    if report_to not in TRACKERS:
        return f"--report_to {report_to}: unknown; allowed: {', '.join(TRACKERS)}"
    if report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        return ("--report_to tensorboard: the tensorboard package is not installed here "
                "(pip install tensorboard)")
    return None


class Mirror:
    """A row's numbers as scalars at its step. The first row purges the folder's events from its
    step on (a fresh run: an earlier run's; a resumed one: those past its checkpoint)."""

    def __init__(self, report_to, folder):
        self.report_to, self.folder, self.writer = report_to, folder, None

    def log(self, metrics):
        if self.report_to == "none":
            return
        step = metrics["step"]
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(self.folder, purge_step=step)
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
