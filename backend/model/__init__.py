"""The target and drafter models: a compact Llama/Qwen-family transformer, its checkpoint loader
and tokenizer, the paged KV cache it reads and writes, and the attention backends."""
