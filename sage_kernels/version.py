"""The package's version, in a leaf module: `sage_kernels/__init__.py` re-exports it, `native_build.py` names
its build folders with it (without importing the package's public API), and pyproject.toml reads it statically."""

__version__ = "0.1.0"
