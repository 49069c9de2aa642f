"""`python -m autosymm ...` runs the CLI (for checkouts that are not installed)."""

from .cli.main import main

if __name__ == "__main__":
    main()
