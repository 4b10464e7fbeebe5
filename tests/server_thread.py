"""A real uvicorn server on a free loopback port, in a background thread (used by the tests;
``fake_engine`` re-exports it, where the tests import it from)."""

from __future__ import annotations

import time
from typing import Any


class ServerThread:
    """Runs ``app`` with uvicorn on ``127.0.0.1:<free port>`` in a daemon thread.

    ``start()`` returns once ``/health`` answers 200; ``stop()`` shuts uvicorn down (its lifespan
    stops the engine thread). Usable as a context manager.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        import socket

        import uvicorn

        self.app = app
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            app, host=host, port=self.port, log_level="warning", lifespan="on", access_log=False
        )
        self.server = uvicorn.Server(config)
        self._thread: Any = None

    @property
    def base_url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start uvicorn and wait until ``/health`` answers."""
        import threading

        import httpx

        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn exited during startup")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server on {self.base_url} did not become healthy in {timeout} s")

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
