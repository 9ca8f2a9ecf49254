"""dynchat: `python app.py` serves the chat app (the default preset of models.yaml) on 127.0.0.1:7860."""
import sys

from dynchat.app.store import StoreError
from dynchat.app.ui import create_app, launch, sigterm_interrupts
from dynchat.presets.config import ConfigError

sigterm_interrupts()
try:
    demo = create_app()
except (ConfigError, StoreError) as e:      # a malformed models.yaml, an unusable DYNCHAT_DB: one line, no traceback
    print(f"dynchat: {e}", file=sys.stderr)
    sys.exit(2)
except KeyboardInterrupt:                   # stopped while loading: what started has stopped (atexit)
    sys.exit(130)

if __name__ == "__main__":
    launch(demo)
