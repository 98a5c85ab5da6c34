"""The command line: ``spotrun run/submit/verify/history/…``, spec files, the progress line, and ``make demo``
(runs where the user types).
"""
