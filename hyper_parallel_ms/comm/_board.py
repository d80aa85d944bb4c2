"""Each rank's board: an 8 KiB file on this host where a rank publishes how far its communication got.

A rank writes its own board through shared memory (``mmap``): its pid, when it registered, a
count per communication key (a collective group, or one direction of a point-to-point pair;
keys past the board's room share one slot that is never compared) bumped as each call is
issued, a total of all its calls (``PROGRESS``), and, from its watchdog thread, a heartbeat,
whether its main thread is compiling a graph, the rank it waits for, where its main thread is,
and the message it ended with (or that it exited normally). Other ranks on the host read it
with ``pread`` (never ``mmap``: a board re-created under a reader would fault its mapping).
Boards live in one folder per job (the scheduler's address: ``MS_SCHED_HOST`` /
``MS_SCHED_PORT``), under ``HPMS_WATCHDOG_DIR`` or ``/dev/shm`` (else the temp folder).

Example::

    board = Board.create(os.path.join(job_dir(), "rank0"))
    slot = board.slot(key_hash("c:world"))
    board.bump(slot)                              # one more all-reduce over the world group
    BoardView.read(os.path.join(job_dir(), "rank0")).count(key_hash("c:world"))   # 1
"""
from __future__ import annotations

import hashlib
import mmap
import os
import socket
import struct
import tempfile
import time
from typing import Dict, Optional

__all__ = ["Board", "BoardView", "job_dir", "key_hash", "process_start_ns", "sweep", "RUNNING", "COMPILING", "ENDED",
           "EXITED"]

DIR_ENV = "HPMS_WATCHDOG_DIR"
MAGIC = 0x3147445753504D48            # a fixed marker, written last: a board without it is not ready
MAGIC_, PID, STARTED, PROGRESS, HEARTBEAT, STATE, WAITING_ON, HOST = range(8)
RUNNING, COMPILING, ENDED, EXITED = 0, 1, 2, 3   # STATE (ENDED: by its watchdog; EXITED: a normal exit)
_HEADER = 16                          # int64 fields before the slots
SLOTS = 440                           # (key hash, count) pairs, the last one shared by the keys past the others
OVERFLOW = -1                         # its hash (key_hash is never negative)
_WHERE = (_HEADER + 2 * SLOTS) * 8    # byte offsets of the two text fields
_WHERE_BYTES = 512
_MESSAGE = _WHERE + _WHERE_BYTES
SIZE = 8192
_MESSAGE_BYTES = SIZE - _MESSAGE


