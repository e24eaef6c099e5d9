"""
One run per output folder: a lock file <out>/<script>.lock holding the owner's pid, host and
command, created whole in one step (so a second run never reads it half-written). A second run on
the same folder is refused with a line naming the first; a lock left by a dead process is taken
over.
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
              "started": time.ctime()}
        for _ in range(2):
            try:
                self._create(path, json.dumps(me))
            except FileExistsError:
                owner = self._owner()
                if owner is not None and self._alive(owner):
                    raise SystemExit("error: another run is using this output folder: pid "
                                     f"{owner['pid']} on {owner['host']} since {owner['started']} "
                                     f"({owner['command']}); wait for it, stop it, or pass another "
                                     f"--out (lock file: {path})")
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
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None                                    # unreadable: half-written, then killed

    @staticmethod
    def _alive(owner):
        if owner.get("host") != socket.gethostname():
            return True                                    # another machine's: assumed alive
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, KeyError, TypeError):
            return True
        return True

    def release(self):
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
