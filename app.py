"""dynchat: `python app.py` serves the chat app (the default preset of models.yaml) on 127.0.0.1:7860."""
import sys

from dynchat.config import ConfigError
from dynchat.store import StoreError
from dynchat.ui import create_app, launch

try:
    demo = create_app()
except (ConfigError, StoreError) as e:      # a malformed models.yaml, an unusable DYNCHAT_DB: one line, no traceback
    print(f"dynchat: {e}", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    launch(demo)
