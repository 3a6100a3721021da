"""``python -m benchmarks.recorder [--tiny] [CASE ...]``: only the cases of a recording's
cost over long runs and many events (11: ``torchmem run`` on long training runs, 12: many
tiny allocations, 13: a recording's fixed cost; all three unless some are named), at
full scale (or :data:`~benchmarks.suite.TINY`'s with ``--tiny``). Prints the sections;
writes no file (``python -m benchmarks`` runs them too, into RESULTS.md).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.suite import FULL, RECORDER_CASES, TINY, header, recorder_sections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cases", nargs="*", type=int, metavar="CASE", help="11, 12 or 13")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny configuration")
    args = parser.parse_args()
    if unknown := set(args.cases) - set(RECORDER_CASES):
        parser.error(f"no such case: {', '.join(map(str, sorted(unknown)))}")
    started = time.perf_counter()
    print(header().replace("`python -m benchmarks`", "`python -m benchmarks.recorder`"))
    for section in recorder_sections(TINY if args.tiny else FULL, args.cases or None):
        print("\n" + section, flush=True)
    print(f"\nWhole run: {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
