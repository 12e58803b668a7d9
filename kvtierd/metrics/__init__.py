"""Prometheus metrics of the daemon: the registry, the scrape-time collector, per-tenant gauges."""
