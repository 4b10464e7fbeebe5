"""Authenticated page values of the disk and remote tiers: the header layout, its MAC, the secret.

A page's key (:func:`~radixkv.cache.disk_store.chain_hashes`) can be computed by anyone who knows
the model and the tokens, so whoever can write to the cache directory or to Redis could plant KV
for a common prefix and change every replica's outputs. Every stored value therefore carries an
HMAC-SHA256 keyed by a secret only the replicas hold::

    header  = struct "<8sI32s32sQI32s": magic (b"RKVPAGE2" on disk, b"RKVREM02" in Redis),
              format version (2), fingerprint (32 B), key (32 B), payload length,
              crc32 of the payload, mac (32 B)
    mac     = HMAC-SHA256(secret, the header's first 88 bytes (every field but the mac) + payload)
    value   = header + payload

:func:`verify` checks, in order (the first failure is the reason, counted as ``corrupt_<reason>``
by the stores): ``truncated`` (shorter than a header, or a length that does not match),
``format`` (another magic or version: files of an older release are simply misses), then
``fingerprint`` and ``key`` (another model's page, or a page under another page's name),
``checksum`` (crc32: accidental damage), ``mac`` (written with another secret, or forged). MACs
are compared with :func:`hmac.compare_digest`.

The secret (:func:`configured_mac_key`, then the stores' defaults):

1. ``EngineConfig.kv_mac_key_file`` (``radixkv serve --kv-mac-key-file FILE``): a file holding
   at least :data:`MIN_KEY_BYTES` bytes (surrounding whitespace ignored; ``openssl rand -hex 32``),
   readable by its owner only;
2. else the environment variable :data:`MAC_KEY_ENV` (the secret itself);
3. else, with a disk tier, :data:`KEY_FILE_NAME` in the cache directory, created on first start
   (mode 0600, never over an existing file) and reused after restarts; the remote tier uses the
   disk tier's secret;
4. else (remote tier only) a random secret of this process, with a warning: replicas then do not
   share Redis values unless they share a secret (``radixkv cluster`` gives all of its replicas
   one key file).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
import threading
import zlib

from radixkv.cache.private_files import write_new_file

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "KEY_FILE_NAME",
    "MAC_KEY_ENV",
    "MIN_KEY_BYTES",
    "REASONS",
    "configured_mac_key",
    "create_secret_file",
    "dir_mac_key",
    "process_mac_key",
    "read_key_file",
    "seal",
    "verify",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
_FIELDS = struct.Struct("<8sI32s32sQI")  # every header field but the mac
HEADER = struct.Struct("<8sI32s32sQI32s")
MAC_KEY_ENV = "RADIXKV_KV_MAC_KEY"
KEY_FILE_NAME = "kv_mac.key"
MIN_KEY_BYTES = 16
#: why a value is refused, in the order :func:`verify` checks
REASONS = ("truncated", "format", "fingerprint", "key", "checksum", "mac")

_process_key: bytes | None = None
_process_lock = threading.Lock()


def _mac(secret: bytes, fields: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    h = hmac.new(secret, fields, hashlib.sha256)
    h.update(payload)
    return h.digest()


def seal(
    magic: bytes, fingerprint: bytes, key: bytes, payload: bytes | memoryview, secret: bytes
) -> bytes:
    """The header of ``payload`` stored under ``key``: its fields, then their MAC."""
    fields = _FIELDS.pack(
        magic, FORMAT_VERSION, fingerprint, key, len(payload), zlib.crc32(payload)
    )
    return fields + _mac(secret, fields, payload)


def verify(
    value: bytes | memoryview,
    magic: bytes,
    fingerprint: bytes,
    key: bytes,
    secret: bytes,
    expect_len: int | None = None,
) -> str | None:
    """Why ``value`` (header + payload) is not a valid page for ``key`` (one of
    :data:`REASONS`), or None when it is. ``expect_len``: the payload length a page must have."""
    view = memoryview(value)
    if len(view) < HEADER.size:
        return "truncated"
    vmagic, version, fp, vkey, length, crc, mac = HEADER.unpack_from(view)
    if vmagic != magic or version != FORMAT_VERSION:
        return "format"
    if fp != fingerprint:
        return "fingerprint"
    if vkey != key:
        return "key"
    if len(view) - HEADER.size != length or (expect_len is not None and length != expect_len):
        return "truncated"
    payload = view[HEADER.size :]
    if zlib.crc32(payload) != crc:
        return "checksum"
    if not hmac.compare_digest(mac, _mac(secret, view[: _FIELDS.size], payload)):
        return "mac"
    return None


# ---------------------------------------------------------------------- the secret
def _check_secret(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(
            f"the KV MAC key from {where} has {len(secret)} bytes; it needs at least "
            f"{MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return secret


def read_key_file(path: str | os.PathLike[str], follow: bool = True) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped). The file must be a regular file
    of this user, closed to group and others; ``follow=False`` also refuses a symlink. Raises
    ``ValueError`` saying what to fix (``FileNotFoundError`` when it does not exist)."""
    name = os.fspath(path)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueError(f"cannot open the KV MAC key file {name}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"the KV MAC key file {name} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(
                f"the KV MAC key file {name} is owned by uid {st.st_uid}, not by this server's "
                f"user (uid {os.geteuid()}): chown it or use a key file of your own"
            )
        if st.st_mode & 0o077:
            raise ValueError(
                f"the KV MAC key file {name} has mode {st.st_mode & 0o777:o}: group or others "
                f"may read or change it; run `chmod 600 {name}`"
            )
        secret = f.read(1 << 16).strip()
    return _check_secret(secret, name)


def create_secret_file(path: str | os.PathLike[str]) -> bytes:
    """Write a fresh random secret (64 hex digits and a newline) to the new file ``path``:
    mode 0600, created exclusively (never over an existing file or through a symlink). Returns
    the secret."""
    secret = secrets.token_hex(32).encode()
    write_new_file(os.fspath(path), secret + b"\n")
    return secret


def configured_mac_key(key_file: str | os.PathLike[str] | None = None) -> bytes | None:
    """The secret given by configuration: ``key_file`` when set, else the environment variable
    :data:`MAC_KEY_ENV`; None when neither is."""
    if key_file is not None:
        try:
            return read_key_file(key_file)
        except FileNotFoundError:
            raise ValueError(f"kv_mac_key_file={os.fspath(key_file)!r} does not exist") from None
    env = os.environ.get(MAC_KEY_ENV)
    if env:
        return _check_secret(env.strip().encode(), f"${MAC_KEY_ENV}")
    return None


def dir_mac_key(directory: str | os.PathLike[str]) -> bytes:
    """The secret of the cache directory: :data:`KEY_FILE_NAME` in it, created on first use
    (written under a temporary name, then hard-linked into place, so a concurrent start sees a
    whole file or none and the first one wins)."""
    path = os.path.join(os.fspath(directory), KEY_FILE_NAME)
    with contextlib.suppress(FileNotFoundError):
        return read_key_file(path, follow=False)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    create_secret_file(tmp)
    created = True
    try:
        os.link(tmp, path)
    except FileExistsError:
        created = False  # another process created it first: use that one
    except OSError:  # no hard links on this filesystem
        os.rename(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    if created:
        logger.info("KV MAC key created: %s (mode 0600; copy it to replicas that share)", path)
    return read_key_file(path, follow=False)


def process_mac_key() -> bytes:
    """A random secret of this process (one for all of its stores), with a warning the first
    time: replicas do not share remote values signed with it."""
    global _process_key
    with _process_lock:
        if _process_key is None:
            _process_key = secrets.token_bytes(32)
            logger.warning(
                "remote KV cache: no shared KV MAC key (kv_mac_key_file / --kv-mac-key-file, "
                "$%s, or a disk tier's %s): this process signs its pages with a random key, so "
                "replicas will not share Redis values",
                MAC_KEY_ENV,
                KEY_FILE_NAME,
            )
        return _process_key
