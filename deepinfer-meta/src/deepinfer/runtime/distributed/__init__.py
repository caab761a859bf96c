"""Tensor parallelism over ``torch.distributed``: one process per device, Megatron-style shards.

``process_group`` sets the groups up and checks what can be split; ``parallel_layers`` holds the
sharded layers; ``sharded_loading`` reads only a rank's slices of the weights; ``step_channel``
carries rank 0's step inputs to the other ranks; ``worker`` is the loop the other ranks run;
``launcher`` starts them (or joins a ``torchrun`` environment) and watches them.
"""
