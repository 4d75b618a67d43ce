"""The namespace index: inodes, directories, xattrs over copy-on-write columns, and the checks
fsck shares."""
