"""
--report_to tensorboard: each row Run.log appends to metrics.jsonl, as TensorBoard scalars in the
same folder (`tensorboard --logdir out`); the package imported only when asked for.
"""
import importlib.util
import sys
import time

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


class Progress:
    """A long phase's progress, once it has run `after` seconds: `what: done/total (N s)`, one line
    updated in place on a terminal, a line each time in a log (rank 0's, through `say`)."""

    def __init__(self, what, say=print, after=5.0, stream=sys.stdout):
        self.what, self.say, self.after, self.t0 = what, say, after, time.time()
        self.tty = stream.isatty()
        self.stream = stream

    def __call__(self, done, total):
        elapsed = time.time() - self.t0
        if elapsed < self.after:
            return
        text = f"{self.what}: {done}/{total} ({elapsed:.0f} s)"
        if self.tty:
            self.stream.write(f"\r{text}" + ("\n" if done == total else ""))
            self.stream.flush()
        else:
            self.say(text)
