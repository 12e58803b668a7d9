"""Generated gRPC code of proto/kvtierd/v1/kvtier.proto (built at install time by setup.py)."""
