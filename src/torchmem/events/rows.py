"""The rows of a device's event stream (see :mod:`torchmem.events.tally`): their columns
and their kinds."""

from __future__ import annotations

TIME, PTR, SIZE, SITE, REF, KIND = range(6)
COLUMNS = 6
"""A row: ``time.monotonic_ns()``; address; bytes (negative for a free); site index (an
allocation), payload (a mark: ``name << 3 | category``; a probe: module index), or the
adopting tally (an adoption); the sequence number it refers to (or, for a probe, its
depth and kind, see :data:`OPEN`); and its kind."""
ALLOC, FREE, ADOPT, MARK, OPEN, HIT, CLOSE, STEP = range(8)
KINDS = ("alloc", "free", "adopt", "mark", "open", "hit", "close", "step")
"""Row kinds. A probe's :data:`PTR` is its number, its :data:`SITE` the module's index,
its :data:`REF` ``depth << 1 | backward``. A forward pass opens and closes; a backward
pass opens when the gradient of one of its outputs is ready, hits each time a gradient
of one of its inputs is, and closes when it can run no more; its span ends at the last
hit. A step row marks the end of an ``optimizer.step()`` (its :data:`PTR`: the optimizer's
id)."""
