"""What a rank leaves for people and for verify: its own output lines and the trace of each update (runs on each
rank).
"""
