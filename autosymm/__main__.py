"""`python -m autosymm ...` runs the CLI (for checkouts that are not installed)."""

from .cli import main

if __name__ == "__main__":
    main()
