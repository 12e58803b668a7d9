"""The node's state across layouts and tenants: pools, sessions (leases), tenants, quotas, operator operations,
config."""
