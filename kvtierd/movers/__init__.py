"""Where bytes move: the copy engines (CUDA streams, or threads), block codecs and the kernels' wrappers."""
