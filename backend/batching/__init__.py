"""Continuous batching: a request's life as a sequence, and who runs each step."""
