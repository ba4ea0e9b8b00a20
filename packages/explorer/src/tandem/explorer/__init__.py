"""tandem-explorer."""
