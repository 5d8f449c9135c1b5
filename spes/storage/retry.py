"""One retry policy for every storage call: which errors are worth another try, how long to wait, and the log.

Retried: what a busy or unreachable storage service raises (timeouts, refused or reset connections, an
S3 5xx that s3fs reports as an I/O error, botocore's and aiohttp's transport errors). Never retried:
answers that say something definite (a file that is missing or exists, no permission, bad credentials),
our own errors and programming errors (a TypeError surfaces at once, not 7.5 s later as "unavailable").
"""
from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from spes.errors import SpesError, StoreUnavailable

log = logging.getLogger("spes.storage")
T = TypeVar("T")

DEFINITE_OS_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
"""OSErrors that describe the data or the caller's rights: the same on every try."""
TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                    errno.ECONNABORTED, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EBUSY, None}
NEVER_RETRIED_NAMES = {"NoCredentialsError", "PartialCredentialsError", "NoRegionError", "ParamValidationError",
                       "InvalidConfigError", "UnknownServiceError"}
"""botocore errors that cannot change on a retry (missing credentials or a bad configuration)."""
TRANSIENT_BASES = {"BotoCoreError", "ClientError", "ServerDisconnectedError", "ClientConnectionError",
                   "ClientPayloadError", "ConnectTimeoutError", "ReadTimeoutError", "EndpointConnectionError"}
"""botocore/aiohttp transport errors, matched by class name so that this module imports neither."""


def is_access_denied(e: BaseException) -> bool:
    """A refused request or missing credentials: definite, and the user's to fix (one line, see FileStore)."""
    return isinstance(e, PermissionError) or bool({c.__name__ for c in type(e).__mro__} & NEVER_RETRIED_NAMES)


def is_transient(e: BaseException) -> bool:
    """Whether another try of the same call can succeed."""
    if isinstance(e, SpesError):
        return False
    names = {c.__name__ for c in type(e).__mro__}
    if names & NEVER_RETRIED_NAMES:
        return False
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    if isinstance(e, DEFINITE_OS_ERRORS):
        return False
    if isinstance(e, OSError):
        return e.errno in TRANSIENT_ERRNOS
    return bool(names & TRANSIENT_BASES)


@dataclass
class RetryPolicy:
    retries: int = 4
    backoff_s: float = 0.5
    where: str = "storage"

    def call(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs), tried again after a transient error (each retry logged), then StoreUnavailable."""
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if not is_transient(e):
                    raise
                if attempt == self.retries:
                    raise StoreUnavailable(f"{self.where}: {what} failed after {attempt + 1} tries: "
                                           f"{type(e).__name__}: {e}") from None
                wait = self.backoff_s * 2 ** attempt
                log.warning("%s: %s failed (%s: %s); retry %d/%d in %.1fs", self.where, what, type(e).__name__, e,
                            attempt + 1, self.retries, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")
