"""kvfs: a FUSE filesystem that owns raw NVMe devices and serves LLM KV-cache chunks
as ordinary files. See README.md and docs/design.md."""

__version__ = "0.2.0"
