"""The tracer's report line, exactly as fastai prints it."""

from __future__ import annotations

from collections.abc import Sequence


def text(used_mb: int, peaked_mb: int, notes: Sequence[str] = ()) -> str:
    """``△Used Peaked MB:     10      5 (ctx: subctx)``: delta used and delta peaked in
    whole MB, then the non-empty `notes` joined with ``: `` in parentheses."""
    line = f"△Used Peaked MB: {used_mb:6,.0f} {peaked_mb:6,.0f}"
    notes = [note for note in notes if note]
    return f"{line} ({': '.join(notes)})" if notes else line
