"""The chat application: turns and their comparison (chat), the engine worker process, the session
log (store, SQLAlchemy; no torch), streaming to the page, and the Gradio UI."""
