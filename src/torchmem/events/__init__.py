"""The event engine under every report of where memory went: the hooks that mark what a
tensor is (parameters, gradients, optimizer state, buffers, activations), the event logs of each
device and their replay into device runs, module peaks and allocation sites, and the
export of a log as a PyTorch memory snapshot. :mod:`torchmem.recording` (``torchmem run``,
:func:`torchmem.record`), :mod:`torchmem.estimator` and the pytest plugin are built on it.
"""
