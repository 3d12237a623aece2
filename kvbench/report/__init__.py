"""Human-readable output: terminal tables, plots, comparison pages."""
