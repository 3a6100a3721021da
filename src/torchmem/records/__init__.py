"""Records: what torchmem measured, as plain frozen dataclasses and named tuples.

They sit on the bottom floor: collectors build them, renderers read them, front ends
pass them along, and they import nothing of torchmem but :mod:`torchmem.units`. Sizes are int bytes
unless a field says otherwise.
"""

TOP = 10
"""How many entries of each list (sites, allocations, modules, segments) a report shows
unless asked for another number; the records keep more, the renderers cut."""
