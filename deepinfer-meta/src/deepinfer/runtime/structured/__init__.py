"""Structured outputs: ``StructuredOutputsParams`` (what an output must match), the grammar
compiler on xgrammar (``backend``: compiled once per schema, cached) and the per-step token
bitmask of the structured rows (``manager``), applied by the sampler before it draws."""

from deepinfer.runtime.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
