"""Errors the driver raises when a worker call fails, keeping the worker's exception type.

A worker that raises `ValueError("bad")` in `compute_values` on rank 3 surfaces on the driver as a
`WorkerError` that is *also* a `ValueError`, so `except ValueError` still works, with a message
that names the rank and the method and keeps the worker's traceback. A worker process that dies
surfaces the same way as a `WorkerError` that is also Ray's `ActorDiedError`.
A call that passes its deadline (`CallDeadline`: the seconds and the recipe setting that gives
them) surfaces as a `CallTimeout` naming the rank, the method and that setting.
"""

from __future__ import annotations

from dataclasses import dataclass


class WorkerError(Exception):
    """A worker-group call failed on one rank.

    Raised instances are dynamically subclassed from the original exception type as well (see
    `worker_error`), so callers catch either `WorkerError` or the original type. Attributes:
    `rank`, `method`, `cause` (the original exception, or Ray's error when the process died).
    """

    def __init__(self, message: str, rank: int, method: str, cause: BaseException | None = None):
        # Only BaseException's initialiser: the original type's may expect other arguments.
        BaseException.__init__(self, message)
        self.rank = rank
        self.method = method
        self.cause = cause


class UnregisteredMethodError(AttributeError):
    """A worker-group attribute names a worker method that is not decorated with `@register`."""


def worker_error(err: BaseException, rank: int, method: str) -> WorkerError:
    """The error to raise on the driver for `err`, raised by `ray.get` for `rank`'s `method` call.

    The result is an instance of `WorkerError` and of the original exception's type (the user
    exception inside a `RayTaskError`, else Ray's own error such as `ActorDiedError`).
    """
    import ray.exceptions  # only the Ray backend calls this; the in-process one runs without Ray

    if isinstance(err, ray.exceptions.RayTaskError):
        original = err.cause
        message = (
            f"`{method}` raised on rank {rank}: {type(original).__name__}: {original}\n"
            f"worker traceback:\n{err}"
        )
    else:
        original = err
        message = f"`{method}` failed on rank {rank}: the worker process died or became unreachable: {err}"
    return _as_worker_error(original, message, rank, method)


def _as_worker_error(original: BaseException, message: str, rank: int, method: str) -> WorkerError:
    original_type = type(original)
    if issubclass(original_type, WorkerError):
        original_type = Exception
    try:
        dual = type(
            f"WorkerError[{original_type.__name__}]",
            (WorkerError, original_type),
            {"__str__": _message_str, "__getattr__": _delegate_to_cause, "__module__": __name__},
        )
        error = dual.__new__(dual, message)
    except TypeError:  # a type that cannot be subclassed or built from one message
        error = WorkerError.__new__(WorkerError, message)
    WorkerError.__init__(error, message, rank, method, original)
    return error


def _message_str(self: WorkerError) -> str:
    return self.args[0]


def _delegate_to_cause(self: WorkerError, name: str):
    # Attributes of the original exception (e.g. `errno`, Ray's `actor_id`) stay reachable.
    if name in ("cause", "rank", "method") or name.startswith("__"):
        raise AttributeError(name)
    return getattr(self.cause, name)


@dataclass(frozen=True)
class CallDeadline:
    """How long a blocking worker-group call may run, and the recipe setting that says so."""

    seconds: float
    setting: str  # named in the CallTimeout, e.g. "trainer.worker_call_timeout_s"


# A group built without one (tests, tools): the default of trainer.worker_call_timeout_s.
DEFAULT_DEADLINE = CallDeadline(3600.0, "trainer.worker_call_timeout_s")


class CallTimeout(TimeoutError):
    """A worker-group call found a rank still running at its deadline (`rank`, `method`)."""

    def __init__(self, message: str, rank: int, method: str):
        super().__init__(message)
        self.rank, self.method = rank, method


def call_timeout(worker: str, rank: int, method: str, deadline: CallDeadline, what: str = "") -> CallTimeout:
    """The one-line error of a call still running on `rank` at its deadline."""
    return CallTimeout(
        f"{worker} rank {rank} did not answer `{method}` within {deadline.seconds:g}s{what} "
        f"({deadline.setting}: raise it if the call is only slow)",
        rank,
        method,
    )
