"""`python -m kvbench ...` is the `kvbench` command (for an environment whose scripts are not on
PATH)."""

from .cli import main

if __name__ == "__main__":
    main()
