"""Metrics: what the server reports about its own load and activity."""
