"""T0, the device pool: one block-major tensor in GPU memory (CUDA IPC) or POSIX shared memory, mapped by runners."""
