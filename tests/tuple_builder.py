"""A thread building tuples beside a walk of every object: what a walk must never break."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator


def building_tuples_beside(walk: Callable[[], object], walks: int) -> list[BaseException]:
    """Run `walk` `walks` times while another thread builds tuples from a generator, with
    the GIL passed every microsecond; the errors the builder met."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def items() -> Iterator[int]:
        yield from range(50)  # past tuple()'s first guess of 10: the tuple grows

    def build() -> None:
        while not stop.is_set():
            try:
                tuple(items())
            except SystemError as exc:
                errors.append(exc)
                return

    interval = sys.getswitchinterval()
    builder = threading.Thread(target=build)
    sys.setswitchinterval(1e-6)
    try:
        builder.start()
        for _ in range(walks):
            if errors:
                break
            walk()
    finally:
        stop.set()
        builder.join()
        sys.setswitchinterval(interval)
    return errors
