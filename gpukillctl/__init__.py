"""gpukillctl: the unprivileged gpukill client (CLI and library API over D-Bus)."""
