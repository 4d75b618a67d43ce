"""Every byte kvfs writes to a device, in one package; ``docs/format.md`` is its
specification and these modules are its executable form (pure: encode, decode and
offsets, no I/O):

- :mod:`~kvfs.format.superblock`: the superblock and member table
  (``FORMAT_VERSION``), and the foreign signatures ``format`` refuses to overwrite;
- :mod:`~kvfs.format.geometry`: a new pool's unit size, metadata area size and
  data start of each device;
- :mod:`~kvfs.format.halves`: the metadata area's two log halves and a whole
  checkpoint;
- :mod:`~kvfs.format.records`: journal entries (``ENTRY_VERSION``), the operations
  they carry, unit addresses and fragment tails;
- :mod:`~kvfs.format.nsimage`: the namespace image, the checkpoint's columns
  (``nsimage.VERSION``), from and into the plain records and sizes of
  :mod:`~kvfs.format.nsparts`;
- :mod:`~kvfs.format.policy_image`: the eviction policy's image
  (``policy_image.FORMAT_VERSION`` for the blob of older pools, its pieces'
  version for today's);
- :mod:`~kvfs.format.owners`: the evictor's owners pieces and older pools' blobs.

The package imports none of its modules eagerly: each is imported by name.
"""
