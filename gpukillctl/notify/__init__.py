"""The desktop notification agent (`gpukillctl notify-agent`): agent.py follows the daemon's signals,
events.py turns them into notices, gate.py decides which to show, desktop.py shows them over the session
bus. It imports gpukill, client/ and itself; never another front end nor cli/.
"""
