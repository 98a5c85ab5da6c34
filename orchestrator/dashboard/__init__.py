"""The restart-history dashboard: ``spotrun dashboard``.

A read-only web app over a storage root. Data flows one way::

    storage root ─► access (jobs, read-only keys) ─► sources (ledger, bundles, metric points)
                 ─► views (jobs, job, restarts, timeline) ─► charts (inline SVG)
                 ─► app (HTML pages + the JSON API) ─► server (uvicorn, bind rule, token)

Every page has a JSON twin under ``/api``; pages are rendered on the server and a
small script refreshes them while a job runs. Every asset is served by the app.
"""

from spotrun.orchestrator.dashboard.app import create_app

__all__ = ["create_app"]