def key_hash(key: str) -> int:
    """A stable non-zero 63-bit hash of ``key`` (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1 or 1


def job_dir() -> Optional[str]:
    """The boards' folder of this job (``None`` when the scheduler's address is not in the environment)."""
    host, port = os.environ.get("MS_SCHED_HOST"), os.environ.get("MS_SCHED_PORT")
    if not host or not port:
        return None
    base = os.environ.get(DIR_ENV) or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    return os.path.join(base, f"{_prefix()}{host}-{port}")


def _prefix() -> str:
    return f"hpms-watch-{os.getuid()}-"


def sweep(folder: str, quiet: float = 600.0) -> None:
    """Remove the boards' folders of this user's past jobs next to ``folder``: those unchanged for
    ``quiet`` seconds whose every board is of a process on this host that has exited."""
    base, now = os.path.dirname(folder), time.time()
    try:
        names = [n for n in os.listdir(base) if n.startswith(_prefix()) and os.path.join(base, n) != folder]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            boards = [BoardView.read(os.path.join(path, f)) for f in os.listdir(path)]
            if os.stat(path).st_mtime > now - quiet or any(b is None or b.alive() for b in boards):
                continue
            for f in os.listdir(path):
                os.unlink(os.path.join(path, f))
            os.rmdir(path)
        except OSError:
            continue


def process_start_ns(pid: Optional[int] = None) -> int:
    """When process ``pid`` (default: this one) started, in ``time.time_ns()`` terms (Linux ``/proc``;
    0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return int((boot + ticks / os.sysconf("SC_CLK_TCK")) * 1e9)
    except (OSError, ValueError, IndexError, StopIteration):
        return 0


def _host() -> int:
    return key_hash(socket.gethostname())


class Board:
    """This rank's board, written through shared memory (the main thread bumps counts; the
    watchdog thread sets the other fields).

    Example::

        board = Board.create(path)
        board.bump(board.slot(key_hash("c:world")))
    """

    def __init__(self, path: str, mm: mmap.mmap) -> None:
        self.path, self._mm = path, mm
        self.q = memoryview(mm).cast("q")
        self._slots: Dict[int, int] = {}

    @classmethod
    def create(cls, path: str) -> "Board":
        """Create (or take over) the board at ``path`` for this process."""
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SIZE)           # never shrinks the file under a reader
            mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        mm[:] = bytes(SIZE)
        board = cls(path, mm)
        q = board.q
        q[PID], q[STARTED], q[HEARTBEAT], q[WAITING_ON], q[HOST] = (os.getpid(), time.time_ns(), time.time_ns(),
                                                                     -1, _host())
        q[MAGIC_] = MAGIC
        return board

    def slot(self, khash: int) -> Optional[int]:
        """The index in ``q`` of the count of the key whose hash is ``khash`` (taken on first use);
        ``None`` once the board is full (the key's calls are then counted in the shared last slot)."""
        index = self._slots.get(khash)
        if index is None:
            full = len(self._slots) >= SLOTS - 1
            index = _HEADER + 2 * (SLOTS - 1 if full else len(self._slots)) + 1
            self.q[index - 1] = OVERFLOW if full else khash
            if full:
                return None
            self._slots[khash] = index
        return index

    def overflow(self) -> int:
        """The index in ``q`` of the count shared by the keys past the board's room."""
        return _HEADER + 2 * (SLOTS - 1) + 1

    def bump(self, index: int) -> int:
        """One more call on the key at ``index``; returns its count."""
        q = self.q
        q[index] += 1
        q[PROGRESS] += 1
        return q[index]

    def set_text(self, message: bool, text: str) -> None:
        """Write ``where`` (the main thread's place) or, ``message=True``, the message this rank ended with."""
        start, size = (_MESSAGE, _MESSAGE_BYTES) if message else (_WHERE, _WHERE_BYTES)
        data = text.encode(errors="replace")[:size - 1]
        self._mm[start:start + size] = data + bytes(size - len(data))


class BoardView:
    """A snapshot of a board read from its file (another rank's, or this one's).

    Example::

        view = BoardView.read(path)
        view is None or view.count(key_hash("c:world"))
    """

    def __init__(self, data: bytes) -> None:
        self.fields = struct.unpack_from(f"<{_HEADER + 2 * SLOTS}q", data)
        self._data = data

    @classmethod
    def read(cls, path: str) -> Optional["BoardView"]:
        """The board at ``path``, or ``None`` if there is none (yet) or it is not ready."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            data = os.pread(fd, SIZE, 0)
        finally:
            os.close(fd)
        if len(data) < SIZE or struct.unpack_from("<q", data)[0] != MAGIC:
            return None
        return cls(data)

    def __getitem__(self, field: int) -> int:
        return self.fields[field]

    @property
    def same_host(self) -> bool:
        """Whether the board's rank runs on this host (so its pid can be checked)."""
        return self.fields[HOST] == _host()

    def alive(self) -> bool:
        """Whether the board's process still runs (a rank on another host counts as running)."""
        if not self.same_host:
            return True
        try:
            with open(f"/proc/{self.fields[PID]}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def count(self, khash: int) -> int:
        """How many calls the rank issued on the key whose hash is ``khash`` (0 if none)."""
        for i in range(_HEADER, _HEADER + 2 * SLOTS, 2):
            if self.fields[i] == khash:
                return self.fields[i + 1]
            if self.fields[i] == 0:
                break
        return 0

    def text(self, message: bool = False) -> str:
        """The ``where`` field, or (``message=True``) the message the rank ended with."""
        start, size = (_MESSAGE, _MESSAGE_BYTES) if message else (_WHERE, _WHERE_BYTES)
        return self._data[start:start + size].split(b"\0", 1)[0].decode(errors="replace")
