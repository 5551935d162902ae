"""raydirect's transports: the plug-in interface (``base``), the registry, and the
built-ins, each imported on first use (importing raydirect never imports NIXL or CUDA)."""
