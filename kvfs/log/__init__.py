"""The metadata journal and its recovery."""
