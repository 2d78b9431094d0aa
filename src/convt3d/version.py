"""The package version (its own module, so that modules needing it need not import the package)."""
__version__ = "0.1.0"
