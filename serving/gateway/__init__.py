"""xlaserve."""
