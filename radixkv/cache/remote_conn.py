"""Where the remote KV tier's keys live: one Redis (or Valkey) server, or a Redis Cluster.

:class:`~radixkv.cache.remote_store.RemoteStore` sees either as a set of *shards*, each reached
by its own connection, and keeps an up/down state per shard:

* :class:`ServerShards` (``redis://``, ``rediss://``, ``unix://``): one shard, the server; a
  batch of reads is one ``MGET``, a batch of writes one pipeline of ``SET``s.
* :class:`ClusterShards` (``redis+cluster://HOST:PORT``, ``rediss+cluster://``): a shard per
  master of the cluster. The topology (slot -> master) comes from redis-py's
  :class:`redis.cluster.RedisCluster` (``CLUSTER SLOTS`` through any reachable node of the URL's
  and those it discovered); a key's shard is the master of its hash slot. Keys of one page are
  independent (no hash tags), so they spread over the shards, and a batch is split by shard:
  one pipeline of ``GET``s (or ``SET``s) per master, each on that master's own connection, so a
  master that is down fails only its own keys. A reply that says the slot moved (``MOVED``,
  ``ASK``) or the cluster refuses it (``CLUSTERDOWN``, ``TRYAGAIN``) is a miss for that key,
  and marks the topology stale; :meth:`ClusterShards.maintain` (called by the store's writer
  thread, never on the engine thread) asks the cluster again. While no node of the cluster has
  answered yet, the cluster is one shard named after the URL's node, down until it answers.

Invariants: :meth:`Shards.locate` never touches the network; a shard's commands raise one of
:attr:`Shards.errors` when the shard cannot be reached (the store turns it down) and otherwise
return one reply per key, an ``Exception`` standing for that key's own error. A password comes in
the URL or from ``$RADIXKV_REDIS_PASSWORD`` (the URL's own wins); every URL shown is redacted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

from radixkv.config import REMOTE_SCHEMES

__all__ = [
    "CLUSTER_SCHEMES",
    "PASSWORD_ENV",
    "SCHEMES",
    "ClusterShards",
    "ServerShards",
    "Shards",
    "is_cluster_url",
    "open_shards",
    "parse_remote_url",
    "redact_url",
]

logger = logging.getLogger("radixkv.cache.remote_store")

PASSWORD_ENV = "RADIXKV_REDIS_PASSWORD"
SCHEMES = REMOTE_SCHEMES
CLUSTER_SCHEMES = tuple(s for s in SCHEMES if "+cluster" in s)

#: A shard's answer for one key: the value, ``None`` (no such key) or that key's own error.
Reply = bytes | None | Exception


def redact_url(url: object) -> str:
    """``url`` with its credentials replaced by ``***`` (``redis://***@host:6379/0``): what
    stats, logs and error messages show, so a Redis password never leaves the process."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    # the query first: redis://h:6379?password=pw has no path, so its "?" is not after a "/"
    rest, qmark, params = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = ""
    if qmark:  # unix:///sock?password=..., redis://h/0?password=..., redis://h:6379?password=...
        query = "?" + "&".join(
            f"{k}=***" if k.lower() in ("password", "username", "user") else f"{k}={v}"
            for k, _, v in (part.partition("=") for part in params.split("&"))
        )
    return f"{scheme}://{netloc}{slash}{path}{query}"


def is_cluster_url(url: str) -> bool:
    """True for ``redis+cluster://`` and ``rediss+cluster://`` URLs."""
    return url.startswith(CLUSTER_SCHEMES)


def parse_remote_url(url: str) -> str:
    """Check a remote cache URL (``redis://HOST:PORT[/DB]``, ``rediss://``, ``unix://``, or a
    cluster's ``redis+cluster://HOST:PORT`` / ``rediss+cluster://``) and return it; raises
    ``ValueError`` saying what a valid one looks like."""
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        raise ValueError(
            f"remote_cache_url={redact_url(url)!r} is invalid: expected redis://HOST:PORT[/DB] "
            "(or rediss://..., unix:///path.sock, redis+cluster://HOST:PORT for a Redis Cluster)"
        )
    if is_cluster_url(url):
        path = url.partition("://")[2].partition("/")[2].partition("?")[0]
        if path not in ("", "0"):
            raise ValueError(
                f"remote_cache_url={redact_url(url)!r} is invalid: a Redis Cluster has only "
                "database 0 (redis+cluster://HOST:PORT)"
            )
    return url


def _client_kwargs(timeout: float) -> dict[str, Any]:
    """Connection options of every client: short timeouts, no retries (a failure turns the
    shard down at once; the store's probes bring it back)."""
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 0,
    }


