"""The package version (pagoda.__version__)."""

__version__ = "0.1.0"
