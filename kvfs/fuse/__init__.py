"""The pyfuse3 adapter (ops.py), the session that serves it (session.py), its request
counters (counters.py) and its Prometheus exporter (metrics.py): translates requests into
Store calls, nothing below the store."""
