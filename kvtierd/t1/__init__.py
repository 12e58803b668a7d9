"""T1, the host tier: fixed-size slots of pinned (or shared) host DRAM, and its [host] section."""
