"""Training objectives (placeholder; completed below)."""
