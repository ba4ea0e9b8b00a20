"""tandem-master."""
