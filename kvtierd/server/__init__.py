"""The gRPC edge: `kvtierd serve` and its configuration (daemon_config.py), the KvTier servicer, its
interceptor, the Events stream."""
