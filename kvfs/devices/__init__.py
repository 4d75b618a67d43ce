"""Devices, their identity, the pool of members and the extent allocator."""
