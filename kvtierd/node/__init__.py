"""The node's state across layouts and tenants: pools (and the [pool] section), sessions (leases), tenants,
quotas, operator operations."""
