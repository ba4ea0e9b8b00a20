"""tandem-buffer."""