class Shards:
    """The shards of a remote cache URL and the commands the store sends to one of them."""

    url: str
    #: raised by a shard's commands when it cannot be reached: the store turns it down.
    errors: tuple[type[BaseException], ...] = (OSError,)

    def names(self) -> list[str]:
        """Every shard known now."""
        raise NotImplementedError

    def locate(self, rkeys: Sequence[bytes]) -> list[str | None]:
        """The shard of each key (``None``: no shard serves its slot); no network."""
        raise NotImplementedError

    def get(self, shard: str, rkeys: list[bytes]) -> list[Reply]:
        raise NotImplementedError

    def set(self, shard: str, items: list[tuple[bytes, bytes]]) -> list[Exception | None]:
        raise NotImplementedError

    def delete(self, shard: str, rkey: bytes) -> None:
        raise NotImplementedError

    def ping(self, shard: str) -> None:
        """Raise one of :attr:`errors` unless ``shard`` answers."""
        raise NotImplementedError

    def maintain(self) -> None:
        """Background upkeep (the writer thread): refresh a stale topology. Never raises."""

    def close(self) -> None:
        raise NotImplementedError


class ServerShards(Shards):
    """One Redis / Valkey server: a single shard named by the redacted URL."""

    def __init__(self, url: str, password: str | None, timeout: float) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.name = redact_url(url)
        self.client = redis.Redis.from_url(
            url,
            password=password,  # the URL's own password wins
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            **_client_kwargs(timeout),
        )
        self.errors = (redis.RedisError, OSError)

    def names(self) -> list[str]:
        return [self.name]

    def locate(self, rkeys: Sequence[bytes]) -> list[str | None]:
        return [self.name] * len(rkeys)

    def get(self, shard: str, rkeys: list[bytes]) -> list[Reply]:
        return list(self.client.mget(rkeys))

    def set(self, shard: str, items: list[tuple[bytes, bytes]]) -> list[Exception | None]:
        pipe = self.client.pipeline(transaction=False)
        for rkey, value in items:
            pipe.set(rkey, value)
        return [r if isinstance(r, Exception) else None for r in pipe.execute(False)]

    def delete(self, shard: str, rkey: bytes) -> None:
        self.client.delete(rkey)

    def ping(self, shard: str) -> None:
        self.client.ping()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


