"""qsa_lab's version, written once: pyproject.toml reads it for the build, the package face
(`qsa_lab.__version__`) and every layer that records it import it from here."""
__version__ = "0.1.0"
