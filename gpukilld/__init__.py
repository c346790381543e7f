"""gpukilld: the privileged gpukill daemon."""

__version__ = "0.1.0"
