"""What a dashboard request may ask for beyond the job: a page of a long table, and the error for a bad ask.

A week's job has hundreds of restarts and tens of thousands of bundles; its page shows the newest
:data:`PER_PAGE` rows of each table, and ``?restart_page=`` / ``?bundle_page=`` (the API also takes
``offset`` and ``limit``) reach the older ones. Page 1 is the newest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")
PER_PAGE = 50
MAX_LIMIT = 10_000  # rows one API answer may hold (a bundle row reads its manifest)


class BadQuery(ValueError):
    """A query parameter no answer can be given for; its message names the parameter and the fix."""


def pages(total: int, per_page: int = PER_PAGE) -> int:
    """How many pages ``total`` rows fill (at least one: an empty table is one empty page)."""
    return max(1, -(-total // per_page))


def check_page(page: int, what: str) -> None:
    """Refuse a page number below 1 before anything is read (whether a page exists past the newest
    depends on the rows: :func:`page_bounds` says)."""
    if page < 1:
        raise BadQuery(f"{what}={page} does not exist: pages are numbered from 1 (the newest)")


def page_bounds(total: int, page: int, what: str, per_page: int = PER_PAGE) -> tuple[int, int]:
    """The ``[start, stop)`` slice of page ``page`` (1 = the newest) of ``total`` rows stored newest first."""
    check_page(page, what)
    last = pages(total, per_page)
    if page > last:
        raise BadQuery(f"{what}={page} does not exist: the table has {total} row(s) in {last} page(s) of "
                       f"{per_page}; ask for a page from 1 (the newest) to {last}")
    return (page - 1) * per_page, min(total, page * per_page)


def check_window(offset: int, limit: int | None, what: str) -> None:
    """Refuse an ``offset``/``limit`` no table can answer, naming the fix."""
    if offset < 0:
        raise BadQuery(f"offset={offset} is negative: rows are counted from 0 (the newest)")
    if limit is not None and not 1 <= limit <= MAX_LIMIT:
        raise BadQuery(f"limit={limit} is out of range: ask for 1 to {MAX_LIMIT:,} {what} (omit limit for all)")


def window(total: int, offset: int, limit: int | None) -> tuple[int, int]:
    """The ``[start, stop)`` slice of the API's ``offset``/``limit`` (rows counted from the newest)."""
    return min(offset, total), total if limit is None else min(total, offset + limit)


def paged(rows: Sequence[T], page: int, what: str, per_page: int = PER_PAGE) -> tuple[list[T], dict[str, Any]]:
    """Page ``page`` of ``rows`` (stored newest first) and what the page says of itself."""
    start, stop = page_bounds(len(rows), page, what, per_page)
    return list(rows[start:stop]), info(len(rows), page, what, per_page)


def info(total: int, page: int, what: str, per_page: int = PER_PAGE) -> dict[str, Any]:
    """A table page's own description: which page of how many, which rows (1-based, newest first)."""
    start, stop = (page - 1) * per_page, min(total, page * per_page)
    return {"param": what, "page": page, "pages": pages(total, per_page), "per_page": per_page, "total": total,
            "first": start + 1 if stop > start else 0, "last": stop}
