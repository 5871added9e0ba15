"""Data: synthetic tasks, their TFDS builders, prompt streams and filters."""
