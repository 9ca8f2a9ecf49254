"""dynchat: a chat app around an in-process speculative decoding engine."""
__version__ = "0.1.0"
