"""``python -m packing``: see packing/cli.py."""
import sys

if __name__ == "__main__":
    try:
        from .cli import main
    except KeyboardInterrupt:  # Ctrl-C while the libraries load: one line too, nothing written
        print("error: interrupted; nothing was written that is not complete", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
