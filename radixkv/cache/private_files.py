"""Files only this server's user can touch: the disk tier's directory, its page and key files.

* :func:`secure_dir`: the directory is created with mode 0700; an existing one must be owned by
  this process's user and closed to group and others (a symlink to it only when the symlink is
  this user's too), else ``ValueError`` says what to fix (``chmod 700 DIR``, the owner's uid).
* :func:`write_new_file`: a new file, created ``O_EXCL | O_NOFOLLOW`` with mode 0600, so nothing
  already at the name (a planted symlink included) is ever followed or overwritten; a write that
  fails removes what it created and nothing else.
* :func:`read_capped`: a file opened ``O_NOFOLLOW | O_NONBLOCK``, checked with ``fstat`` to be a
  regular file of at most ``limit`` bytes *before* anything is read, then read up to the limit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time

__all__ = ["read_capped", "secure_dir", "write_new_file", "writer_alive"]

_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO never blocks


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_new_file(path: str, *parts: bytes | memoryview) -> None:
    """Create ``path`` (mode 0600, exclusively, never through a symlink) holding ``parts``.
    Raises ``OSError`` (``FileExistsError`` when anything is at ``path`` already); a failed
    write leaves no file behind."""
    fd = os.open(path, _WRITE_FLAGS, 0o600)
    try:
        for part in parts:
            _write_all(fd, part)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(path)
        raise
    os.close(fd)


def read_capped(path: str, limit: int) -> tuple[bytes | None, str | None]:
    """``(data, None)``: the bytes of the regular file ``path`` when it holds at most ``limit``
    bytes; ``(None, reason)`` when refused without reading it: ``"format"`` (a symlink, a FIFO,
    a directory...) or ``"oversize"``. Other failures raise ``OSError``."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink in the file's place: never followed
            return None, "format"
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "format"
        if st.st_size > limit:
            return None, "oversize"
        parts: list[bytes] = []
        left = limit + 1  # one more: a file that grew after the fstat is caught
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(parts)
    if len(data) > limit:
        return None, "oversize"
    return data, None


def secure_dir(path: str) -> None:
    """Create ``path`` with mode 0700 (parents as needed), or check an existing one: a directory
    (or a symlink of this user to one) owned by this user, closed to group and others. Raises
    ``ValueError`` saying what to fix."""
    me = os.geteuid()
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(path, 0o700)  # exactly 0700, whatever the umask
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != me:
            raise ValueError(
                f"disk_cache_dir={path!r} is a symlink owned by uid {st.st_uid}, not by this "
                f"server's user (uid {me}): give the real directory"
            )
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"disk_cache_dir={path!r} is not a directory")
    if st.st_uid != me:
        raise ValueError(
            f"disk_cache_dir={path!r} is owned by uid {st.st_uid}, not by this server's user "
            f"(uid {me}): `chown` it to this user or pick a directory of its own"
        )
    if st.st_mode & 0o077:
        raise ValueError(
            f"disk_cache_dir={path!r} has mode {st.st_mode & 0o777:o}: group or others may read "
            f"or plant cached KV there; run `chmod 700 {path}`"
        )


def writer_alive(stem: str, mtime: float, max_age_s: float = 3600.0) -> bool:
    """Whether the process writing the temporary file ``<name>.<pid>.<random>`` (``stem``: the
    temporary file's name without its suffix; ``mtime``: its modification time) may still be
    writing it: its pid exists (this process included: another store or writer thread of it may
    be mid-write) and the file is younger than ``max_age_s`` (no write takes that long, so an
    older one is a leftover of a dead writer whose pid was reused). A name without a readable
    pid counts as alive too (left alone). Another live process's temporary file is never ours to
    remove; a dead one's is a leftover."""
    try:
        pid = int(stem.split(".")[-2])
    except (IndexError, ValueError):
        return True
    if time.time() - mtime > max_age_s:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
