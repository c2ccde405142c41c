"""bulkhead.agent package."""
