"""Every error the service raises to a client, in one module.

Imported by the supervisor side and the HTTP handlers alike, so no handler
needs the entry point. Each error carries its HTTP status and a stable code;
`frontend/base.py` turns it into the one JSON error body. Imports nothing of
the project.
"""
from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """An error with an HTTP status and a code, raised to the handlers."""

    status = 500
    code = "internal"

    def __init__(self, message: str, status: int | None = None, code: str | None = None,
                 details: dict[str, Any] | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.details = details or {}


class NoModel(ServiceError):
    status, code = 503, "no_model"


class UnknownModel(ServiceError):
    """A request named a model that does not serve here."""
    status, code = 404, "model_not_serving"


class Overloaded(ServiceError):
    status, code = 503, "overloaded"


class ApplyFailed(ServiceError):
    status, code = 422, "model_load_failed"


class Conflict(ServiceError):
    """Refused because of the service's state (memory budget, quality gate...)."""
    status, code = 409, "conflict"


class StorageFailed(ServiceError):
    """A durable write failed, so nothing changed: 507 when the disk is full
    (ENOSPC, EDQUOT), 503 for any other I/O error. `details` says what and where."""
    status, code = 503, "store_unavailable"


# -- the model store ------------------------------------------------------------
class StoreError(Exception):
    pass


class NotFound(StoreError):
    pass


class InvalidName(StoreError):
    pass


class InvalidArtifact(StoreError):
    """The version exists but cannot be a loadable model."""
