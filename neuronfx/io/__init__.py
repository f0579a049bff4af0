"""I/O at the edges: checkpoints (HF safetensors directories, GGUF files) and their conversion to
neuronfx weights, saved runtimes (artifacts), and the content-addressed compile cache."""
