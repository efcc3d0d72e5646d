"""``python -m meshrun`` is the same as the ``meshrun`` command."""

from meshrun.launcher.cli import main

if __name__ == "__main__":
    main()
