"""The server's limits on requests and connections, each declared once with its default.

The command line (`__main__`) sets them, the application (`app`, `middleware`) enforces the
request limits and the connection guard (`connections`) the connection limits;
docs/operations.md lists them with the answer past each.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Limits:
    """max_request_bytes: request body size; larger is 413.
    max_rows_per_request: rows one request may ask for (prompts x n); more is 400 before any
      work. Each row is a sequence the engine decodes; 20,000 prompts x n=16 in a 0.1 MiB body
      once froze the server for a minute.
    max_connections: open connections; one more is answered 503 and closed at once. Lowered at
      start to what the open-files limit leaves room for.
    header_timeout: seconds a connection has to send a request's head (from its opening, or
      from the end of the previous response); then it is answered 408 and closed.
    body_timeout: seconds to receive a request's body once its head has arrived; then 408.
    """

    max_request_bytes: int = 4 * 2**20
    max_rows_per_request: int = 256
    max_connections: int = 512
    header_timeout: float = 10.0
    body_timeout: float = 60.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)!r}")
