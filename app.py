"""dynchat: `python app.py` serves the chat app (the embedded demo preset by default) on 127.0.0.1:7860."""
import sys

from dynchat.config import ConfigError
from dynchat.ui import create_app, launch

try:
    demo = create_app()
except ConfigError as e:      # a malformed models.yaml: one clear line, no traceback
    print(f"dynchat: {e}", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    launch(demo)
