"""
One run per output folder: a lock file <out>/<script>.lock holding the owner's pid, its start
time, host and command, created whole in one step (so a second run never reads it half-written). A
second run on the same folder is refused with a line naming the first; a lock left by a dead
process is taken over, and so is one whose pid now names another process (this run itself, or a
container's pid 1 after a restart: the start time differs) or that is not a lock's shape.
"""
import contextlib
import json
import os
import socket
import sys
import time


class OutputLock:
    """A lock file <out>/<script>.lock holding the owner's pid, host and command. A second run on
    the same folder is refused with a message naming the first; a lock left by a dead process is
    taken over."""

    def __init__(self, path):
        self.path, self.held = path, False
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
              "started": time.ctime(), "start_ticks": _start_ticks(os.getpid())}
        for _ in range(2):
            try:
                self._create(path, json.dumps(me))
            except FileExistsError:
                owner = self._owner()
                if owner is not None and self._alive(owner):
                    raise SystemExit("error: another run is using this output folder: pid "
                                     f"{owner['pid']} on {owner['host']} since "
                                     f"{owner.get('started', '?')} ({owner.get('command', '?')}); "
                                     f"wait for it, stop it, or pass another --out (lock file: "
                                     f"{path})")
                try:
                    os.remove(path)                                # its owner died: take it over
                except FileNotFoundError:
                    pass
                continue
            self.held = True
            return
        raise SystemExit(f"error: could not take the lock {path}; delete it if no run is using "
                         "this folder")

    @staticmethod
    def _create(path, text):
        """Create `path` holding `text`, or FileExistsError; atomic, one process creates it: a file
        written whole, then linked (so no reader finds it empty), or where the file system has no
        hard links, created and then written."""
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            try:
                return os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:
                pass                                         # no hard links here
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except OSError:
            os.remove(path)
            raise

    def _owner(self):
        """The lock's owner, or None for a file that is not a lock: unreadable (half-written, then
        killed), not a dict, or without an int pid in range and a host."""
        try:
            with open(self.path) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            return None
        ok = (isinstance(owner, dict) and type(owner.get("pid")) is int
              and 0 < owner["pid"] < 2 ** 31 and isinstance(owner.get("host"), str))
        return owner if ok else None

    @staticmethod
    def _alive(owner):
        """Whether the lock's process still runs: another machine's is assumed to; on this one, a
        pid that is this process, or whose start time is not the lock's, is another process now."""
        if owner["host"] != socket.gethostname():
            return True                                    # another machine's: assumed alive
        pid = owner["pid"]
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass                                           # alive, another user's
        ticks, now = owner.get("start_ticks"), _start_ticks(pid)
        return ticks is None or now is None or ticks == now

    def release(self):
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def _start_ticks(pid):
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat, field 22), or None
    where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
