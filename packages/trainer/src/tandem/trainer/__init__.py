"""tandem-trainer."""
