"""The Prometheus exporter (`gpukillctl exporter`): main.py reads the daemon and serves or writes the
metrics, metrics.py names the families, http.py serves /metrics. It imports gpukill, client/, http/ and
itself; never another front end nor cli/.
"""
