"""Speculation: one proposer interface (the in-process drafter, the drafter worker on its own
device), the manager that keeps proposing failure-tolerant, and the strategies that use them
(plain decoding, sequential SD, batch-parallel SD)."""
