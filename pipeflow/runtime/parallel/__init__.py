"""The parallelisms inside a stage and the mesh they share: tensor parallelism (and LoRA under
it), expert parallelism and its routing, FSDP2 and ZeRO-1 over dp, the context-parallel ring, and
the device mesh with its order of dimensions."""
