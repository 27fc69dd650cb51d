"""ZeRO stages 1-3 and offload: optimizer states, gradients and parameters sharded over data-parallel ranks."""
