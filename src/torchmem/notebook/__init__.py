"""Notebook support: the IPython extension, its magics and the per-cell memory logger."""
