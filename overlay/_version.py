"""The one place the version is written (pyproject.toml reads it; ``overlay.__version__`` re-exports it)."""

__version__ = "0.2.0.dev0"
