"""The gRPC edge: `kvtierd serve`, the KvTier servicer, its interceptor, the Events stream."""
