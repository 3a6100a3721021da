"""Renderers: records in, text (or HTML, figures) out. They never measure."""
