"""`python -m benchmarks [--quick]`: run every benchmark and write benchmarks/RESULTS.md."""
import sys

from . import planning


def main() -> None:
    quick = "--quick" in sys.argv
    planning.main(quick=quick)


if __name__ == "__main__":
    main()
