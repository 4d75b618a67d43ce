"""Test and benchmark support: a real mount spawned and cleaned up, memory and faulty devices."""
