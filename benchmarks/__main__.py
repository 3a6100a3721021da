import platform

import torch

from benchmarks import lines, meters

print(f"Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}")
print()
print("Tensor meter overhead (median of 5, same process, alternating):")
print(meters.table(meters.measure()))
print()
print(f"Line profiler overhead (median of 7, same process, alternating; {lines.versions()}):")
rows = lines.measure()
print(lines.table(rows))
print()
print("Targets for torchmem's LineProfiler (ratio to unprofiled):")
print(lines.targets(rows))
