"""The Store facade and its parts: namespace operations (names), operations on an open file
(opened), reads beside a truncate (truncation), when a file goes (lifetime), reader, writer,
handles, leases of the aware path, mount-time loading, hooks for the tiers above."""
