"""kvtierd: a per-node KV-cache daemon with device, host and SSD tiers.

The core (block keys, block index, device pool, capacity) imports neither grpc nor the CLI.
"""

__version__ = "0.1.0"
