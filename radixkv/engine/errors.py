"""Errors the engine raises for a request the caller can fix, naming what to fix.

:class:`ParamError` is a ``ValueError`` (callers that catch ``ValueError`` keep working) that
carries the request field it is about, so the server answers a 400 whose ``param`` names that
field without reading the message. It has no imports: the torch-free request models
(:mod:`radixkv.engine.logits_fields`, :mod:`radixkv.engine.sampling`) raise it too.
"""

from __future__ import annotations

__all__ = ["ParamError"]


class ParamError(ValueError):
    """A request field holds a value the engine refuses: ``field`` names it (``"top_p"``,
    ``"logit_bias"``), the message (``str(exc)``) says what to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[ParamError], tuple[str, str]]:
        # pickled (a worker process's error) with both arguments, not ValueError's one
        return type(self), (self.field, str(self))
