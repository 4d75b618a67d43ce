"""Eviction: the evictor (ownership, order), the space driver (claims, quotas, frees), the slot
table and the policies."""
