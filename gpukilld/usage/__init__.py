"""GPU usage accounting: who used which GPU, how much, for how long.

account.py integrates each snapshot into records per (process, GPU); keeper.py runs it on the main loop, writes
the closed records to the journal (journal_form.py: the fields, the message, and back) and to the store
(store.py, usage.sqlite; rebuilt from the journal by journal_read.py), and keeps the running totals across
restarts (state.py). query.py checks GetUsage's query.
"""
