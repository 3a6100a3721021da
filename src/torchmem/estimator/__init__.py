"""``torchmem.estimate`` and ``torchmem.max_batch_size``: a step's memory on a device the
machine does not have, from one run on fake tensors."""

from torchmem.errors import EstimateError
from torchmem.estimator.api import Estimate, estimate, max_batch_size

__all__ = ["Estimate", "EstimateError", "estimate", "max_batch_size"]
