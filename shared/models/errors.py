"""One error type for everything that can go wrong while loading a checkpoint."""


class CheckpointError(ValueError):
    """Raised before anything is half-loaded; the message names the file and the field."""

    def __init__(self, path: object, field: str, problem: str) -> None:
        self.path = str(path)
        self.field = field
        super().__init__(f"{self.path}: {field}: {problem}")
