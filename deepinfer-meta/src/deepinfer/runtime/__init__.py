"""The DeepInfer runtime: ``LLM``, ``SamplingParams`` and the Python serving loop on the C++ engine.

Importing this package is cheap; torch loads with the modules that need it.
"""
