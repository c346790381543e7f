"""The web dashboard `gpukillctl serve` serves at `/`: the login by one-time link and the session cookie
(session.py), the page and its assets from the package (pages.py, static/), the hosts it shows (hosts.py) and
the live feed every open page shares (hub.py). docs/dashboard.md describes it."""
