"""DeepInfer's Ascend NPU backend.

The native module ``deepinfer_ascend._native`` (submodules ``cuda_utils`` and
``graph_timer``) is loaded through the plugin (``deepinfer_ascend.plugin``) once the
registry picked this backend; ``libascendcl.so`` is opened at run time, never linked.
"""

__version__ = "0.1.0"
