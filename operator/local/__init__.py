"""Local mode: run a TrainingJob on one machine with worker processes (``bulkhead run``)."""
