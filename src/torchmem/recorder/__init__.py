"""Recording a run: where a script's or a block's memory went (``torchmem run``,
:func:`torchmem.record`)."""

from torchmem.recorder.session import Recording, RunReport, record

__all__ = ["Recording", "RunReport", "record"]
