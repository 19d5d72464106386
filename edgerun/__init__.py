"""edgerun: an embedded edge runtime for devices and drone swarms."""

__version__ = "0.1.0"
