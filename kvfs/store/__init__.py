"""The Store facade and its parts: reader, writer, handles, leases of the aware path, mount-time
loading, hooks for the tiers above."""
