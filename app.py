"""dynchat: `python app.py` serves the chat app (the embedded demo preset by default) on 127.0.0.1:7860."""
from dynchat.ui import create_app, launch

demo = create_app()

if __name__ == "__main__":
    launch(demo)
