"""Shared leaves: errors with their errno, the size grammar, latency histograms, /proc readers.
Imports nothing else of kvfs."""
