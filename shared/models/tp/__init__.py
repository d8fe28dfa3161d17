"""Tensor-parallel building blocks (Megatron's split, as nano-vllm and vLLM use it): column-parallel linears
(q/k/v, gate/up: each rank computes its slice of the outputs), row-parallel linears (o, down: each rank
multiplies its slice of the inputs, one all-reduce sums them), a vocabulary-parallel embedding and output head.

Every layer here is used only when the degree is above one: a TP=1 model is built of plain nn.Linear and
nn.Embedding exactly as before (shared/models/llama.py), so it pays for nothing.
"""
