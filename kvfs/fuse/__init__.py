"""The pyfuse3 adapter (ops.py) and its Prometheus exporter: translates requests into Store
calls, nothing below the store."""
