"""Helpers shared by several test modules (fixtures themselves live in tests/conftest.py)."""
