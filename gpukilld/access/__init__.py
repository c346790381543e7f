"""Who may do what, and how often: the bouncer (bouncer.py: the table of methods and the polkit question),
who a caller is (people.py), the polkit queue, call rates (callrate.py), refusals logged on a budget
(refusals.py) and which processes a caller may see (visibility.py). It imports the base, proc/, backends/
and sampling/; never rogue/, acts/, guard/ or bus/.
"""
