"""Command-line interface (click). Wiring only: every computation lives in the library."""
