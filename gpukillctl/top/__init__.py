"""The live terminal views: `gpukillctl top` (app.py draws, model.py holds what it shows) and
`gpukillctl monitor` (monitor.py). It imports gpukill, client/ and itself; never another front end nor cli/.
"""
