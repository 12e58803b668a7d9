"""scripts/gpu-acceptance: every CUDA path of kvtierd proven in one short call on a GPU machine."""
