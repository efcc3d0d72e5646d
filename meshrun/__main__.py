"""``python -m meshrun`` is the same as the ``meshrun`` command."""

from meshrun._console import console_main

if __name__ == "__main__":
    console_main()
