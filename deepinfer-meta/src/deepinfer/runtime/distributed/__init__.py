"""Tensor parallelism over ``torch.distributed``: one process per device, Megatron-style shards.

``parallel.process_group`` sets the groups up and checks what can be split; ``parallel.layers``
holds the sharded layers; ``loading.sharded_loading`` reads only a rank's slices of the weights;
``step_channel`` carries rank 0's step inputs to the other ranks; ``rank`` is what the other
ranks run (``python -m deepinfer.runtime.distributed.rank``: build the same ``Worker`` as rank 0,
then serve its steps); ``driver`` is rank 0's runner that announces each step; ``launcher``
starts the ranks (or joins a ``torchrun`` environment) and watches them.
"""
