"""tandem-reward."""
