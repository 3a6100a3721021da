"""Another ``sys.settrace`` tracer (a debugger, coverage.py) beside the line profiler."""

from __future__ import annotations

import types
from collections.abc import Callable


class TracerStandIn:
    """Another tracer (a debugger, coverage) for the line profiler's tests: records the
    events of some functions, as ``sys.settrace`` hands them."""

    def __init__(self, *functions: Callable[..., object]) -> None:
        self.codes = {f.__code__ for f in functions}
        self.events: list[tuple[str, str, int]] = []

    def __call__(self, frame: types.FrameType, event: str, arg: object) -> TracerStandIn | None:
        if frame.f_code not in self.codes:
            return None
        self.events.append((frame.f_code.co_name, event, frame.f_lineno))
        return self
