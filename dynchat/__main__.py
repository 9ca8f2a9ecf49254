"""`python -m dynchat COMMAND`: the commands are listed in dynchat/cli.py's docstring and by --help."""
from dynchat.cli import main

raise SystemExit(main())
