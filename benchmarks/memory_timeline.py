"""A script run as PyTorch's own tool draws memory by category over time: under
``torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)``, then
``export_memory_timeline`` to an HTML page (what ``torchmem run --html`` draws).

    python -m benchmarks.memory_timeline OUT.html SCRIPT [ARGS...]
"""

from __future__ import annotations

import runpy
import sys
import warnings

from torch.profiler import ProfilerActivity, profile


def main(out: str, script: str, *args: str) -> None:
    sys.argv = [script, *args]
    activities = [ProfilerActivity.CPU]
    with profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        runpy.run_path(script, run_name="__main__")
    with warnings.catch_warnings():  # deprecated since PyTorch 2.9, with no replacement on CPU
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(out, device="cpu")


if __name__ == "__main__":
    main(*sys.argv[1:])
