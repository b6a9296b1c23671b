"""Errors the engine raises for bad checkpoints and bad requests."""


class ModelError(ValueError):
    """A checkpoint that cannot be served: the message names the file or tensor."""
