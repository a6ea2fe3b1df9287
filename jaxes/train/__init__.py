"""ES training: config validation, checkpointing, metrics, the trainer loop and the CPU demo."""
