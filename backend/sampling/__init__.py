"""Sampling: per-request parameters (validated at the door), the distributions they define,
and exact verification of drafted tokens against them."""
