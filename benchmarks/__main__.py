"""``python -m benchmarks``: run every case, print its tables, write RESULTS.md."""

from benchmarks import suite

suite.RESULTS.write_text(suite.run())
print(f"\nWrote {suite.RESULTS}")
