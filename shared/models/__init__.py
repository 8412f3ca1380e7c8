"""Models the project builds itself (no hub is reachable): see tiny.py."""
