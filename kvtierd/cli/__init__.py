"""The command lines: `kvtierd` (serve, demo, simulate) and `kvtierctl` (the operator's CLI)."""
