"""Tensor parallelism in the engine: rank 0 is the whole LLMEngine (scheduler, block manager, sampler) with a
driver runner that broadcasts each step; ranks 1..N-1 are follower processes that hold their weight and KV
shards and run the forward they are told to (design.md, "Tensor parallelism")."""
