"""Reporters: publish each tick's result (Node condition, Events, Prometheus metrics)."""
