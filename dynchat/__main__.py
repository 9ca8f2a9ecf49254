"""Command line: python -m dynchat {generate,bench,train-demo,export}."""
from dynchat.cli import main

raise SystemExit(main())
