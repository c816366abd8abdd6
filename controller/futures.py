"""Results of actor calls that are still being computed: `Pending` (several futures, one combined value, a
timeout on every wait) and `ActorDiedError` for a call whose actor process died."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

T = TypeVar("T")


class ActorDiedError(RuntimeError):
    """An actor process of the run died (killed, OOM, crashed). `who`: which one, where known ("trainer rank 1
    (pid 4242)"), else "an actor process"."""

    def __init__(self, message: str, who: str = "an actor process") -> None:
        super().__init__(message)
        self.who = who


class ActorFrozenError(RuntimeError):
    """An actor process stopped answering its heartbeat: frozen or hung, not dead."""


class CollectiveRankError(RuntimeError):
    """A rank of a mesh raised inside a collective call while its other ranks were still in it: they waited for it
    in a collective and were stopped (controller/replicas.py, `call_collective`). The message starts with the rank's
    own error."""


class Pending(Generic[T]):
    """A result that is still being computed by one or more actors. `dead`: names the processes of those actors
    that are gone ("trainer rank 1 (pid 4242)"; None: none found), asked when a call fails, so that a death names
    its process, and an error raised by a survivor of a death (a collective whose peer is gone) is told as the
    death it is."""

    def __init__(
        self,
        futures: list[Any],
        combine: Callable[[list[Any]], T],
        timeout_s: float,
        what: str,
        dead: Callable[[], str | None] | None = None,
    ) -> None:
        self._futures, self._combine, self._timeout_s, self._what = futures, combine, timeout_s, what
        self._dead = dead
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
                last_line = str(e).strip().splitlines()[-1].strip()
                who = (self._dead() if self._dead else None) or "an actor process"
                raise ActorDiedError(f"{self._what} failed because {who} died: {last_line}", who) from e
            except (ActorDiedError, ActorFrozenError, CollectiveRankError):
                raise
            except Exception as e:  # an error the actor raised: its own (a full disk), or a peer's death seen by it
                who = self._dead() if self._dead else None
                if who is None:
                    raise
                raise ActorDiedError(
                    f"{self._what} failed because {who} died (a surviving process said: "
                    f"{type(e).__name__}: {_first_line(e)})",
                    who,
                ) from e
            self._value, self._done = self._combine(values), True
        return self._value


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _rank0(values: list[Any]) -> Any:
    """Trainer endpoints return the same (already all-reduced) value on every rank; take rank 0's."""
    (value_mesh,) = values
    return next(iter(value_mesh.values()))
