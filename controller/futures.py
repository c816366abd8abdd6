"""Results of actor calls that are still being computed: `Pending` (several futures, one combined value, a
timeout on every wait) and `ActorDiedError` for a call whose actor process died."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

T = TypeVar("T")


class ActorDiedError(RuntimeError):
    """An actor process of the run died (killed, OOM, crashed)."""


class Pending(Generic[T]):
    """A result that is still being computed by one or more actors."""

    def __init__(self, futures: list[Any], combine: Callable[[list[Any]], T], timeout_s: float, what: str) -> None:
        self._futures, self._combine, self._timeout_s, self._what = futures, combine, timeout_s, what
        self._value: Any = None
        self._done = False

    def result(self) -> T:
        if not self._done:
            try:
                values = [f.get(timeout=self._timeout_s) for f in self._futures]
            except TimeoutError as e:
                raise TimeoutError(
                    f"{self._what} did not answer within {self._timeout_s:.0f}s (run.call_timeout_s); an actor "
                    "is stuck or its process died"
                ) from e
            except SupervisionError as e:
                first_line = str(e).strip().splitlines()[-1].strip()
                raise ActorDiedError(f"{self._what} failed because an actor process died: {first_line}") from e
            self._value, self._done = self._combine(values), True
        return self._value


def _rank0(values: list[Any]) -> Any:
    """Trainer endpoints return the same (already all-reduced) value on every rank; take rank 0's."""
    (value_mesh,) = values
    return next(iter(value_mesh.values()))
