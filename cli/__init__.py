"""Command-line entry point of bulkhead (thin; sub-commands live with their components)."""
