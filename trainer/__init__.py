"""bulkhead.trainer package."""
