"""A site alive at a peak: a source line, the bytes its allocations held there, and the
Python stacks that led to it (a record of :mod:`torchmem.records.run` and
:mod:`torchmem.records.snapshot`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torchmem.records.frames import Frame, Stack


class SiteStack(NamedTuple):
    """One way to a site's line: a Python stack, and the bytes allocated through it."""

    bytes: int
    """Bytes allocated with this stack and alive at the peak."""
    stack: Stack
    """Innermost frame first, as ``(file, line, function)``: the site's line, the library
    lines it called and the callers that led to it."""


@dataclass(frozen=True)
class Site:
    """A source line whose allocations were alive at the peak: the innermost frame of the
    user's own code (see :mod:`torchmem.records.frames`)."""

    file: str
    """The source file; ``<before recording>`` for memory allocated before the recording
    started, ``<no Python frame>`` for allocations made by threads Python does not run
    (PyTorch's intra-op workers), ``backward of <module> (<class>)`` (``backward`` where
    no module is known) for those autograd's engine made while computing that module's
    gradients."""
    line: int
    """The line number (0 for the pseudo files above)."""
    function: str
    """The function's qualified name, ``<module>`` for a script's top level."""
    bytes: int
    """Bytes allocated there and alive at the peak."""
    stacks: tuple[SiteStack, ...] = field(default=(), compare=False)
    """The Python stacks of its allocations alive at the peak, each once with the bytes
    allocated through it, largest first: a line reached from two callers has two. They
    sum to :attr:`bytes` where every allocation kept its stack; empty where none did (the
    pseudo files, memory whose stack was not recorded)."""
    source: str | None = field(default=None, compare=False)
    """The text of the line, stripped (``"h = torch.relu(self.fc1(x))"``), read when the
    report was made; None for the pseudo files and where the file cannot be read."""

    @property
    def stack(self) -> Stack:
        """The stack of the most bytes (the first of :attr:`stacks`); empty where none."""
        return self.stacks[0].stack if self.stacks else ()

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "bytes": self.bytes,
            "stack": _stack_json(self.stack),
            "stacks": [{"bytes": s.bytes, "stack": _stack_json(s.stack)} for s in self.stacks],
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Site:
        """The site that :meth:`to_json` wrote (``stacks``, ``stack`` and ``source`` may be
        missing: older reports, whose ``stack`` was the first one seen, stand for all the
        site's bytes)."""
        stacks = tuple(SiteStack(s["bytes"], _stack(s["stack"])) for s in data.get("stacks", ()))
        if "stacks" not in data and data.get("stack"):
            stacks = (SiteStack(data["bytes"], _stack(data["stack"])),)
        source = data.get("source")
        return cls(data["file"], data["line"], data["function"], data["bytes"], stacks, source)


def _stack_json(stack: Stack) -> list[list[Any]]:
    return [list(frame) for frame in stack]


def _stack(data: Any) -> Stack:
    return tuple((str(f), int(n), str(fn)) for f, n, fn in data)


def stacks_of(sizes: dict[Stack, int]) -> tuple[SiteStack, ...]:
    """The stacks of `sizes` (bytes by stack), largest first (then by stack, so that a report
    reads the same each time), leaving out the empty stack (none was kept) and stacks of
    no bytes."""
    found = [SiteStack(size, stack) for stack, size in sizes.items() if stack and size]
    return tuple(sorted(found, key=lambda s: (-s.bytes, s.stack)))


def sites_of(sizes: dict[tuple[Frame, Stack], int], frames: int) -> tuple[tuple[Site, ...], int]:
    """The sites of `sizes` (bytes by site and stack), largest first, each with its stacks
    while `frames` frames in all last (a stack past them is left out); and the frames left."""
    grouped: dict[Frame, dict[Stack, int]] = {}
    for (key, stack), size in sizes.items():
        grouped.setdefault(key, {})[stack] = size
    found = []
    for key, stacks in sorted(grouped.items(), key=lambda s: sum(s[1].values()), reverse=True):
        kept = []
        for each in stacks_of(stacks):
            if len(each.stack) <= frames:
                frames -= len(each.stack)
                kept.append(each)
        if sum(stacks.values()):
            found.append(Site(*key, sum(stacks.values()), tuple(kept)))
    return tuple(found), frames
