"""Memory techniques: where the bytes of a training step wait, never what is computed.

linear_ce    memory.loss=chunked: the LM head and the loss over chunks of targets
tiled_mlp    memory.tiled_mlp: each decoder MLP over tiles of the sequence, each tile a checkpoint
activation_offload  memory.activation_offload: saved activations (and checkpointed layers' inputs) in host RAM
activation_disk     memory.activation_offload=disk: the checkpointed layers' inputs in files (an NVMe disk)
optimizer_offload   memory.optimizer_offload: AdamW's state and step in host RAM (HostAdamW)
stream       memory.base_weights: frozen 4-bit layers streamed from CPU RAM or an NVMe file
host_tables  memory.embeddings=cpu: frozen embedding table and LM head in host RAM
apply        the ordered apply step: kernels -> offloaded checkpoint -> tiled MLP -> compile ->
             streaming -> host tables, each step with the reason it stands there
"""
