import platform

import torch

from benchmarks import meters

print(f"Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}")
print()
print("Tensor meter overhead (median of 5, same process, alternating):")
print(meters.table(meters.measure()))
