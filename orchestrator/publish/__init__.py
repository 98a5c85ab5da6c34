"""The publish step after every rank wrote its part: manifest, reader offsets, metric points, retention (runs in
the driver).
"""
