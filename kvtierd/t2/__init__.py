"""T2, the SSD tier: preallocated slot files, a persistent LMDB index, crash-safe two-phase stores."""