class ClusterShards(Shards):
    """A Redis Cluster: one shard per master (``host:port``); see the module docstring.

    Thread safety: the engine thread reads (``locate``, ``get``, ``set``, ``delete``) while the
    writer thread writes, probes and refreshes; the slot map is replaced whole by redis-py, and
    connecting / refreshing is serialized by ``_lock``.
    """

    def __init__(self, url: str, password: str | None, timeout: float) -> None:
        import redis
        from redis.exceptions import RedisClusterException

        self.url = url
        self.plain_url = url.replace("+cluster://", "://", 1)
        self.password = password
        self.timeout = timeout
        hostport = self.plain_url.partition("://")[2].partition("/")[0].rpartition("@")[2]
        self.startup = hostport or "127.0.0.1:6379"
        self.client: Any = None
        self.connect_error: BaseException | None = None
        self.stale = False
        self._names: list[str] = [self.startup]
        self._lock = threading.Lock()
        self.errors = (redis.RedisError, RedisClusterException, OSError)
        try:
            self._connect()
        except self.errors as exc:  # the store starts with the cluster down; probes retry
            self.connect_error = exc

    def _connect(self) -> None:
        """Build the cluster client (discovers the topology); raises one of :attr:`errors`."""
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        with self._lock:
            if self.client is not None:
                return
            client = RedisCluster.from_url(
                self.plain_url,
                password=self.password,  # the URL's own password wins
                retry=Retry(NoBackoff(), 0),
                require_full_coverage=False,  # a master down: its slots miss, the rest serve
                **_client_kwargs(self.timeout),
            )
            self.client = client
            self._names = sorted(n.name for n in client.get_primaries())
            self.connect_error = None

    def names(self) -> list[str]:
        return list(self._names)

    def locate(self, rkeys: Sequence[bytes]) -> list[str | None]:
        client = self.client
        if client is None:
            return [self.startup] * len(rkeys)
        from redis.crc import key_slot

        slots = client.nodes_manager.slots_cache
        out: list[str | None] = []
        for rkey in rkeys:
            nodes = slots.get(key_slot(rkey))
            out.append(nodes[0].name if nodes else None)
        return out

    def _node(self, shard: str) -> Any:
        """The plain :class:`redis.Redis` of master ``shard`` (connecting first if needed)."""
        if self.client is None:
            self._connect()
        node = self.client.get_node(node_name=shard)
        if node is None:  # the topology changed since the keys were located
            self.stale = True
            raise _no_such_node(shard)
        return self.client.get_redis_connection(node)

    def _note(self, replies: list[Any]) -> None:
        from redis.exceptions import AskError, ClusterError, TryAgainError

        if any(isinstance(r, AskError | ClusterError | TryAgainError) for r in replies):
            self.stale = True  # MOVED / ASK / CLUSTERDOWN / TRYAGAIN: ask the cluster again

    def get(self, shard: str, rkeys: list[bytes]) -> list[Reply]:
        pipe = self._node(shard).pipeline(transaction=False)
        for rkey in rkeys:
            pipe.get(rkey)
        replies = pipe.execute(False)
        self._note(replies)
        return list(replies)

    def set(self, shard: str, items: list[tuple[bytes, bytes]]) -> list[Exception | None]:
        pipe = self._node(shard).pipeline(transaction=False)
        for rkey, value in items:
            pipe.set(rkey, value)
        replies = pipe.execute(False)
        self._note(replies)
        return [r if isinstance(r, Exception) else None for r in replies]

    def delete(self, shard: str, rkey: bytes) -> None:
        from redis.exceptions import ResponseError

        with contextlib.suppress(ResponseError):  # moved: the key is not there anyway
            self._node(shard).delete(rkey)

    def ping(self, shard: str) -> None:
        if self.client is None:
            self._connect()  # the URL's node answers: the topology is known now
            return
        self._node(shard).ping()
        self.stale = True  # back from down: ask the cluster who serves what now

    def maintain(self) -> None:
        if self.client is None or not self.stale:
            return
        self.stale = False
        try:
            with self._lock:
                self.client.nodes_manager.initialize()
                self._names = sorted(n.name for n in self.client.get_primaries())
        except Exception as exc:  # no node answered: keep the old map, try again later
            self.stale = True
            logger.debug("remote KV cache %s: no topology (%s)", redact_url(self.url), exc)

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()


def _no_such_node(shard: str) -> BaseException:
    from redis.exceptions import ConnectionError as RedisConnectionError

    return RedisConnectionError(f"cluster node {shard} is no longer in the slot map")


def open_shards(url: str, password: str | None, timeout: float) -> Shards:
    """The shards of ``url`` (a checked remote cache URL): a cluster or one server."""
    if is_cluster_url(url):
        return ClusterShards(url, password, timeout)
    return ServerShards(url, password, timeout)
