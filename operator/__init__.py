"""bulkhead.operator package."""
