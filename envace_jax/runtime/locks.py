"""Ownership of a path by one live process: an exclusive `flock` on a lock file that holds the
owner's PID.

The training job locks its workdir (two jobs on one workdir would mix their metrics and remove
each other's checkpoints) and the server locks its `--port-file` (two servers would overwrite
each other's port). The kernel releases an flock when its process ends however it ends, SIGKILL
included, so a lock is never stale while it is held: a lock file that can be locked again was
left by a process that is gone, and its PID is reported so that the caller can warn. The file
descriptor is not inherited by child processes (Python opens it non-inheritable), so a child
that outlives the job does not keep the lock.

Imports nothing heavy: a job takes its lock before JAX is imported.
"""

from __future__ import annotations

import fcntl
import os


class LockHeld(RuntimeError):
    """The lock is held by a live process (`pid`, None if its file was unreadable)."""

    def __init__(self, path: str, pid: int | None):
        self.path, self.pid = path, pid
        super().__init__(f"{path} is locked by process {pid if pid is not None else '?'}")


def _read_pid(fd: int) -> int | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


class PidLock:
    """An exclusive lock on `path` (created if needed). `acquire()` raises LockHeld while
    another live process holds it; `previous_pid` is then the PID a dead holder left in the
    file (None when the lock was free and clean)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.previous_pid: int | None = None
        self._fd: int | None = None

    def acquire(self) -> PidLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _read_pid(fd)
                os.close(fd)
                raise LockHeld(self.path, pid) from None
            # A holder that released (and removed) the file between our open and our flock
            # leaves us holding a lock on a file no one else can find: open the path again.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        pid = _read_pid(fd)
        self.previous_pid = pid if pid not in (None, os.getpid()) else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Removes the file, then drops the lock (in that order: whoever locks the path next
        finds a fresh file). Safe to call twice."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:  # a read-only or vanished directory: the lock still goes with the fd
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> PidLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
